#!/usr/bin/env python3
"""Independent numpy Llama forward over tests/fixtures/tiny/* (no transformers).

Reads config.json (both the transformers-5 "rope_parameters" format and the
legacy top-level "rope_theta"/"rope_scaling" format) and the weights
(model.safetensors, sharded safetensors via model.safetensors.index.json, or
pytorch_model.bin), recomputes last-position logits and the 32-token greedy
continuation, and compares them with expected.json. It is a readable spec of
what the Rust forward pass must do, and proves the fixtures mean what the docs
say (e.g. that llama3 rope scaling is really applied).

    .venv/bin/python tools/tiny_numpy_reference.py   # see make_tiny_fixtures.py for setup
"""
import json
import math
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "tests", "fixtures", "tiny")


def load_weights(d):
    if os.path.exists(os.path.join(d, "pytorch_model.bin")):
        import torch
        sd = torch.load(os.path.join(d, "pytorch_model.bin"), map_location="cpu", weights_only=True)
        return {k: v.numpy() for k, v in sd.items()}
    from safetensors.numpy import load_file
    idx = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) \
        else ["model.safetensors"]
    w = {}
    for f in files:
        w.update(load_file(os.path.join(d, f)))
    return w


def rope_params(cfg):
    rp = cfg.get("rope_parameters")
    if rp is None:  # legacy format
        rp = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
        rp["rope_theta"] = cfg.get("rope_theta", 10000.0)
    return rp


def inv_freq(cfg):
    hd = cfg["head_dim"]
    rp = rope_params(cfg)
    inv = 1.0 / (rp["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.int64).astype(np.float32) / hd))
    t = rp.get("rope_type", rp.get("type", "default"))
    if t == "llama3":
        f, lo, hi, old = (rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"],
                          rp["original_max_position_embeddings"])
        lo_wl, hi_wl = old / lo, old / hi
        wl = 2 * math.pi / inv
        out = np.where(wl > lo_wl, inv / f, inv)
        smooth = (old / wl - lo) / (hi - lo)
        sm = (1 - smooth) * out / f + smooth * out
        mid = ~(wl < hi_wl) & ~(wl > lo_wl)
        inv = np.where(mid, sm, out)
    else:
        assert t == "default", t
    return inv.astype(np.float32)


def rmsnorm(x, w, eps):
    v = (x.astype(np.float32) ** 2).mean(-1, keepdims=True)
    return w * (x / np.sqrt(v + eps))


def forward(cfg, w, ids):
    H, KV, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps = cfg["rms_norm_eps"]
    T = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    ang = np.arange(T, dtype=np.float32)[:, None] * inv_freq(cfg)[None]
    emb = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(emb), np.sin(emb)

    def rope(q):  # (h, T, hd), rotate_half convention (HF layout)
        q1, q2 = q[..., : hd // 2], q[..., hd // 2:]
        return q * cos + np.concatenate([-q2, q1], -1) * sin

    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rmsnorm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, H, hd).transpose(1, 0, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, KV, hd).transpose(1, 0, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, KV, hd).transpose(1, 0, 2)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, H // KV, 0), np.repeat(v, H // KV, 0)
        s = q @ k.transpose(0, 2, 1) / math.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v
        x = x + a.transpose(1, 0, 2).reshape(T, H * hd) @ w[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, w[p + "post_attention_layernorm.weight"], eps)
        g = h @ w[p + "mlp.gate_proj.weight"].T
        u = h @ w[p + "mlp.up_proj.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, w["model.norm.weight"], eps)
    lm = w.get("lm_head.weight")
    if lm is None:
        assert cfg["tie_word_embeddings"]
        lm = w["model.embed_tokens.weight"]
    return x[-1] @ lm.T


def main():
    worst = 0.0
    for name in sorted(os.listdir(TINY)):
        d = os.path.join(TINY, name)
        cfg = json.load(open(os.path.join(d, "config.json")))
        exp = json.load(open(os.path.join(d, "expected.json")))
        w = {k: v.astype(np.float32) for k, v in load_weights(d).items()}
        errs = []
        for p, want, greedy in zip(exp["prompts"], exp["last_logits"], exp["greedy"]):
            got = forward(cfg, w, p)
            errs.append(float(np.abs(got - np.array(want, np.float32)).max()))
            seq = list(p)
            for _ in range(len(greedy)):
                seq.append(int(np.argmax(forward(cfg, w, seq))))
            assert seq[len(p):] == greedy, f"{name}: greedy mismatch"
        worst = max(worst, max(errs))
        print(f"{name}: max |logit diff| {max(errs):.2e}, greedy identical")
    assert worst < 1e-3, worst
    print("OK")


if __name__ == "__main__":
    sys.exit(main())
