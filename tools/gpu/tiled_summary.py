"""Summarises the spec-bench JSON files of tools/gpu/tiled_h200.sh: per file (shape_build),
the one-row step and each verify:T step with its ratio, and whether the output digests of the
builds agree.

Usage: python3 tiled_summary.py OUT/*.json"""
import json
import os
import sys

for path in sorted(sys.argv[1:]):
    tag = os.path.basename(path)[: -len(".json")]
    report = json.load(open(path))
    cells = []
    for r in report["results"]:
        if r.get("verify"):
            v = r["verify"]
            cells.append(f"{r['mode']} {v['tree_step_ms']:.3f} ms = {v['ratio']:.2f}x")
        else:
            cells.append(
                f"{r['mode']} b{r['batch_size']} {r['tokens_per_s']:.1f} tok/s "
                f"{r['step_latency_ms']:.3f} ms roofline {r.get('roofline_fraction', 0):.3f} "
                f"digest {r.get('output_digest')}"
            )
    print(f"{tag:28s} " + " | ".join(cells))
