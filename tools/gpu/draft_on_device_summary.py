#!/usr/bin/env python3
"""Summarises tools/gpu/draft_on_device_h200.sh: per mode and batch size, tokens/s and the
drafting time per step with drafted tokens on the device (two runs) and fetched per level
(one run), tau, whether each mode's output equals plain decoding's, and whether the runs'
outputs are identical (digests). Usage: draft_on_device_summary.py OUT_DIR"""
import json
import os
import sys

out = sys.argv[1]


def results(name):
    path = os.path.join(out, f"{name}.json")
    if not os.path.exists(path):
        return {}
    return {(r["mode"], r["batch_size"]): r for r in json.load(open(path))["results"]}


def table(title, tags):
    runs = {t: results(t) for t in tags}
    print(title)
    print(f"{'mode':44s} {'batch':>5s} {'tok/s on':>15s} {'off':>7s} {'on/off':>7s}"
          f" {'draft ms/step on/off':>21s} {'tau':>5s} {'=plain':>6s} same")
    for key, first in runs[tags[0]].items():
        rs = [runs[t].get(key) for t in tags]
        if not all(rs):
            continue
        on = [r for t, r in zip(tags, rs) if not t.endswith("off")]
        off = next(r for t, r in zip(tags, rs) if t.endswith("off"))
        speed = sum(r["tokens_per_s"] for r in on) / len(on)
        draft_on = sum(1e3 * r["draft_s"] / r["steps"] for r in on) / len(on)
        draft_off = 1e3 * off["draft_s"] / off["steps"]
        same = len({r["output_digest"] for r in rs}) == 1
        shown = "/".join(f"{r['tokens_per_s']:.0f}" for r in on)
        plain = first.get("same_output_as_plain")
        print(f"{key[0]:44s} {key[1]:5d} {shown:>15s} {off['tokens_per_s']:7.0f}"
              f" {speed / off['tokens_per_s']:6.2f}x {draft_on:10.3f}/{draft_off:.3f}"
              f" {first.get('mean_accepted_len') or 1:5.2f} {str(plain):>6s} {same}")


table("greedy, bf16, graphs, MT-bench 1-20, 128 tokens (on, on, off)", ["greedy_on1", "greedy_on2", "greedy_off"])
print()
table("sampled token matching (temperature 0.8, top_p 0.9, seed 3), MT-bench 1-10", ["sampled_on", "sampled_off"])
