#!/usr/bin/env python3
"""Per-category table of spec-bench runs (one JSON per MT-bench category, named mt_<category>.json):
tokens/s, speedup over plain decoding and mean accepted length per mode, then all categories
pooled (τ = tokens from decode steps / steps, the first token of each request coming from its
prefill; speed = generated tokens / seconds, over every category).

Usage: python3 tools/gpu/mt_bench_categories.py OUT/mt_*.json
"""
import json
import os
import sys
from collections import defaultdict


def main(paths):
    if not paths:
        sys.exit("usage: mt_bench_categories.py mt_<category>.json ...")
    pooled = defaultdict(lambda: [0, 0, 0.0, 0])  # mode -> [tokens, steps, seconds, requests]
    same = defaultdict(lambda: True)
    modes = []
    rows = []
    for path in sorted(paths):
        cat = os.path.basename(path)[len("mt_"):-len(".json")]
        results = [r for r in json.load(open(path))["results"] if r["batch_size"] == 1]
        for r in results:
            if r["mode"] not in modes:
                modes.append(r["mode"])
            p = pooled[r["mode"]]
            p[0] += r["generated_tokens"]
            p[1] += r["steps"]
            p[2] += r["seconds"]
            p[3] += r["requests"]
            if r["same_output_as_plain"] is False:
                same[r["mode"]] = False
        rows.append((cat, {r["mode"]: r for r in results}))
    short = [m.rsplit("/", 1)[-1] for m in modes]
    print("| category | " + " | ".join(short) + " |")
    print("|---" * (len(modes) + 1) + "|")
    for cat, by_mode in rows:
        cells = []
        for m in modes:
            r = by_mode.get(m)
            if r is None:
                cells.append("—")
            elif r["speedup_vs_plain"] is None:
                cells.append(f"{r['tokens_per_s']:,.0f} tok/s")
            else:
                cells.append(f"{r['speedup_vs_plain']:.2f}×, τ {r['mean_accepted_len']:.2f}")
        print(f"| {cat} | " + " | ".join(cells) + " |")
    plain = pooled.get("plain")
    cells = []
    for m in modes:
        tok, steps, secs, reqs = pooled[m]
        if m == "plain":
            cells.append(f"{tok / secs:,.0f} tok/s")
        else:
            speed = (tok / secs) / (plain[0] / plain[2]) if plain else float("nan")
            cells.append(f"{speed:.2f}×, τ {(tok - reqs) / steps:.2f}")
    print(f"| all {pooled['plain'][3]} prompts | " + " | ".join(cells) + " |")
    differ = [m for m in modes if not same[m]]
    print("output equal to plain decoding's:", "every mode" if not differ else f"NOT for {differ}")


if __name__ == "__main__":
    main(sys.argv[1:])
