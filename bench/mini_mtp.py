"""MTP on the trained ``mini`` model: output tok/s with MTP off vs k = 1, 2, 3 at concurrency 1 and 32 on the
held-out prompts (128 new tokens each, EOS ignored, greedy), the acceptance per draft position, the mean accepted
length, and the fraction of output tokens identical to MTP off (same request, same position). Runs on the CPU
(fp32 by default) or the GPU (bf16 by default). ``--sync``: each k > 0 again with the overlap scheduler off;
``--separate``: again with the separate CUDA graphs instead of the whole-step graph."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common import report, table

from dsv4 import LLM, SamplingParams
from dsv4.builtin import heldout_prompts


def run(args, k: int, prompts: list[str], concurrency: int, overlap: bool = True, whole: bool = True):
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None
    llm = LLM("mini", device=args.device, dtype=args.dtype, max_batch_size=concurrency, max_num_tokens=2048,
              max_seq_len=1024, speculative_config=spec, disable_overlap_scheduler=not overlap,
              cuda_graph_config=None if args.no_padding else {"enable_padding": True})
    if llm.engine.runner.graphs is not None:
        llm.engine.runner.graphs.whole_step = whole and k > 0
    sp = SamplingParams(max_tokens=args.gen, ignore_eos=True)
    llm.generate(prompts[:concurrency], SamplingParams(max_tokens=8, ignore_eos=True))  # untimed
    llm.engine.reset_stats()
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    times = []
    for _ in range(args.repeat):  # the median of the timed runs (a run at c = 32 lasts well under a second)
        llm.engine.reset_stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)  # at most `concurrency` in flight: the batch size caps it
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = statistics.median(times)
    toks = [o.outputs[0].token_ids for o in outs]
    stats = llm.get_stats().get("speculative") or {}
    del llm
    return sum(map(len, toks)) / dt, toks, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--c1-prompts", type=int, default=8, help="prompts run one at a time at concurrency 1")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per cell (the median is reported)")
    ap.add_argument("--sync", action="store_true",
                    help="also each k > 0 with the overlap scheduler off (every MTP step reads its own verdict)")
    ap.add_argument("--no-padding", action="store_true",
                    help="CUDA graphs for exact batch sizes only: a batch between buckets runs eagerly (with MTP the"
                         " requests of a batch finish at different steps, so the tail of a run has such batches)")
    ap.add_argument("--separate", action="store_true",
                    help="also each k > 0 with the separate CUDA graphs instead of the whole-step graph")
    ap.add_argument("--append", default=None)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    prompts = heldout_prompts("mini")
    rows = []
    for c in args.concurrency:
        ps = prompts[: args.c1_prompts] if c == 1 else prompts
        base = None
        run(args, args.ks[-1], ps[:c], c)  # untimed: kernels compile for this run's shapes before any timing
        for k in args.ks:
            modes = [(ov, whole) for ov in ((True, False) if (args.sync and k) else (True,))
                     for whole in ((True, False) if (args.separate and k) else (True,))]
            for overlap, whole in modes:
                tps, toks, st = run(args, k, ps, c, overlap, whole)
                if k == 0:
                    base, base_tps = toks, tps
                same = sum(a == b for x, y in zip(toks, base) for a, b in zip(x, y)) / max(1, sum(map(len, base)))
                per = "/".join(f"{a:.3f}" for a in st.get("per_position_acceptance", [])) or "-"
                graph = ("whole" if whole else "separate") if k else "-"
                rows.append([c, k, "on" if overlap else "off", graph, len(ps), round(tps), f"{tps / base_tps:.2f}x", per,
                             f"{st['mean_accepted_len']:.2f}" if st else "-", f"{same:.3f}"])
                print(rows[-1], flush=True)
    report(f"MTP on mini ({args.device}, {args.dtype})",
           table(["concurrency", "k", "overlap", "step graph", "requests", "output tok/s", "vs off",
                  "acceptance per position",
                  "mean accepted length", "tokens identical to MTP off"], rows), args.append,
           notes=f"{args.gen} new tokens per held-out prompt, greedy, EOS ignored; CUDA graph padding"
                 f" {'off' if args.no_padding else 'on'}; concurrency 1 runs the first"
                 f" {args.c1_prompts} prompts one at a time; an untimed pass first, so no kernel compiles in a"
                 " timed run.")


if __name__ == "__main__":
    main()
