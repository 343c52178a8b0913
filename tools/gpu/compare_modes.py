"""Summarises spec-run --output_json files in a folder: tokens/s, tau (tokens per target
step) and whether each mode's output ids equal plain decoding's (plain.json)."""
import json, sys, os
out = sys.argv[1]
plain = [o["output_ids"] for o in json.load(open(f"{out}/plain.json"))["outputs"]]
for f in sorted(os.listdir(out)):
    if not f.endswith(".json"):
        continue
    doc = json.load(open(f"{out}/{f}"))
    if not isinstance(doc, dict) or "outputs" not in doc:
        continue  # a training log or a data set's metadata, not a spec-run result
    ids = [o["output_ids"] for o in doc["outputs"]]
    steps = sum(o["stats"]["steps"] for o in doc["outputs"])
    toks = sum(len(o["output_ids"]) - 1 for o in doc["outputs"])
    print(f"{f:28s} tok/s {doc['tokens_per_s']:8.1f}  tau {toks/max(steps,1):.2f}  same_as_plain {ids == plain}")
