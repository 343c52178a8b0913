#!/usr/bin/env python3
"""Summarises tools/gpu/spec_sampling_h200.sh. `run`: per mode and batch size, tokens/s with
sampling on the device (two runs) and on the host, their ratio, tau, and whether the runs'
outputs are identical (digests); the f32 GPU outputs against the CPU's; the greedy check.
`tree`: the same for EAGLE's exact and typical acceptance (one device run each).
Usage: spec_sampling_summary.py OUT_DIR CPU_DIR run|tree"""
import json
import os
import sys

out, cpu_dir, stage = sys.argv[1], sys.argv[2], sys.argv[3]


def load(path):
    return json.load(open(path)) if os.path.exists(path) else None


def by_key(doc):
    return {(r["mode"], r["batch_size"]): r for r in doc["results"]} if doc else {}


def speed_table(title, tags):
    runs = {t: by_key(load(os.path.join(out, f"{t}.json"))) for t in tags}
    device = [t for t in tags if not t.endswith("off")]
    host = next(t for t in tags if t.endswith("off"))
    print(title)
    print(f"{'mode':48s} {'batch':>5s} {'device':>15s} {'host':>8s} {'dev/host':>9s} {'tau':>5s}  same outputs")
    for key in runs[device[0]]:
        rs = [runs[t].get(key) for t in tags]
        if not all(rs):
            continue
        on = [runs[t][key]["tokens_per_s"] for t in device]
        off = runs[host][key]
        same = len({r["output_digest"] for r in rs}) == 1
        shown = "/".join(f"{v:7.1f}" for v in on)
        print(
            f"{key[0]:48s} {key[1]:5d} {shown:>15s} {off['tokens_per_s']:8.1f}"
            f" {sum(on) / len(on) / off['tokens_per_s']:8.2f}x {rs[0]['mean_accepted_len']:5.2f}  {same}"
        )


def cpu_table(title, gpu_name, cpu_name):
    gpu, cpu = load(os.path.join(out, gpu_name)), load(os.path.join(cpu_dir, cpu_name))
    if not (gpu and cpu):
        return
    print(f"\n{title}")
    cpu_by = by_key(cpu)
    for key, r in by_key(gpu).items():
        c = cpu_by.get(key)
        same = c is not None and c["output_digest"] == r["output_digest"]
        print(f"{key[0]:48s} tau {r['mean_accepted_len']:.2f}  identical to the CPU: {same}")


if stage == "run":
    speed_table(
        "bf16, graphs, MT-bench 1-20, 128 tokens, temperature 0.8, top_p 0.9, seed 3",
        ["bf16_on1", "bf16_on2", "bf16_off"],
    )
    cpu_table("f32, MT-bench 1-3, 32 tokens, same sampling: GPU (device sampling) against the CPU",
              "gpu_f32.json", "cpu_sampled.json")
    greedy = load(os.path.join(out, "bf16_greedy.json"))
    if greedy:
        print("\ngreedy, bf16: every mode's output equal to plain decoding's")
        for r in greedy["results"]:
            print(f"{r['mode']:48s} {r['tokens_per_s']:7.1f} tok/s  tau {r['mean_accepted_len']:.2f}"
                  f"  same as plain: {r['same_output_as_plain']}")
else:
    for rule in ["exact", "typical"]:
        speed_table(f"\n{rule}: bf16, graphs, MT-bench 1-10, 128 tokens, temperature 0.8, top_p 0.9, seed 3",
                    [f"bf16_{rule}_on", f"bf16_{rule}_off"])
        cpu_table(f"{rule}, f32, MT-bench 1-3, 32 tokens: GPU against the CPU",
                  f"gpu_f32_{rule}.json", f"cpu_{rule}.json")
