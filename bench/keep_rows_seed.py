"""How many rows the MTP layer's passes run over in the seed's command's shape, counted on the CPU (not timed):
64 requests of 1024 in / 128 out at concurrency 32, max_num_tokens 8192, max_batch_size 64, the seed's mtp.yml,
after dsv4-bench's two untimed requests, through dsv4-bench's own request loop. The model is ``tiny`` with
Flash's window (128, so the MTP ring's span is 129 rows as in flash-L4-E32) and random weights: its drafts are
rejected, as the seed's random flash-L4-E32's are, so drafting pauses the same way.

For each rule (``partial``: a paused step d steps before the next probe keeps each request's last
swa_cap - d + 1 rows, ``DraftPause.keep_rows``; ``full``: it keeps the last swa_cap, as before the thirty-third
session) it prints the steps of more than one row a request (prompt chunks; a probe's verify step): their MTP pass
kind, the rows kept (and padded to), and the totals over the run; and checks that both rules emit the same tokens.

    python3 keep_rows_seed.py [--requests 64] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from common import keep_whole_span
from dsv4 import LLM, config
from dsv4.bench.dataset import DatasetRequest
from dsv4.bench.options import load_yaml
from dsv4.bench.runner import _drive
from dsv4.engine.runner import ModelRunner
from dsv4.engine.spec_pause import DraftPause

SEED_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "mtp.yml"
KEEP_ROWS = DraftPause.keep_rows


def run(rule: str, reqs: list[DatasetRequest], concurrency: int):
    DraftPause.keep_rows = KEEP_ROWS if rule == "partial" else keep_whole_span(KEEP_ROWS)
    config.PRESETS["tiny-w128"] = lambda: config.get_preset("tiny").replace(window_size=128)
    L = max(len(r.input_ids) + r.output_tokens for r in reqs)
    llm = LLM("tiny-w128", max_batch_size=64, max_num_tokens=8192, max_seq_len=L, **load_yaml(str(SEED_CONFIG)))
    eng = llm.engine
    _drive(eng, reqs[:2], None, concurrency, prefix="__warm_")  # dsv4-bench's --warmup 2
    start = eng.pause.as_dict() | {"since_probe": eng.pause._since_probe}
    plans, kept, real_rows, real_begin = [], {}, ModelRunner._mtp_rows, eng.cache.begin_step

    def begin(seqs, **kw):
        plans.append((eng.num_steps + 1, sum(s.num_new for s in seqs), max(s.num_new for s in seqs) > 1,
                      any(s.draft_len for s in seqs), kw.get("mtp_keep_up", True), kw.get("mtp_keep_last")))
        return real_begin(seqs, **kw)

    def counted(self, plan):
        sub = real_rows(self, plan)
        kept[eng.num_steps + 1] = ((plan.num_tokens, plan.num_tokens) if sub is None
                                   else (int(sub.live.sum()), sub.keep.shape[0]))
        return sub

    class Finished(dict):  # dsv4-bench's loop pops each finished request: keep its tokens
        def pop(self, key, *default):
            r = super().pop(key, *default)
            if r is not None and key.startswith("timed_"):
                tokens[key] = tuple(r.output_ids)
            return r
    tokens: dict[str, tuple] = {}
    eng.requests = Finished(eng.requests)
    eng.cache.begin_step = begin
    ModelRunner._mtp_rows = counted
    try:
        timed = [DatasetRequest(task_id=i, output_tokens=r.output_tokens, line=r.line, input_ids=r.input_ids)
                 for i, r in enumerate(reqs)]
        _drive(eng, timed, None, concurrency, prefix="timed_")
    finally:
        ModelRunner._mtp_rows = real_rows
        DraftPause.keep_rows = KEEP_ROWS
    if len(tokens) != len(reqs):
        raise SystemExit(f"{len(tokens)} of {len(reqs)} timed requests finished")
    passes = [p + kept.get(p[0], (0, 0)) for p in plans]
    return start, passes, eng.num_steps, eng.pause.as_dict(), tokens


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input", type=int, default=1024)
    ap.add_argument("--output", type=int, default=128)
    args = ap.parse_args()
    rng = random.Random(0)
    reqs = [DatasetRequest(task_id=i, output_tokens=args.output, line=i + 1,
                           input_ids=[rng.randrange(2, 256) for _ in range(args.input)])
            for i in range(args.requests)]
    results = {rule: run(rule, reqs, args.concurrency) for rule in ("partial", "full")}
    for rule, (start, passes, steps, end, _) in results.items():
        print(f"\n### {rule}: pause after the untimed requests {start}; {steps} steps, at the end {end}\n")
        print("| step | tokens | MTP pass | keep_last | rows kept | rows run (padded) |")
        print("|---|---|---|---|---|---|")
        for step, n, prompt, drafting, keep_up, keep_last, kept, run_rows in passes:
            if prompt:
                kind = "whole (drafting)" if drafting else ("keep-up" if keep_up else "none")
                print(f"| {step} | {n} | {kind} | {keep_last if keep_last is not None else 'all'} | {kept} |"
                      f" {run_rows} |")
        prompt_passes = [p for p in passes if p[2]]
        decode = [p for p in passes if not p[2]]
        print(f"\nSteps of more than one row a request: {len(prompt_passes)}; rows kept {sum(p[6] for p in prompt_passes)}, run"
              f" (padded) {sum(p[7] for p in prompt_passes)}. Steps of one row a request: {len(decode)}, of them with an MTP"
              f" pass {sum(1 for p in decode if p[7])} (rows run {sum(p[7] for p in decode)}).")
    same = results["partial"][4] == results["full"][4]
    print(f"\nThe same tokens under both rules: {same}")
    if not same:
        raise SystemExit("the rules emitted different tokens")


if __name__ == "__main__":
    main()
