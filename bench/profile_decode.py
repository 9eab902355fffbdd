"""Where a decode step's GPU time goes: torch.profiler over a few engine steps (CUDA graphs replayed), kernels
grouped by name, per step. Prints the kernel count, the summed kernel time and the top kernels.

    python3 bench/profile_decode.py --batch 1 32 [--preset flash-L4-E32 --steps 10 --top 15]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import random
import sys
import time

from common import report, sync, table
from decode_floor import add_switches, apply_switches
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4 import LLM, SamplingParams
from dsv4.config import get_preset


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="flash-L4-E32")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--mtp", type=int, default=0, help="MTP draft tokens per step (0: off); random weights, so"
                                                         " drafts are rejected: the cost of a verify step")
    ap.add_argument("--expert-format", default="dequantized", choices=["dequantized", "fp4"])
    ap.add_argument("--linear-format", default="dequantized", choices=["dequantized", "fp8"])
    ap.add_argument("--kernels-only", action="store_true", help="only the kernel table (no eager ops, no cProfile)")
    ap.add_argument("--append", default=None)
    add_switches(ap)  # decode_floor.py's A/B switches
    a = ap.parse_args()
    switched = "".join(f", {phrase}" for phrase in apply_switches(a))
    cfg = get_preset(a.preset)
    llm = LLM(a.preset, device="cuda", dtype="bf16", max_batch_size=max(a.batch), max_num_tokens=8192,
              max_seq_len=a.prompt_len + 3 * a.steps + 16 + a.mtp, kv_cache_config={"free_gpu_memory_fraction": 0.2},
              enforce_eager=a.eager, moe_config={"expert_format": a.expert_format}, linear_format=a.linear_format,
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": a.mtp} if a.mtp else None)
    eng = llm.engine
    rng = random.Random(0)
    for B in a.batch:
        for _ in range(B):
            eng.add_request([rng.randrange(2, cfg.vocab_size) for _ in range(a.prompt_len)],
                            SamplingParams(max_tokens=3 * a.steps + 8, ignore_eos=True))
        for _ in range(3):
            eng.step()
        sync()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            eng.step()
        sync()
        wall_ms = (time.perf_counter() - t0) / a.steps * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.steps):
                eng.step()
            sync()
        host = None if a.kernels_only else _host_profile(eng, a.steps, a.top)
        sources = None if a.kernels_only else _ops_by_source(eng, a.top)
        while eng.has_unfinished_requests():
            eng.step()
        kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
        total_us = sum(e.device_time_total for e in kernels)
        count = sum(e.count for e in kernels)
        kernels.sort(key=lambda e: -e.device_time_total)
        rows = [[e.key[:70].replace("|", "/"), f"{e.count / a.steps:.0f}", f"{e.device_time_total / a.steps:.1f}",
                 f"{100 * e.device_time_total / max(total_us, 1e-9):.1f}%"] for e in kernels[:a.top]]
        text = table(["kernel", "launches / step", "us / step", "share"], rows)
        head = (f"{count / a.steps:.0f} kernel launches per step, {total_us / a.steps / 1e3:.2f} ms of kernel time"
                f" per step, {wall_ms:.2f} ms wall per step (batch {B}, {'eager' if a.eager else 'CUDA graphs'},"
                f" MTP {a.mtp or 'off'})")
        formats = f"experts {a.expert_format}, linears {a.linear_format}"
        report(f"Decode step kernels, {a.preset}, bf16, {formats}, batch {B}, MTP {a.mtp or 'off'}{switched}",
               head + "\n\n" + text, a.append)
        if not a.kernels_only:
            report(f"Device ops of one eager decode step by source line, batch {B}", sources, a.append)
            report(f"Host time of a graphed decode step by function (cProfile), batch {B}", host, a.append)


def _host_profile(eng, steps: int, top: int) -> str:
    """Where the step's host time goes (graphs replayed): cProfile, functions by own time per step. Waiting
    for the GPU shows up in the call that synchronises (``tolist``, ``item``)."""
    sync()
    t0 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step()
    prof.disable()
    sync()
    wall = (time.perf_counter() - t0) / steps
    st = pstats.Stats(prof)
    rows = sorted(((tt, nc, f) for f, (_, nc, tt, _, _) in st.stats.items()), reverse=True)[:top]
    text = table(["function", "calls / step", "own ms / step"],
                 [[f"{f[0].split('/')[-1]}:{f[1]} {f[2]}".replace("|", "/"), f"{nc / steps:.0f}",
                   f"{tt / steps * 1e3:.3f}"] for tt, nc, f in rows])
    return f"{wall * 1e3:.2f} ms per step under cProfile (which adds overhead)\n\n" + text


class _OpsBySource(TorchDispatchMode):
    """Counts the ops that reach a device kernel (views and metadata ops left out) by the dsv4 source line
    that issued them."""

    _META = ("detach", "view", "_unsafe_view", "unsqueeze", "t", "slice", "select", "expand", "as_strided",
             "reshape", "squeeze", "permute", "transpose", "alias", "split", "split_with_sizes", "unbind",
             "flatten", "lift_fresh", "unflatten", "_reshape_alias", "empty", "empty_like", "empty_strided")

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name not in self._META:
            f, where = sys._getframe(1), "?"
            while f is not None:
                path = f.f_code.co_filename
                if "/dsv4/" in path:
                    where = f"{path.split('/dsv4/')[1]}:{f.f_lineno} {f.f_code.co_name}"
                    break
                f = f.f_back
            self.counts[(where, name)] += 1
        return func(*args, **(kwargs or {}))


def _ops_by_source(eng, top: int) -> str:
    """One decode step with the graphs set aside (eager, same kernels), its device ops by source line."""
    graphs, eng.runner.graphs = eng.runner.graphs, None
    mode = _OpsBySource()
    try:
        with mode:
            eng.step()
    finally:
        eng.runner.graphs = graphs
    total = sum(mode.counts.values())
    rows = [[w.replace("|", "/"), op, n] for (w, op), n in mode.counts.most_common(top)]
    return f"{total} device ops in one eager step\n\n" + table(["source", "op", "count"], rows)


if __name__ == "__main__":
    main()
