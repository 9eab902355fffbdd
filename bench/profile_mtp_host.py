"""Where an MTP step's host time goes, the overlap scheduler on vs off: the trained ``mini`` (host-bound on a GPU)
generating greedily at a given concurrency under cProfile, and the wall time per engine call. Prints, per mode,
the time per call and the functions with the most own time (a call that waits for the GPU shows its wait as
``synchronize`` / ``tolist`` time).

    python3 bench/profile_mtp_host.py --k 1 --concurrency 1 [--gen 128 --top 18]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from dsv4 import LLM, SamplingParams, transfer
from dsv4.builtin import heldout_prompts


def run(args, overlap: bool, prompts) -> tuple[float, int, str]:
    llm = LLM("mini", device=args.device, dtype=args.dtype, max_batch_size=args.concurrency, max_num_tokens=2048,
              max_seq_len=1024, disable_overlap_scheduler=not overlap, cuda_graph_config={"enable_padding": True},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": args.k} if args.k else None)
    sp = SamplingParams(max_tokens=args.gen, ignore_eos=True, detokenize=False)
    llm.generate(prompts, sp)  # untimed
    eng = llm.engine
    for p in prompts:
        eng.add_request(llm._encode(p)[0], sp)
    prof = cProfile.Profile()
    calls = 0
    torch.cuda.synchronize() if args.device == "cuda" else None
    t0 = time.perf_counter()
    if not args.no_profile:
        prof.enable()
    while eng.has_unfinished_requests():
        eng.step()
        calls += 1
    if not args.no_profile:
        prof.disable()
    torch.cuda.synchronize() if args.device == "cuda" else None
    wall = time.perf_counter() - t0
    s = io.StringIO()
    if not args.no_profile:
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(args.top)
    del llm
    return wall, calls, s.getvalue()


class _NoRing:
    """transfer's staging ring switched off: every queued copy takes a pinned tensor of its own (the way before)."""

    def copy(self, values):
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--requests", type=int, default=None, help="held-out prompts (default: the concurrency)")
    ap.add_argument("--no-profile", action="store_true", help="time the calls only (no cProfile overhead)")
    ap.add_argument("--overlap-only", action="store_true", help="only the overlap scheduler on, staging ring on")
    args = ap.parse_args()
    prompts = heldout_prompts("mini")[:args.requests or args.concurrency]
    real_ring = transfer._ring
    profiles = []
    for overlap in (True,) if args.overlap_only else (True, False):
        for ring in (True,) if args.overlap_only else (True, False):
            transfer._ring = real_ring if ring else (lambda device: _NoRing())
            wall, calls, text = run(args, overlap, prompts)
            toks = args.gen * len(prompts)
            print(f"== overlap {'on' if overlap else 'off'}, staging ring {'on' if ring else 'off'}: {toks / wall:.0f}"
                  f" tok/s ({'timed' if args.no_profile else 'profiled'}), {calls} calls, {1e3 * wall / calls:.3f} ms per call", flush=True)
            profiles.append((overlap, ring, text))
    transfer._ring = real_ring
    for overlap, ring, text in profiles:
        if ring:
            print(f"== overlap {'on' if overlap else 'off'} (staging ring on): most own time")
            print("\n".join(line[:150] for line in text.splitlines()[:args.top + 9]))


if __name__ == "__main__":
    main()
