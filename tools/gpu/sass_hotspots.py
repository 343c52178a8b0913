"""Where a kernel's warps wait, from an `ncu --page source --csv --print-source sass` export
(tools/gpu/ncu_sass.sh; gzipped files read too).

  python3 sass_hotspots.py FILE [N]      the N (40) instructions with the most warp-stall
                                         samples, in program order: a run of stalls on the
                                         first use of each of several loads means the loads
                                         are not in flight together
  python3 sass_hotspots.py FILE --span N the samples of each span of N instructions, with
                                         its executions, its top stall reasons and opcodes:
                                         which phase of the kernel the time goes to (session
                                         64 found the tree tail's per-row P·V this way, its
                                         MMA chains serialized by a branch between them)
"""
import collections
import csv
import gzip
import sys

path = sys.argv[1]
text = (gzip.open(path, "rt") if path.endswith(".gz") else open(path)).read()
lines = text.splitlines()
start = next(i for i, l in enumerate(lines) if l.startswith('"Address"'))
rows = list(csv.reader(lines[start:]))
head, data = rows[0], rows[1:]
col_src = head.index("Source")
col_s = head.index("Warp Stall Sampling (All Samples)")
col_e = head.index("Instructions Executed")
stall_cols = [i for i, h in enumerate(head) if h.startswith("stall_") and "Not Issued" not in h]


def count(row, col):
    return int(row[col]) if row[col].isdigit() else 0


def opcode(row):
    words = row[col_src].split()
    return words[1] if words and words[0].startswith("@") and len(words) > 1 else (words or ["?"])[0]


samples = [count(r, col_s) for r in data]
total = sum(samples) or 1
print(f"{total} samples over {len(data)} instructions")
if len(sys.argv) > 3 and sys.argv[2] == "--span":
    span = int(sys.argv[3])
    for b0 in range(0, len(data), span):
        part = data[b0 : b0 + span]
        s = sum(samples[b0 : b0 + span])
        if s == 0:
            continue
        reasons = collections.Counter()
        for r in part:
            for c in stall_cols:
                reasons[head[c][len("stall_"):]] += count(r, c)
        ops = collections.Counter(opcode(r) for r in part)
        top = ", ".join(f"{k} {v}" for k, v in reasons.most_common(3))
        print(f"{b0:5d}-{b0 + len(part) - 1:<5d} {s:6d} {100 * s / total:5.1f}%  "
              f"exec {sum(count(r, col_e) for r in part):>8}  [{top}]  {' '.join(o for o, _ in ops.most_common(4))}")
else:
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    for i in sorted(sorted(range(len(data)), key=lambda i: -samples[i])[:n]):
        print(f"{i:5d} {samples[i]:6d} {100 * samples[i] / total:5.1f}%  exec {data[i][col_e]:>6}  "
              f"{data[i][col_src].strip()[:70]}")
