#!/usr/bin/env python3
"""Summarises `ncu --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum` over the
self-draft's quantized gemvs (tools/gpu/self_draft_h200.sh ncu): per kernel and grid, the
launches, mean time, mean bytes read from DRAM and the rate those make, slowest first, then
the total against what the bytes would take at PEAK_TBS (default 3.35, an H100's; 4.8 on an
H200). Usage: ncu_quant_summary.py ncu.csv [PEAK_TBS]"""
import collections, csv, io, sys

lines = open(sys.argv[1], errors="replace").read().splitlines()
peak = float(sys.argv[2]) if len(sys.argv) > 2 else 3.35
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
if start is None:
    sys.exit("no ncu CSV rows in " + sys.argv[1])
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
byte_scale = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
launches = collections.defaultdict(dict)  # ID -> {name, grid, us, bytes}
for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
    value = float(r["Metric Value"].replace(",", ""))
    row = launches[r["ID"]]
    row["key"] = r["Kernel Name"].split("(")[0] + " grid " + r.get("Grid Size", "")
    if r["Metric Name"] == "gpu__time_duration.sum":
        row["us"] = value * scale.get(r["Metric Unit"], 1.0)
    elif r["Metric Name"] == "dram__bytes_read.sum":
        row["bytes"] = value * byte_scale.get(r["Metric Unit"], 1.0)
by = collections.defaultdict(lambda: [0, 0.0, 0.0])
for row in launches.values():
    agg = by[row["key"]]
    agg[0] += 1
    agg[1] += row.get("us", 0.0)
    agg[2] += row.get("bytes", 0.0)
total_us = sum(a[1] for a in by.values())
total_bytes = sum(a[2] for a in by.values())
print(f"{len(launches)} launches, {total_us:.0f} us, {total_bytes / 1e9:.3f} GB read: "
      f"{total_bytes / (total_us * 1e-6) / 1e12 if total_us else 0:.2f} TB/s "
      f"(the bytes alone at {peak} TB/s: {total_bytes / (peak * 1e12) * 1e6:.0f} us)")
print(f"{'launches':>8s} {'us each':>8s} {'MB each':>8s} {'TB/s':>6s}  kernel")
for key, (n, us, b) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    rate = b / (us * 1e-6) / 1e12 if us else 0.0
    print(f"{n:8d} {us / n:8.2f} {b / n / 1e6:8.2f} {rate:6.2f}  {key}")
