"""Sums Nsight Compute kernel durations (ncu --csv --metrics gpu__time_duration.sum) by
kernel name: where a step's GPU time goes. Usage: python3 ncu_summary.py ncu.csv"""
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
hdr = None
dur = collections.defaultdict(float); cnt = collections.Counter()
for r in rows:
    if hdr is None:
        if "Kernel Name" in r: hdr = r
        continue
    if len(r) != len(hdr): continue
    d = dict(zip(hdr, r))
    if d.get("Metric Name") != "gpu__time_duration.sum": continue
    name = d["Kernel Name"].split("(")[0][:60]
    v = float(d["Metric Value"].replace(",", ""))
    unit = d.get("Metric Unit", "")
    scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}.get(unit, 1e-3)
    dur[name] += v * scale; cnt[name] += 1
tot = sum(dur.values())
print(f"total {tot:.1f} us over {sum(cnt.values())} kernels")
for n, t in sorted(dur.items(), key=lambda x: -x[1])[:25]:
    print(f"{t:9.1f} us {cnt[n]:5d} x {t/cnt[n]:7.2f} us  {n}")
