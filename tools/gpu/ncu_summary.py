#!/usr/bin/env python3
"""Summarises `ncu --csv --metrics gpu__time_duration.sum[,dram__bytes_read.sum]` output per
kernel and grid: launches, total and per-launch GPU time, slowest first. With
dram__bytes_read.sum among the metrics each row also gets the MB a launch reads from DRAM and
the rate that makes, and the total is set against the time the bytes alone would take at
PEAK_TBS (default 3.35 TB/s, an H100's; 4.8 on an H200).
Usage: ncu_summary.py ncu.csv [PEAK_TBS]"""
import collections, csv, io, sys

lines = open(sys.argv[1], errors="replace").read().splitlines()
peak = float(sys.argv[2]) if len(sys.argv) > 2 else 3.35
start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
if start is None:
    sys.exit("no ncu CSV rows in " + sys.argv[1])
to_us = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
to_bytes = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "KB": 1e3, "MB": 1e6, "GB": 1e9}
launches = collections.defaultdict(dict)  # ncu's launch ID -> key, us, bytes
for r in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
    value = float(r["Metric Value"].replace(",", ""))
    launch = launches[r["ID"]]
    launch["key"] = r["Kernel Name"].split("(")[0][:60] + " " + r.get("Grid Size", "")
    if r["Metric Name"] == "gpu__time_duration.sum":
        launch["us"] = value * to_us.get(r["Metric Unit"], 1.0)
    elif r["Metric Name"] == "dram__bytes_read.sum":
        launch["bytes"] = value * to_bytes.get(r["Metric Unit"], 1.0)
with_bytes = any("bytes" in l for l in launches.values())
by = collections.defaultdict(lambda: [0, 0.0, 0.0])
for launch in launches.values():
    agg = by[launch["key"]]
    agg[0] += 1
    agg[1] += launch.get("us", 0.0)
    agg[2] += launch.get("bytes", 0.0)
total_us = sum(a[1] for a in by.values())
line = f"{len(launches)} kernels, {total_us:.1f} us GPU time in all"
if with_bytes:
    total_bytes = sum(a[2] for a in by.values())
    rate = total_bytes / (total_us * 1e-6) / 1e12 if total_us else 0.0
    line += (f", {total_bytes / 1e9:.3f} GB read: {rate:.2f} TB/s (the bytes alone at "
             f"{peak} TB/s: {total_bytes / (peak * 1e12) * 1e6:.1f} us)")
print(line)
for key, (n, us, b) in sorted(by.items(), key=lambda kv: -kv[1][1]):
    row = f"{n:6d} {us:10.1f} us {us / n:8.2f} us/launch"
    if with_bytes:
        row += f" {b / n / 1e6:8.2f} MB {b / (us * 1e-6) / 1e12 if us else 0.0:5.2f} TB/s"
    print(f"{row}  {key}")
