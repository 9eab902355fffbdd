"""Where a request's wall time goes at concurrency 1, MTP off against k > 0: every engine call of the held-out
prompts of ``mini`` (one request at a time, greedy, 128 new tokens, EOS ignored) timed on the host and sorted by
what the call ran (``Engine.last_step``): a prefill (the step held a prompt chunk), a decode/verify step, or a
call that only read back the overlapped step before it. Prints per kind the calls per request, the median and
the total ms per request, and with ``--profile`` the functions with the most own time in the prefill calls
(cProfile, one profile per call merged by kind).

    python3 bench/mtp_calls.py --ks 0 2 [--requests 8 --gen 128 --profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from common import report, table

from dsv4 import LLM, SamplingParams
from dsv4.builtin import heldout_prompts


def kind_of(step: dict, k: int) -> str:
    """A step of more rows than a decode/verify step's 1 + k per seq held a prompt chunk."""
    if step["num_seqs"] == 0:
        return "read-back only"
    return "prefill" if step["num_tokens"] > step["num_seqs"] * (1 + k) else "decode/verify"


def run(args, k: int, prompts: list[str]):
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_batch_size=1, max_num_tokens=2048,
              max_seq_len=1024, speculative_config=spec, cuda_graph_config={"enable_padding": True})
    sp = SamplingParams(max_tokens=args.gen, ignore_eos=True, detokenize=False)
    llm.generate(prompts, sp)  # untimed: every shape compiled
    eng = llm.engine
    times: dict[str, list[float]] = {}
    profiles: dict[str, pstats.Stats] = {}
    cuda = args.device.startswith("cuda")
    total = 0.0
    for p in prompts:  # one request at a time, as LLM.generate runs them at concurrency 1
        eng.add_request(llm._encode(p)[0], sp)
        if cuda:
            torch.cuda.synchronize()
        t_req = time.perf_counter()
        while eng.has_unfinished_requests():
            prof = cProfile.Profile() if args.profile else None
            t0 = time.perf_counter()
            if prof:
                prof.enable()
            eng.step()
            if prof:
                prof.disable()
            dt = time.perf_counter() - t0
            kind = kind_of(eng.last_step, k)
            times.setdefault(kind, []).append(dt)
            if prof:
                if kind in profiles:
                    profiles[kind].add(prof)
                else:
                    profiles[kind] = pstats.Stats(prof)
        if cuda:
            torch.cuda.synchronize()
        total += time.perf_counter() - t_req
    del llm
    return times, total, profiles


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="mini")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="cProfile every call (slower calls)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--append", default=None)
    args = ap.parse_args()
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    prompts = heldout_prompts("mini")[:args.requests]
    n = len(prompts)
    rows, texts = [], []
    for k in args.ks:
        times, total, profiles = run(args, k, prompts)
        rows.append([k or "off", "all", f"{sum(map(len, times.values())) / n:.1f}", "",
                     f"{1e3 * total / n:.2f}", f"{args.gen * n / total:.0f}"])
        for kind in ("prefill", "decode/verify", "read-back only"):
            ts = times.get(kind, [])
            if ts:
                rows.append([k or "off", kind, f"{len(ts) / n:.1f}", f"{1e3 * statistics.median(ts):.3f}",
                             f"{1e3 * sum(ts) / n:.2f}", ""])
        for kind, st in profiles.items():
            if kind != "read-back only":
                s = io.StringIO()
                st.stream = s
                st.sort_stats("tottime").print_stats(args.top)
                texts.append(f"== k = {k or 'off'}, {kind} calls: most own time\n"
                             + "\n".join(line[:150] for line in s.getvalue().splitlines()[:args.top + 9]))
    heads = ["k", "calls", "calls per request", "median ms per call", "ms per request", "output tok/s"]
    report(f"Engine calls per request at concurrency 1, {args.model}, {args.device}, {args.dtype}"
           f"{', profiled' if args.profile else ''}", table(heads, rows), args.append)
    for t in texts:
        print(t)


if __name__ == "__main__":
    main()
