#!/usr/bin/env python3
"""Summarises tools/gpu/draft_on_device_h200.sh: per mode and batch size, tokens/s and the
drafting time per step with drafted tokens on the device and fetched per level (the mean of
each side's runs, with their range), tau, whether each mode's output equals plain decoding's,
and whether all runs' outputs are identical (digests). Usage: draft_on_device_summary.py OUT_DIR"""
import glob
import json
import os
import sys

out = sys.argv[1]


def results(path):
    return {(r["mode"], r["batch_size"]): r for r in json.load(open(path))["results"]}


def mean(xs):
    return sum(xs) / len(xs)


def table(title, prefix):
    paths = sorted(glob.glob(os.path.join(out, f"{prefix}_*.json")))
    runs = {os.path.basename(p)[len(prefix) + 1:-5]: results(p) for p in paths}
    on = [r for tag, r in runs.items() if tag.startswith("on")]
    off = [r for tag, r in runs.items() if tag.startswith("off")]
    if not (on and off):
        return
    print(f"{title} ({len(on)} runs on, {len(off)} off)")
    print(f"{'mode':44s} {'batch':>5s} {'tok/s on (range)':>20s} {'off (range)':>18s} {'on/off':>7s}"
          f" {'draft ms/step on/off':>21s} {'tau':>5s} {'=plain':>6s} same")
    for key, first in on[0].items():
        if not all(key in r for r in on + off):
            continue
        speed = [[r[key]["tokens_per_s"] for r in side] for side in (on, off)]
        draft = [mean([1e3 * r[key]["draft_s"] / r[key]["steps"] for r in side]) for side in (on, off)]
        same = len({r[key]["output_digest"] for r in on + off}) == 1
        shown = [f"{mean(s):.0f} ({min(s):.0f}-{max(s):.0f})" for s in speed]
        print(f"{key[0]:44s} {key[1]:5d} {shown[0]:>20s} {shown[1]:>18s} {mean(speed[0]) / mean(speed[1]):6.2f}x"
              f" {draft[0]:10.3f}/{draft[1]:.3f} {first.get('mean_accepted_len') or 1:5.2f}"
              f" {str(first.get('same_output_as_plain')):>6s} {same}")


table("greedy, bf16, graphs, MT-bench 1-20, 128 tokens", "greedy")
print()
table("sampled token matching (temperature 0.8, top_p 0.9, seed 3), MT-bench 1-10", "sampled")
