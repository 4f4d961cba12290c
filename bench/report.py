#!/usr/bin/env python3
"""Prints a side-by-side table from benchmark JSON lines (one per run, as
`tether bench` and bench/peer/mlx_lm_decode.py print them): best decode run
per (model, engine), prefill and decode tokens/s, sustained weight traffic,
and decode speed as a ratio to mlx-lm's on the same model. Agent-turn rows
(`tether bench --turns`, or bench/load.py's agent workload: rows with a
"turn") are printed as the per-turn TTFT table of `bench/load.py --report`.

usage: report.py RESULTS.jsonl [--hbm-gb-s 4800]
"""
import argparse
import json
import os
import sys

ap = argparse.ArgumentParser()
ap.add_argument("results")
ap.add_argument("--hbm-gb-s", type=float, default=None, help="peak memory bandwidth, to print the roofline fraction")
args = ap.parse_args()

rows = [json.loads(line) for line in open(args.results) if line.strip()]
agent = [r for r in rows if "turn" in r]
rows = [r for r in rows if "decode_tok_s" in r]
if agent:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from load import report_agent

    report_agent(agent)
if not rows:
    sys.exit(0)
best = {}
for r in rows:
    key = (r["model"], r["engine"])
    if key not in best or r["decode_tok_s"] > best[key]["decode_tok_s"]:
        best[key] = r

roof = f" {'roofline':>8}" if args.hbm_gb_s else ""
print(f"{'model':<22} {'engine':<8} {'prefill tok/s':>13} {'decode tok/s':>12} {'GB/s':>7}{roof} {'decode vs mlx-lm':>16}")
for model in sorted({m for m, _ in best}):
    peer = best.get((model, "mlx-lm"))
    for engine in ("tether", "mlx-lm"):
        r = best.get((model, engine))
        if not r:
            continue
        ratio = f"{r['decode_tok_s'] / peer['decode_tok_s']:.2f}x" if peer else "-"
        frac = f" {r['decode_gb_s'] / args.hbm_gb_s:>8.1%}" if args.hbm_gb_s else ""
        print(f"{model:<22} {engine:<8} {r['prefill_tok_s']:>13.1f} {r['decode_tok_s']:>12.1f} {r['decode_gb_s']:>7.1f}{frac} {ratio:>16}")
