"""Summarises the spec-bench JSON files of tools/gpu/dependent_launch_h200.sh: per run tag and
mode, tokens/s (or the verify ratio) with --dependent_launch on (runs 1 and 3) and off (run 2),
the on/off ratio, and whether the output digests of every run agree.

Usage: python3 dependent_launch_summary.py OUT/*.json"""
import json
import re
import sys
from collections import defaultdict

runs = defaultdict(dict)  # tag -> {(i, pdl): report}
for path in sys.argv[1:]:
    m = re.search(r"([^/]+)_(\d)_(on|off)\.json$", path)
    if not m:
        continue
    runs[m.group(1)][(int(m.group(2)), m.group(3))] = json.load(open(path))

for tag, reports in sorted(runs.items()):
    print(f"== {tag}")
    order = sorted(reports)
    for i, pdl in order:
        print(f"   run {i} --dependent_launch {pdl}: applied={reports[(i, pdl)]['dependent_launch']}")
    by_mode = defaultdict(dict)
    for key in order:
        for r in reports[key]["results"]:
            by_mode[(r["mode"], r["batch_size"])][key] = r
    for (mode, batch), rs in by_mode.items():
        def figure(r):
            if r.get("verify"):
                return r["verify"]["ratio"], "x 1-row step", r["verify"]["tree_step_ms"]
            return r["tokens_per_s"], "tok/s", r["step_latency_ms"]
        cells = []
        on, off = [], []
        for (i, pdl), r in sorted(rs.items()):
            v, unit, ms = figure(r)
            cells.append(f"{pdl}{i} {v:8.2f} ({ms:.3f} ms)")
            (on if pdl == "on" else off).append((v, ms))
        digests = {r.get("output_digest") for r in rs.values()}
        tau = next(iter(rs.values())).get("mean_accepted_len")
        line = f"   {mode:48s} b{batch} {unit:13s} " + "  ".join(cells)
        if on and off:
            ms_on = sum(x[1] for x in on) / len(on)
            ms_off = sum(x[1] for x in off) / len(off)
            line += f"  step off/on {ms_off / ms_on:.3f}"
        if tau is not None:
            line += f"  tau {tau:.2f}"
        same = [r.get("same_output_as_plain") for r in rs.values()]
        if None not in digests:
            line += f"  digests {'agree' if len(digests) == 1 else 'DIFFER'}"
        if any(s is not None for s in same):
            line += f"  same_as_plain {all(same)}"
        print(line)
