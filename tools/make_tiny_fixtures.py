#!/usr/bin/env python3
"""Build tiny random Llama checkpoints + HF transformers reference outputs.

These fixtures let the Rust forward pass (and loader) be checked for exactness
against HF transformers without downloading anything.

Setup (any machine; CPU-only torch is fine):

    python3 -m venv .venv
    .venv/bin/pip install torch transformers gguf safetensors numpy

Generate (from the repo root; rewrites tests/fixtures/tiny/ byte-for-byte
identically on rerun with the same torch/transformers versions):

    .venv/bin/python tools/make_tiny_fixtures.py            # build + self-check
    .venv/bin/python tools/make_tiny_fixtures.py --check    # only re-verify the
                                                            # committed fixtures

Fixtures were produced with torch 2.15.0 (CPU) and transformers 5.24.0.

Layout: tests/fixtures/tiny/<name>/
    config.json                     HF config (see "config formats" below)
    model.safetensors               float32 weights (save_pretrained)
      | model-0000{1,2}-of-00002.safetensors + model.safetensors.index.json  (sharded)
      | pytorch_model.bin           torch.save(state_dict) zip pickle       (bin)
    expected.json

Checkpoints (vocab 256, hidden 64, head_dim 16, float32, rms_norm_eps 1e-5):
    mha          4 heads / 4 kv heads, 2 layers, intermediate 128, untied,
                 rope_theta 10000 (default rope)
    gqa          4 heads / 2 kv heads, 2 layers, intermediate 192, TIED
                 embeddings (no lm_head.weight in the file), rope_theta 10000
    mqa          4 heads / 1 kv head, 3 layers, intermediate 128, untied,
                 rope_theta 1e6
    llama3_rope  4 heads / 2 kv heads, 2 layers, intermediate 128, untied,
                 rope_theta 500000, rope_scaling llama3 {factor 8,
                 low_freq_factor 1, high_freq_factor 4,
                 original_max_position_embeddings 64}, max_position_embeddings 128.
                 original_max_position_embeddings is 64 (not 32) on purpose:
                 with head_dim 16 / theta 5e5 the 8 rotary wavelengths are
                 ~6.3, 32.3, 167, 860, ... With 32 the "smooth" interpolation
                 band [8, 32] would contain no frequency (and 32.3 would sit
                 right at the threshold); with 64 the band [16, 64] contains
                 exactly one (32.3), so all three llama3 branches (keep /
                 smooth / divide by factor) are exercised, none near a boundary.
    sharded      mha config but 1 layer (size budget), saved with max_shard_size
                 so there are 2 safetensors shards + model.safetensors.index.json.
    bin          identical config + weights to sharded, saved as
                 pytorch_model.bin (transformers 5 dropped
                 save_pretrained(safe_serialization=False), so this is
                 torch.save(model.state_dict()), which is what older transformers
                 wrote). expected.json equals sharded's except "name".

Config formats: transformers 5 writes rope settings as
    "rope_parameters": {"rope_theta": ..., "rope_type": ..., ...}
while real-world checkpoints (Llama 3, SmolLM2, ...) use the legacy top-level
"rope_theta" + "rope_scaling". mha/gqa/sharded/bin keep the transformers-5
format; mqa and llama3_rope are rewritten to the legacy format (no
rope_parameters key), and the self-check reloads them with transformers to prove
they are read identically. A Rust loader must accept both.

Weights: not transformers' default init (std 0.02 gives flat logits). After
building the model with torch.manual_seed(seed), every parameter is overwritten
in sorted-name order from a torch.Generator(seed):
    RMSNorm weights     1 + 0.2*N(0,1)   (non-trivial, so a loader that ignores
                                          norm weights fails)
    embed_tokens        N(0,1) * 0.3
    q_proj, k_proj      N(0,1) * 2/sqrt(fan_in)   (peaky attention => RoPE and
                                                   positions matter)
    o_proj, down_proj   N(0,1) * 2/sqrt(fan_in)
    lm_head             N(0,1) * 3/sqrt(fan_in)
    other linears       N(0,1) * 1/sqrt(fan_in)

Tokens: bos_token_id = 1, eos_token_id = 255 (= vocab-1), no pad. Prompts are
[bos] + random ids in [2, 254]. The script asserts eos is never the argmax in
any greedy step, so HF generate(min_new_tokens=32) == plain argmax loop, i.e.
Rust can just take argmax 32 times with no eos handling.

expected.json schema:
{
  "name": str,
  "transformers_version": str, "torch_version": str,
  "dtype": "float32", "attn_implementation": "eager",
  "bos_token_id": 1, "eos_token_id": 255,
  "prompts":      [[int, ...], ...],   # 4 prompts, lengths 3, 7, 12, 20 (incl. bos)
  "last_logits":  [[float x vocab], ...],  # logits at the last prompt position of
                                           # one forward over the prompt; float32
                                           # values written as the shortest repr
                                           # that round-trips to the same f32
  "greedy":       [[int x 32], ...],   # generated ids (prompt not included)
  "greedy_min_margin": [float, ...],   # per prompt: smallest top1-top2 logit gap
                                       # over the 32 greedy steps (how much
                                       # numerical slack a Rust impl has)
  "greedy_step_logits_max": [[float x 32], ...]  # top-1 logit value at each
                                                  # greedy step (no-cache forward)
}
Greedy ids were produced by model.generate(do_sample=False, max_new_tokens=32,
min_new_tokens=32) (KV cache) and asserted equal to a manual no-cache argmax
loop (full forward over prompt+generated at every step).
"""

import argparse
import hashlib
import json
import math
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(REPO, "tests", "fixtures", "tiny")

VOCAB = 256
BOS = 1
EOS = VOCAB - 1
N_NEW = 32
PROMPT_LENS = [3, 7, 12, 20]
EMB_STD = 0.3   # embed_tokens std
OUT_GAIN = 2.0  # o_proj / down_proj gain (residual updates must beat the
                # token's own embedding, else tied models just echo input)

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    head_dim=16,
    num_attention_heads=4,
    rms_norm_eps=1e-5,
    bos_token_id=BOS,
    eos_token_id=EOS,
    pad_token_id=None,
    max_position_embeddings=256,
)

# name -> (seed, config overrides, save format, legacy config format?)
SPECS = {
    "mha": (1001, dict(num_key_value_heads=4, num_hidden_layers=2, intermediate_size=128,
                       tie_word_embeddings=False, rope_theta=10000.0), "safetensors", False),
    "gqa": (1002, dict(num_key_value_heads=2, num_hidden_layers=2, intermediate_size=192,
                       tie_word_embeddings=True, rope_theta=10000.0), "safetensors", False),
    "mqa": (1003, dict(num_key_value_heads=1, num_hidden_layers=3, intermediate_size=128,
                       tie_word_embeddings=False, rope_theta=1000000.0), "safetensors", True),
    "llama3_rope": (1004, dict(num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128,
                               tie_word_embeddings=False, rope_theta=500000.0,
                               max_position_embeddings=128,
                               rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}),
                    "safetensors", True),
    # sharded and bin: identical config + weights to each other (1 layer, to keep
    # the committed fixtures small), so a Rust test can also compare the tensors
    # loaded from the two formats.
    "sharded": (1005, None, "sharded", False),
    "bin": (1005, None, "bin", False),
}


def build_config(name):
    seed, over, _, _ = SPECS[name]
    if over is None:
        over = dict(SPECS["mha"][1], num_hidden_layers=1)
    kw = dict(BASE)
    kw.update(over)
    theta = kw.pop("rope_theta")
    scaling = kw.pop("rope_scaling", None)
    rope = {"rope_type": "default", "rope_theta": theta}
    if scaling is not None:
        rope = dict(scaling)
        rope["rope_theta"] = theta
    cfg = LlamaConfig(rope_parameters=rope, **kw)
    cfg._attn_implementation = "eager"
    return cfg, theta, scaling


def build_model(name):
    seed = SPECS[name][0]
    cfg, _, _ = build_config(name)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        params = dict(model.named_parameters())  # tied lm_head is deduplicated
        for pname in sorted(params):
            p = params[pname]
            z = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * z)
            elif "embed_tokens" in pname:
                p.copy_(z * EMB_STD)
            else:
                fan_in = p.shape[1]
                if pname.endswith(("q_proj.weight", "k_proj.weight")):
                    s = 2.0
                elif pname.endswith(("o_proj.weight", "down_proj.weight")):
                    s = OUT_GAIN
                elif pname == "lm_head.weight":
                    s = 3.0
                else:
                    s = 1.0
                p.copy_(z * (s / math.sqrt(fan_in)))
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    return model


def make_prompts(seed):
    g = torch.Generator().manual_seed(seed + 7)
    out = []
    for n in PROMPT_LENS:
        ids = torch.randint(2, EOS, (n - 1,), generator=g).tolist()
        out.append([BOS] + ids)
    return out


def f32_list(t):
    return [float(x) for x in t.detach().to(torch.float32).numpy()]


def dump_json(obj, path):
    """JSON with scalar lists on one line; every float is written as the
    shortest decimal that round-trips to the same float32 (str(np.float32))."""

    def enc(o, indent=0):
        pad = " " * indent
        if isinstance(o, dict):
            items = [f"{pad}  {json.dumps(k)}: {enc(v, indent + 2).lstrip()}" for k, v in o.items()]
            return pad + "{\n" + ",\n".join(items) + "\n" + pad + "}"
        if isinstance(o, list):
            if all(not isinstance(x, (list, dict)) for x in o):
                return pad + "[" + ", ".join(enc(x) for x in o) + "]"
            return pad + "[\n" + ",\n".join(enc(x, indent + 2) for x in o) + "\n" + pad + "]"
        if isinstance(o, float):
            assert math.isfinite(o)
            return pad + str(np.float32(o))
        return pad + json.dumps(o)

    with open(path, "w") as f:
        f.write(enc(obj) + "\n")


@torch.no_grad()
def reference(model, prompts):
    last_logits, greedy, margins, step_max = [], [], [], []
    for p in prompts:
        ids = torch.tensor([p])
        logits = model(ids).logits[0, -1].float()
        last_logits.append(logits)
        # manual no-cache argmax loop
        seq = list(p)
        toks, mins, tops = [], math.inf, []
        for _ in range(N_NEW):
            lg = model(torch.tensor([seq])).logits[0, -1].float()
            top2 = torch.topk(lg, 2)
            t = int(top2.indices[0])
            assert t != EOS, "eos would be generated; pick another seed"
            mins = min(mins, float(top2.values[0] - top2.values[1]))
            tops.append(float(top2.values[0]))
            toks.append(t)
            seq.append(t)
        # HF generate with KV cache
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                             pad_token_id=EOS, eos_token_id=EOS)
        gen = gen[0, len(p):].tolist()
        assert gen == toks, f"generate (cache) != manual no-cache argmax:\n{gen}\n{toks}"
        assert len(set(toks)) > 1, "degenerate greedy output"
        greedy.append(toks)
        margins.append(mins)
        step_max.append(tops)
    return last_logits, greedy, margins, step_max


def legacyize_config(path, theta, scaling):
    with open(path) as f:
        cfg = json.load(f)
    cfg.pop("rope_parameters")
    cfg["rope_theta"] = theta
    cfg["rope_scaling"] = dict(sorted(scaling.items())) if scaling is not None else None
    cfg = dict(sorted(cfg.items()))
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")


def save(name, model, d):
    _, fmt, legacy = SPECS[name][1:]
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    if fmt == "safetensors":
        model.save_pretrained(d)
    elif fmt == "sharded":
        model.save_pretrained(d, max_shard_size="200KB")
        shards = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
        assert len(shards) == 2 and os.path.exists(os.path.join(d, "model.safetensors.index.json")), shards
    elif fmt == "bin":
        model.config.save_pretrained(d)
        sd = {k: v.contiguous() for k, v in model.state_dict().items()}
        torch.save(sd, os.path.join(d, "pytorch_model.bin"))
    else:
        raise ValueError(fmt)
    gc = os.path.join(d, "generation_config.json")
    if os.path.exists(gc):
        os.remove(gc)  # not needed; keeps the fixture minimal
    if legacy:
        _, theta, scaling = build_config(name)
        legacyize_config(os.path.join(d, "config.json"), theta, scaling)


def load_from_disk(d, name):
    kw = dict(dtype=torch.float32, attn_implementation="eager")
    if SPECS[name][2] == "bin":
        kw["use_safetensors"] = False
    return LlamaForCausalLM.from_pretrained(d, **kw).eval()


def check(name, d, ref_model=None):
    with open(os.path.join(d, "expected.json")) as f:
        exp = json.load(f)
    m = load_from_disk(d, name)
    if ref_model is not None:
        sd_ref, sd = ref_model.state_dict(), m.state_dict()
        assert sd_ref.keys() == sd.keys(), (sd_ref.keys() ^ sd.keys())
        for k in sd_ref:
            assert torch.equal(sd_ref[k], sd[k]), k
    ll, greedy, _, _ = reference(m, exp["prompts"])
    for a, b in zip(ll, exp["last_logits"]):
        got = np.array(a.numpy(), dtype=np.float32)
        want = np.array(b, dtype=np.float32)
        assert np.array_equal(got, want), f"{name}: logits differ, max {np.abs(got - want).max()}"
    assert greedy == exp["greedy"], f"{name}: greedy differs"
    print(f"  check {name}: reload from disk -> logits bit-exact, greedy identical")


def sha(path):
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(path)):
        for fn in sorted(files):
            p = os.path.join(root, fn)
            h.update(os.path.relpath(p, path).encode())
            with open(p, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true", help="only verify committed fixtures")
    args = ap.parse_args()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # fixed reduction order => reproducible bits

    if args.check:
        for name in SPECS:
            check(name, os.path.join(OUT, name))
        return

    os.makedirs(OUT, exist_ok=True)
    for name in SPECS:
        d = os.path.join(OUT, name)
        model = build_model(name)
        prompts = make_prompts(SPECS[name][0])
        ll, greedy, margins, step_max = reference(model, prompts)
        save(name, model, d)
        exp = {
            "name": name,
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "dtype": "float32",
            "attn_implementation": "eager",
            "bos_token_id": BOS,
            "eos_token_id": EOS,
            "prompts": prompts,
            "last_logits": [f32_list(x) for x in ll],
            "greedy": greedy,
            "greedy_min_margin": margins,
            "greedy_step_logits_max": step_max,
        }
        dump_json(exp, os.path.join(d, "expected.json"))
        print(f"{name}: {sum(p.numel() for p in model.parameters())} params, "
              f"min greedy margin {min(margins):.4f}, distinct greedy ids "
              f"{[len(set(g)) for g in greedy]}")
        check(name, d, ref_model=model)
    print("tree sha256:", sha(OUT))


if __name__ == "__main__":
    main()
