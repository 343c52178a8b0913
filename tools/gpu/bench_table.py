#!/usr/bin/env python3
"""spec-bench's JSON reports as one table, a line per result, in the columns asked for.

    python3 tools/gpu/bench_table.py [--columns run,mode,tok/s,...] PATH...

A PATH is a report or a folder of them (its *.json, sorted); a result's `run` is its report's
file name without `.json`. The device scripts print their summaries with this, so that every
summary names a figure the same way and reads it from the same field.
"""
import argparse
import glob
import json
import os
import sys

MIB = 1 << 20


def per_step(result, seconds_key):
    steps = result.get("steps") or 0
    return 1000 * (result.get(seconds_key) or 0) / steps if steps else 0


def number(key, digits, scale=1, of_report=False):
    """A right-aligned column of a result's (or its report's) numeric field, 0 where absent."""
    return (">", lambda run, rep, r: f"{((rep if of_report else r).get(key) or 0) / scale:.{digits}f}")


# name: (alignment, the text of one result: f(run name, report, result)).
COLUMNS = {
    "run": ("<", lambda run, rep, r: run),
    "mode": ("<", lambda run, rep, r: r["mode"].replace("heads/smollm2-eagle/", "")),
    "batch": (">", lambda run, rep, r: f"{r['batch_size']}"),
    "tok/s": number("tokens_per_s", 1),
    "vs plain": number("speedup_vs_plain", 2),
    "tau": number("mean_accepted_len", 2),
    "step ms": number("step_latency_ms", 3),
    "draft ms": (">", lambda run, rep, r: f"{per_step(r, 'draft_s'):.3f}"),
    "roofline": number("roofline_fraction", 3),
    "verify": (">", lambda run, rep, r: f"{(r.get('verify') or {}).get('ratio') or 0:.2f}"),
    "peak MiB": number("peak_memory_bytes", 1, MIB),
    "overhead": number("memory_overhead_fraction", 2),
    "arena MiB": number("cuda_graph_arena_bytes", 2, MIB, of_report=True),
    "load s": number("load_s", 1, of_report=True),
    "same": (">", lambda run, rep, r: str(r.get("same_output_as_plain"))),
    "digest": (">", lambda run, rep, r: r.get("output_digest") or ""),
}
DEFAULT = "run,mode,batch,tok/s,vs plain,tau,step ms,same"


def reports(paths):
    for path in paths:
        files = sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
        for f in files:
            yield os.path.basename(f)[: -len(".json")] if f.endswith(".json") else f, f


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--columns", default=DEFAULT, help=f"comma-separated, of: {', '.join(COLUMNS)}")
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args()
    names = [c.strip() for c in args.columns.split(",") if c.strip()]
    unknown = [c for c in names if c not in COLUMNS]
    if unknown:
        sys.exit(f"bench_table: unknown column {unknown[0]!r} (known: {', '.join(COLUMNS)})")
    rows, notes = [], []
    for run, path in reports(args.paths):
        try:
            with open(path) as f:
                rep = json.load(f)
        except (OSError, ValueError) as e:
            notes.append(f"{run}: no report ({e})")
            continue
        for r in rep.get("results", []):
            rows.append([COLUMNS[c][1](run, rep, r) for c in names])
        if rep.get("cuda_graph_failure"):
            notes.append(f"{run}: graph failure: {rep['cuda_graph_failure']}")
    widths = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(names)]

    def line(cells):
        return " ".join(f"{cell:{COLUMNS[c][0]}{w}}" for c, cell, w in zip(names, cells, widths)).rstrip()

    print(line(names))
    for row in rows:
        print(line(row))
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
