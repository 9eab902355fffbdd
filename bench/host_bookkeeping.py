"""The engine's own Python time per step (on the CPU, no GPU needed): MTP off against MTP with drafting paused, a
batch of decode steps on the CUDA graphs' static buffers (``DSV4_STATIC_GRAPHS_ON_CPU``, the path a GPU step
takes), under cProfile. Counts the own time of dsv4's engine, cache and transfer functions (not the model's,
the kernels' twins' or torch's), leaving out the table expansion and cache gathers a GPU step does inside its
graph. A ratio of two runs on one machine; it says how much more host work a paused MTP step asks for, not
whether the overlap scheduler hides it.

    python3 bench/host_bookkeeping.py --concurrency 32 --steps 60
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random

os.environ.setdefault("DSV4_STATIC_GRAPHS_ON_CPU", "1")

from common import report, table  # noqa: E402

from dsv4 import LLM, SamplingParams  # noqa: E402
from dsv4.engine.spec_pause import DraftPause  # noqa: E402

IN_GRAPH = ("cache/plan.py:expand_rows_torch", "cache/ops.py:gather_with", "cache/ops.py:<lambda>")


def host_ms(k: int, concurrency: int, steps: int, preset: str) -> tuple[float, list]:
    rng = random.Random(0)
    llm = LLM(preset, device="cpu", dtype="fp32", max_batch_size=concurrency, max_num_tokens=1024,
              max_seq_len=64 + steps + 32, cuda_graph_config={"enable_padding": True, "batch_sizes": [concurrency]},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None)
    eng = llm.engine
    if k:
        eng.pause = DraftPause(1.0, window=1, probe_every=10 ** 6)  # paused after its first verify, no probes
    sp = SamplingParams(max_tokens=steps + 20, ignore_eos=True, detokenize=False)
    for _ in range(concurrency):
        eng.add_request([rng.randrange(2, llm.model.cfg.vocab_size) for _ in range(16)], sp)
    for _ in range(10):
        eng.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    own: dict[str, float] = {}
    for (fn, _, name), (_, _, tt, _, _) in pstats.Stats(prof).stats.items():
        if "/dsv4/" in fn and "/dsv4/model/" not in fn and "/dsv4/kernels/" not in fn:
            key = fn.split("/dsv4/")[1] + ":" + name
            if key not in IN_GRAPH:
                own[key] = own.get(key, 0.0) + tt
    top = sorted(own.items(), key=lambda kv: -kv[1])[:5]
    return sum(own.values()) / steps * 1e3, [(n, t / steps * 1e3) for n, t in top]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--append", default=None)
    args = ap.parse_args()
    rows, tops = [], []
    base = None
    for k in (0, 1):
        ms, top = host_ms(k, args.concurrency, args.steps, args.preset)
        base = base or ms
        rows.append(["off" if k == 0 else "k = 1, paused", f"{ms:.2f}", f"{ms / base:.2f}x"])
        tops.append(f"- {'off' if k == 0 else 'k = 1, paused'}: " + ", ".join(f"{n} {t:.3f}" for n, t in top))
    text = table(["MTP", "engine Python ms / step (CPU)", "vs off"], rows)
    report(f"The engine's own Python time per decode step, {args.preset}, concurrency {args.concurrency}", text
           + "\n\n" + "\n".join(tops), args.append,
           notes="cProfile own time of dsv4's engine, cache and transfer functions over the timed steps (the table"
                 " expansion and gathers a GPU step runs inside its graph left out); one CPU machine, one run each.")


if __name__ == "__main__":
    main()
