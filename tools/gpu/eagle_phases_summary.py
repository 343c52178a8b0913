#!/usr/bin/env python3
"""Summarises tools/gpu/eagle_phases_h200.sh: per mode, tokens/s, tau, the step's
milliseconds split into the head reading the committed pairs, the draft levels, queueing
the verification, acceptance (waiting for the verification included) and the update after it, whether its output digest equals the first plain run's, the GPU utilization samples taken while it ran (median of the samples at or
above 5%, which leaves out the process's start), and the CUDA graphs captured and replayed
(target and head together; a step layout runs eagerly until its capture). Usage: eagle_phases_summary.py DIR"""
import glob
import json
import os
import re
import statistics
import sys

d = sys.argv[1]
print(f"{'mode':40s} {'tok/s':>7s} {'tau':>5s} {'step ms':>8s} {'head':>6s} {'levels':>6s} {'verify':>6s}"
      f" {'accept':>7s} {'update':>6s} {'gpu util %':>10s} {'captures':>8s} {'replays':>7s} =plain")
plain_digest = None
for path in sorted(glob.glob(os.path.join(d, "mode_*.json")), key=lambda p: int(re.findall(r"\d+", p)[-1])):
    i = re.findall(r"\d+", path)[-1]
    for r in json.load(open(path))["results"]:
        if r["mode"] == "plain" and plain_digest is None:
            plain_digest = r["output_digest"]
        steps = max(r["steps"], 1)
        ms = lambda s: 1e3 * s / steps
        util = [int(x) for x in open(os.path.join(d, f"util_{i}.txt")).read().split() if x.isdigit()]
        busy = [u for u in util if u >= 5]
        med = statistics.median(busy) if busy else float("nan")
        print(f"{r['mode'][-40:]:40s} {r['tokens_per_s']:7.0f} {r.get('mean_accepted_len') or 1:5.2f}"
              f" {r['step_latency_ms']:8.3f} {ms(r['head_s']):6.3f} {ms(r['draft_s'] - r['head_s']):6.3f}"
              f" {ms(r['verify_s'] - r['accept_s'] - r['update_s']):6.3f} {ms(r['accept_s']):7.3f}"
              f" {ms(r['update_s']):6.3f} {med:10.0f} {r['cuda_graph_activity']['captures']:8d}"
              f" {r['cuda_graph_activity']['replays']:7d} {r['output_digest'] == plain_digest}")
