#!/usr/bin/env python3
"""Summarise `ncu --csv --metrics gpu__time_duration.sum` output: kernels per decode step and
GPU time per step, per kernel name. Usage: ncu_summary.py ncu.csv [kernels_marker]

A decode step is delimited by the final RMSNorm + LM-head GEMM; we count steps by the number
of launches of the widest GEMM (the LM head) when possible, else report totals only."""
import csv, sys, collections, io

path = sys.argv[1]
lines = open(path, errors="replace").read().splitlines()
start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
rows = list(csv.DictReader(io.StringIO("\n".join(lines[start:]))))
rows = [r for r in rows if r.get("Metric Name") == "gpu__time_duration.sum"]
unit = rows[0]["Metric Unit"] if rows else "ns"
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, 1.0)
by = collections.defaultdict(lambda: [0, 0.0])
total = 0.0
for r in rows:
    v = float(r["Metric Value"].replace(",", "")) * scale
    name = r["Kernel Name"].split("(")[0][:60] + " " + r.get("Grid Size", "")
    by[name][0] += 1
    by[name][1] += v
    total += v
print(f"{len(rows)} kernels, {total:.1f} us GPU time in all ({unit})")
for name, (n, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    print(f"{n:6d} {t:10.1f} us {t / n:8.2f} us/launch  {name}")
