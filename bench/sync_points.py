"""Where an engine step waits for the GPU without meaning to: steady-state decode steps of the trained ``mini`` run
under ``torch.cuda.set_sync_debug_mode('warn')``, and each synchronising call (a plain host-to-device copy waits
for the whole stream, ``.item()``, ``.tolist()`` of a device tensor, ...) is counted with the engine's frames that
led to it. An overlapped step should have none: it reads the previous step through events only.

    python3 bench/sync_points.py --k 1 [--sync] [--steps 20]
    python3 bench/sync_points.py --prefill 8192 [--preset flash-L4-E32]   # one prompt's prefill (LLM.generate)

A prefill's own waits (``--prefill``) leave the GPU idle while the host catches up with its launches.
"""

from __future__ import annotations

import argparse
import collections
import traceback
import warnings

import torch

from dsv4 import LLM, SamplingParams
from dsv4.builtin import heldout_prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--sync", action="store_true", help="the overlap scheduler off")
    ap.add_argument("--prefill", type=int, default=0, help="one prefill of this many tokens instead (random weights)")
    ap.add_argument("--preset", default="flash-L4-E32", help="the model of --prefill")
    args = ap.parse_args()
    if args.prefill:
        return prefill(args)
    llm = LLM("mini", device="cuda", dtype="bf16", max_batch_size=args.concurrency, max_num_tokens=2048,
              max_seq_len=1024, disable_overlap_scheduler=args.sync,
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": args.k} if args.k else None)
    sp = SamplingParams(max_tokens=200, ignore_eos=True, detokenize=False)
    eng = llm.engine
    for p in heldout_prompts("mini")[:args.concurrency]:
        eng.add_request(llm._encode(p)[0], sp)
    for _ in range(6):  # prefill and the first decode steps
        eng.step()
    seen: collections.Counter = collections.Counter()

    seen, counting = counter()
    with counting:
        for _ in range(args.steps):
            eng.step()
    print(f"== k={args.k} c={args.concurrency} overlap {'off' if args.sync else 'on'}: {sum(seen.values())}"
          f" synchronising calls in {args.steps} steps")
    for (msg, where), n in seen.most_common():
        print(f"{n:5d}  {msg} | {where}")


def counter():
    """(a Counter, a context): inside the context each synchronising call is counted by its message and the
    engine's last five frames that led to it."""
    import contextlib

    seen: collections.Counter = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/dsv4/" in f.filename]
        where = " <- ".join(f"{f.filename.split('/dsv4/')[-1]}:{f.lineno} {f.name}" for f in reversed(frames[-5:]))
        seen[(str(message).split("\n")[0][:60], where)] += 1

    @contextlib.contextmanager
    def counting():
        with warnings.catch_warnings():  # (restores showwarning)
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode("default")

    return seen, counting()


def prefill(args):
    import random

    from dsv4.config import get_preset

    cfg = get_preset(args.preset)
    llm = LLM(args.preset, device="cuda", dtype="bf16", max_batch_size=1, max_num_tokens=args.prefill,
              max_seq_len=args.prefill + 8, kv_cache_config={"free_gpu_memory_fraction": 0.5})
    rng = random.Random(0)
    prompt = [rng.randrange(2, cfg.vocab_size) for _ in range(args.prefill)]
    sp = SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate([prompt], sp)  # untimed: shapes compile
    seen, counting = counter()
    with counting:
        llm.generate([prompt], sp)
    print(f"== {args.preset}, one {args.prefill}-token prefill: {sum(seen.values())} synchronising calls")
    for (msg, where), n in seen.most_common():
        print(f"{n:5d}  {msg} | {where}")


if __name__ == "__main__":
    main()
