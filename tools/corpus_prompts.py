#!/usr/bin/env python3
"""The prompts SmolLM2 answers for heads/smollm2-ngram/corpus.safetensors: the first user turn of
every ShareGPT conversation in ShareGPT_V3_filtered_1000.json and of the first SG90K in
sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json, and the first GSM8K GSM8K train
questions (each cut to 1,500 characters), as JSONL for spec-run --input_file. None is an
MT-bench question (checked below): MT-bench is what the corpus is measured on.

usage: python3 tools/corpus_prompts.py ../shared/data OUT.jsonl [SG90K GSM8K]
(defaults 1500 1000: 3,500 prompts; "all all" takes every one: 11,430)
"""
import json
import sys

data, out_path = sys.argv[1], sys.argv[2]
sg90k, gsm8k = (sys.argv[3:5] + ["1500", "1000"][len(sys.argv[3:5]):])
sg90k, gsm8k = (None if v == "all" else int(v) for v in (sg90k, gsm8k))


def first_user_turn(conv):
    for turn in conv.get("conversations", []):
        if turn.get("from") in ("human", "user"):
            return turn.get("value")
    return None


prompts = []
for name, limit in [("ShareGPT_V3_filtered_1000.json", None),
                    ("sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json", sg90k)]:
    taken = 0
    for conv in json.load(open(f"{data}/sharegpt/{name}")):
        text = first_user_turn(conv)
        if text and (limit is None or taken < limit):
            prompts.append(text[:1500])
            taken += 1
prompts += [json.loads(line)["question"] for line in open(f"{data}/gsm8k/train.jsonl")][:gsm8k]

mt_bench = [json.loads(line)["turns"][0] for line in open(f"{data}/mt_bench/question.jsonl")]
overlap = [q for q in mt_bench if any(q[:80] in p for p in prompts)]
if overlap:
    sys.exit(f"{len(overlap)} MT-bench questions are among the prompts, e.g. {overlap[0][:60]!r}")
with open(out_path, "w") as f:
    for p in prompts:
        f.write(json.dumps({"prompt": p}) + "\n")
print(f"{len(prompts)} prompts to {out_path}")
