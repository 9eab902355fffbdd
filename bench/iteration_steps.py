"""Compare dsv4-bench iteration logs (``--iteration_log``) step by step: the first steps of each run (where the
first wave's prompts go) and the time summed by kind of step, a short table per run. Usage:
``python3 bench/iteration_steps.py LABEL=PATH ... [--first N]``."""

from __future__ import annotations

import argparse
import json


def load(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("logs", nargs="+", help="LABEL=PATH")
    ap.add_argument("--first", type=int, default=12, help="steps shown one by one (default 12)")
    args = ap.parse_args()
    runs = [(s.split("=", 1)[0], load(s.split("=", 1)[1])) for s in args.logs]
    print("| step | " + " | ".join(f"{label} ms (seqs/tokens/ctx/emitted)" for label, _ in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for i in range(args.first):
        cells = []
        for _, log in runs:
            e = log[i] if i < len(log) else None
            cells.append("-" if e is None else f"{e['step_time_ms']:.1f} ({e['num_seqs']}/{e['num_tokens']}/"
                         f"{e['num_context']}/{e['num_emitted']}) @{e['elapsed_s'] * 1e3:.0f}")
        print(f"| {i + 1} | " + " | ".join(cells) + " |")
    print()
    print("| run | steps | with context rows: n, ms, ms each | decode only: n, ms, ms each | total ms |")
    print("|---|---|---|---|---|")
    for label, log in runs:
        ctx = [e["step_time_ms"] for e in log if e["num_context"]]
        dec = [e["step_time_ms"] for e in log if not e["num_context"]]
        print(f"| {label} | {len(log)} | {len(ctx)}, {sum(ctx):.1f}, {sum(ctx) / max(len(ctx), 1):.2f} | "
              f"{len(dec)}, {sum(dec):.1f}, {sum(dec) / max(len(dec), 1):.3f} | {sum(ctx) + sum(dec):.1f} |")


if __name__ == "__main__":
    main()
