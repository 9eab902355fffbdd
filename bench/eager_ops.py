"""Host work of a graphed decode / MTP step, counted on the CPU: the torch ops an engine step dispatches outside
its CUDA-graph replays (each one a Python call and, on a GPU, most of them a launch or a copy), per step in steady
state, MTP off vs k with the whole-step graph, with the separate graphs, and with drafting paused (every step one
row a request and the MTP layer's keep-up pass, ``engine/spec_pause.py``). Runs the graphs' static-buffer path on
the CPU (``DSV4_STATIC_GRAPHS_ON_CPU``) on the ``tiny`` preset; a count, not a time.

    python3 bench/eager_ops.py [--ks 0 1 2 3 --batch 1 4]
"""

from __future__ import annotations

import argparse
import collections
import os

os.environ["DSV4_STATIC_GRAPHS_ON_CPU"] = "1"

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from common import report, table  # noqa: E402

from dsv4 import LLM, SamplingParams  # noqa: E402
from dsv4.engine import graphs as graphs_mod  # noqa: E402
from dsv4.engine.spec_pause import DraftPause  # noqa: E402


class OpCount(TorchDispatchMode):
    """Counts every aten op dispatched while ``on``."""

    def __init__(self):
        super().__init__()
        self.on, self.ops = True, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--append", default=None)
    args = ap.parse_args()
    mode = OpCount()
    real_run = graphs_mod.GraphRunner._run

    def replay_uncounted(self, bk, name, fn):  # what a captured graph would run is not host work
        mode.on = False
        try:
            return real_run(self, bk, name, fn)
        finally:
            mode.on = True

    graphs_mod.GraphRunner._run = replay_uncounted
    rows = []
    for B in args.batch:
        for k in args.ks:
            for whole in (True, False, "paused") if k else (True,):
                llm = LLM("tiny", warmup=False, max_batch_size=B, max_seq_len=512,
                          kv_cache_config={"max_tokens": 8192},
                          cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4, 8]},
                          speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None)
                llm.engine.runner.graphs.whole_step = whole is True
                eng = llm.engine
                if whole == "paused":  # paused at the first rejected draft (random weights), never probing
                    eng.pause = DraftPause(1.0, window=1, probe_every=10 ** 9)
                for i in range(B):
                    eng.add_request([5 + i, 6, 7, 8], SamplingParams(max_tokens=8 * args.steps, ignore_eos=True))
                for _ in range(6):  # prefill and the first steps: not counted
                    eng.step()
                mode.ops.clear()
                with mode:
                    for _ in range(args.steps):
                        eng.step()
                per = {op: n / args.steps for op, n in mode.ops.items()}
                top = ", ".join(f"{op} {n:g}" for op, n in sorted(per.items(), key=lambda x: -x[1])[:6])
                rows.append([B, k or "off", ({True: "whole", False: "separate"}.get(whole, whole)) if k else "-",
                             f"{sum(per.values()):g}", top])
                print(rows[-1], flush=True)
    report("Torch ops dispatched outside the graph replays per engine step (tiny, CPU static-graph path)",
           table(["batch", "k", "step graph", "ops / step", "most frequent"], rows), args.append,
           notes="Overlap scheduler on, greedy, steady state (after 6 steps). Views and slices count too: each is a"
                 " Python-level dispatch; on the GPU copies and kernels cost a launch each.")


if __name__ == "__main__":
    main()
