"""The instructions with the most warp-stall samples in an `ncu --page source --csv
--print-source sass` export (tools/gpu/ncu_sass.sh), in program order: a run of stalls on
the first use of each of several loads means the loads are not in flight together."""
import csv
import sys

lines = open(sys.argv[1]).read().splitlines()
start = next(i for i, l in enumerate(lines) if l.startswith('"Address"'))
rows = list(csv.reader(lines[start:]))
head, data = rows[0], rows[1:]
col_s = head.index("Warp Stall Sampling (All Samples)")
col_e = head.index("Instructions Executed")
samples = [int(r[col_s]) if r[col_s].isdigit() else 0 for r in data]
total = sum(samples) or 1
print(f"{total} samples over {len(data)} instructions")
top = sorted(range(len(data)), key=lambda i: -samples[i])[: int(sys.argv[2]) if len(sys.argv) > 2 else 40]
for i in sorted(top):
    print(f"{i:5d} {samples[i]:6d} {100 * samples[i] / total:5.1f}%  exec {data[i][col_e]:>6}  {data[i][1].strip()[:70]}")
