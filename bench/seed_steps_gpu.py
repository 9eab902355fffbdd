"""Where the seed's workload spends its time, MTP (the seed's mtp.yml: k = 1, drafting paused at zero acceptance)
against MTP off: 64 requests of 1024 random tokens in / 128 out at concurrency 32 on flash-L4-E32, the engine
stepped directly, each engine call's wall time summed by the kind of step it read back (with the overlap
scheduler a call returns when the previous step's tokens are read, so its wall time is that step's): steps with
prompt rows (prefill, mixed) and decode-only steps.

Runs (``--runs``, in order): ``off``; ``mtp`` (k = 1, the engine's defaults); and, to find what the paused MTP
costs against off, ``mtp-no-keep-up`` (the keep-up pass of paused steps skipped: drafts after a probe are then
wrong, which zero acceptance does not notice), ``mtp-no-probes`` (a paused engine never probes) and
``mtp-all-rows`` (the catch-up pass over every prompt row: ``ModelRunner.mtp_tail_rows`` off),
``mtp-wide-keep`` (a paused step's graph with a drafting step's acceptance kernels: ``GraphRunner.slim_keep_step``
off), ``mtp-bare`` (neither keep-up passes nor probes: what a paused step costs beyond them) and
``mtp-keep-every-step`` (every paused step keeps the MTP ring current, also those far from the next probe:
``DraftPause.keep_rows`` always the ring's span)."""

from __future__ import annotations

import argparse
import gc
import random
import time
from pathlib import Path

import torch
from common import report, table

from dsv4 import LLM, SamplingParams
from dsv4.bench.options import load_yaml
from dsv4.config import get_preset
from dsv4.engine.graphs import GraphRunner
from dsv4.engine.runner import ModelRunner
from dsv4.engine.spec_pause import DraftPause
from dsv4.model.model import DeepseekV4

SEED_CONFIG = Path(__file__).resolve().parent.parent / "examples" / "mtp.yml"
RUNS = ("off", "mtp", "mtp-no-keep-up", "mtp-no-probes", "mtp-all-rows", "mtp-wide-keep", "mtp-bare",
        "mtp-keep-every-step")


def run_variant(label: str, *args):
    """``run`` with the run's switches set for it (and restored after)."""
    keep_up, tail, slim = DeepseekV4.mtp_keep_up, ModelRunner.mtp_tail_rows, GraphRunner.slim_keep_step
    keep_rows = DraftPause.keep_rows
    if label == "mtp-keep-every-step":
        DraftPause.keep_rows = lambda self, margin: margin
    if label in ("mtp-no-keep-up", "mtp-bare"):
        DeepseekV4.mtp_keep_up = lambda self, X, next_ids, backend: None
    ModelRunner.mtp_tail_rows = label != "mtp-all-rows"
    GraphRunner.slim_keep_step = label != "mtp-wide-keep"
    try:
        return run(0 if label == "off" else 1, label in ("mtp-no-probes", "mtp-bare"), *args)
    finally:
        DeepseekV4.mtp_keep_up, ModelRunner.mtp_tail_rows, GraphRunner.slim_keep_step = keep_up, tail, slim
        DraftPause.keep_rows = keep_rows


def run(k: int, no_probes: bool, prompts, gen: int, concurrency: int, preset: str, device: str):
    prompt_len = max(len(p) for p in prompts)
    settings = load_yaml(str(SEED_CONFIG))  # the seed's mtp.yml (MTP off: without its speculative_config)
    if not k:
        settings.pop("speculative_config", None)
    llm = LLM(preset, device=device, dtype="bf16" if device == "cuda" else "fp32", max_batch_size=64,
              max_num_tokens=8192, max_seq_len=prompt_len + gen + 8, **settings)
    sp = SamplingParams(max_tokens=gen, ignore_eos=True, detokenize=False)
    llm.generate(prompts[:2], sp)  # untimed
    eng = llm.engine
    if no_probes and eng.pause is not None:
        eng.pause.probe_every = 10 ** 9
    eng.reset_stats()
    graphs = [g for g in (eng.runner.graphs, eng.runner.keep_graphs) if g is not None]
    replays0 = [g.num_replays for g in graphs]
    queue, live = list(prompts), set()
    kinds, times = [], []
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t_all = time.perf_counter()
    while queue or eng.has_unfinished_requests():
        while queue and len(live) < concurrency:
            live.add(eng.add_request(queue.pop(0), sp))
        t0 = time.perf_counter()
        outs = eng.step()
        times.append(time.perf_counter() - t0)
        last = eng.last_step  # (more rows than a decode or verify step has: prompt rows)
        kinds.append("prompt rows" if last["num_tokens"] > last["num_seqs"] * (1 + k) else "decode only")
        for o in outs:
            if o.finished:
                live.discard(o.request_id)
    sync()
    total = time.perf_counter() - t_all
    pause = eng.pause.as_dict() if eng.pause is not None else None
    replays = " / ".join(str(g.num_replays - r) for g, r in zip(graphs, replays0))
    sums: dict[str, list] = {}
    for i in range(1, len(times)):  # call i reads back step i - 1
        s = sums.setdefault(kinds[i - 1], [0, 0.0, 0.0])
        s[0] += 1
        s[1] += times[i]
        s[2] = max(s[2], times[i])  # (a compile or a capture in the timed run shows here)
    del llm
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return total, sums, pause, replays


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input", type=int, default=1024, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--runs", nargs="+", default=["off", "mtp", "off", "mtp"], choices=RUNS,
                    help="the runs, in order (see the module doc)")
    ap.add_argument("--preset", default="flash-L4-E32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--append", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    vocab = get_preset(args.preset).vocab_size
    prompts = [[rng.randrange(2, vocab) for _ in range(args.input)] for _ in range(args.requests)]
    rows = []
    for label in args.runs:
        total, sums, pause, replays = run_variant(label, prompts, args.gen, args.concurrency, args.preset,
                                                  args.device)
        out = args.requests * args.gen / total
        row = [label, f"{out:.0f}"]
        for kind in ("prompt rows", "decode only"):
            n, t, slowest = sums.get(kind, (0, 0.0, 0.0))
            row += [n, f"{t * 1e3:.1f}", f"{t / max(n, 1) * 1e3:.2f}", f"{slowest * 1e3:.1f}"]
        row += ["-" if pause is None else pause["num_paused_steps"], replays]
        rows.append(row)
        print(row, flush=True)
    text = table(["run", "output tok/s", "steps with prompt rows", "their ms", "ms each", "slowest ms",
                  "decode-only steps", "their ms", "ms each", "slowest ms", "paused steps", "graph replays (main / one-row MTP buckets)"], rows)
    report(f"The seed's workload by kind of step, {args.preset}, {args.requests} x {args.input}/{args.gen}, concurrency"
           f" {args.concurrency}", text, args.append,
           notes="Engine stepped directly (bench/seed_steps_gpu.py); each call's wall time counted for the step it"
                 " read back. Runs in the order of the table.")


if __name__ == "__main__":
    main()
