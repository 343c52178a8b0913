#!/usr/bin/env python3
"""Summarises tools/gpu/spec_sampling_h200.sh: per mode and batch size, tokens/s with sampling
on the device (two runs) and on the host, their ratio, tau, and whether the three runs' outputs
are identical (digests); then the f32 GPU outputs against the CPU's, and the greedy check.
Usage: spec_sampling_summary.py OUT_DIR CPU_JSON"""
import json
import os
import sys

out, cpu_path = sys.argv[1], sys.argv[2]


def load(name):
    p = os.path.join(out, name)
    return json.load(open(p)) if os.path.exists(p) else None


def by_key(doc):
    return {(r["mode"], r["batch_size"]): r for r in doc["results"]} if doc else {}


runs = {tag: by_key(load(f"bf16_{tag}.json")) for tag in ["on1", "off", "on2"]}
print("bf16, graphs, MT-bench 1-20, 128 tokens, temperature 0.8, top_p 0.9, seed 3")
print(f"{'mode':48s} {'batch':>5s} {'device':>15s} {'host':>8s} {'dev/host':>9s} {'tau':>5s}  same outputs")
for key in runs["on1"]:
    on1, off, on2 = (runs[t].get(key) for t in ["on1", "off", "on2"])
    if not (on1 and off and on2):
        continue
    dev = (on1["tokens_per_s"] + on2["tokens_per_s"]) / 2
    same = on1["output_digest"] == off["output_digest"] == on2["output_digest"]
    print(
        f"{key[0]:48s} {key[1]:5d} {on1['tokens_per_s']:7.1f}/{on2['tokens_per_s']:7.1f}"
        f" {off['tokens_per_s']:8.1f} {dev / off['tokens_per_s']:8.2f}x {on1['mean_accepted_len']:5.2f}  {same}"
    )

gpu, cpu = load("gpu_f32.json"), json.load(open(cpu_path)) if os.path.exists(cpu_path) else None
if gpu and cpu:
    print("\nf32, MT-bench 1-3, 32 tokens, same sampling: GPU (device sampling) against the CPU")
    cpu_by = by_key(cpu)
    for key, r in by_key(gpu).items():
        c = cpu_by.get(key)
        same = c is not None and c["output_digest"] == r["output_digest"]
        print(f"{key[0]:48s} tau {r['mean_accepted_len']:.2f}  identical to the CPU: {same}")

greedy = load("bf16_greedy.json")
if greedy:
    print("\ngreedy, bf16: every mode's output equal to plain decoding's")
    for r in greedy["results"]:
        print(f"{r['mode']:48s} {r['tokens_per_s']:7.1f} tok/s  tau {r['mean_accepted_len']:.2f}  same as plain: {r['same_output_as_plain']}")
