"""Where a prefill's GPU time goes: torch.profiler over ``LLM.generate`` of one prompt with ``max_tokens=1``,
kernels grouped by name and by kind (cuBLAS GEMMs, the MoE grouped GEMM, attention, indexer, the rest), with each
kind's share of the summed kernel time. Issue 20's prefill goal is stated on 8k-token chunks.

    python3 bench/profile_prefill.py --lens 8192 [--preset flash-L4-E32 --top 20]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random

from common import report, sync, table, timed
from torch.profiler import ProfilerActivity, profile, record_function

from dsv4 import LLM, SamplingParams
from dsv4.config import get_preset

# kind of a kernel, from its name (first match wins)
KINDS = [("MoE grouped GEMM", ("_grouped_gemm", "grouped_gemm")),
         ("GEMM (cuBLAS / nvjet)", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
         ("attention", ("sparse_sink", "_split_partial", "_split_merge", "attn")),
         ("indexer", ("index", "topk", "radix")),
         ("compressor / pool", ("pool", "compress")),
         ("MoE routing / align / combine", ("_gate_", "_align", "_combine", "_token_rows", "_expand")),
         ("mHC", ("_mix_partials", "_collapse", "_post")),
         ("norm / rope / swiglu", ("norm", "rope", "swiglu"))]


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other (torch elementwise, copies, ...)"


def timeline(llm, prompt, sp, T, top, append):
    """One generate under the profiler: its wall range (a record_function around it) against the union of its
    kernels' device intervals, on the profiler's one clock."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("generate"):
            llm.generate([prompt], sp)
            sync()
    events = prof.events()
    span = next(e for e in events if e.name == "generate" and e.device_type.name == "CPU")
    t0, t1 = span.time_range.start, span.time_range.end
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                if e.device_type.name == "CUDA" and e.name != "generate" and t0 <= e.time_range.start <= t1)
    busy, gaps, end = 0.0, [], None
    for s, e, name in ks:
        if end is not None and s > end[0]:
            gaps.append((s - end[0], end[1], name))
        if end is None or e > end[0]:
            busy += e - max(s, end[0]) if end is not None else e - s
            end = (e, name)
    gaps.sort(reverse=True)
    lead, tail = ks[0][0] - t0, t1 - end[0]
    rows = [["wall (generate)", f"{(t1 - t0) / 1e3:.2f}"], ["before the first kernel", f"{lead / 1e3:.2f}"],
            ["kernels running (union)", f"{busy / 1e3:.2f}"],
            [f"idle between kernels ({len(gaps)} gaps)", f"{sum(g for g, _, _ in gaps) / 1e3:.2f}"],
            ["after the last kernel", f"{tail / 1e3:.2f}"]]
    report(f"Where one {T}-token prefill's wall time goes (device timeline)",
           table(["part", "ms"], rows) + "\n\n" + table(
               ["idle gap us", "after kernel", "before kernel"],
               [[f"{g:.0f}", a[:60].replace("|", "/"), b[:60].replace("|", "/")] for g, a, b in gaps[:top]]), append)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="flash-L4-E32")
    ap.add_argument("--lens", type=int, nargs="+", default=[8192])
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--expert-format", default="dequantized", choices=["dequantized", "fp4"])
    ap.add_argument("--linear-format", default="dequantized", choices=["dequantized", "fp8"])
    ap.add_argument("--host", action="store_true", help="also the host's time by function (cProfile, own time)")
    ap.add_argument("--ops", action="store_true",
                    help="also the torch ops that launched kernels, by their own device time, with input shapes")
    ap.add_argument("--gaps", action="store_true",
                    help="also where the TTFT's wall time goes on the device's timeline: before the first kernel, "
                         "between kernels (the longest idle gaps, with the kernels around them), after the last")
    ap.add_argument("--append", default=None)
    a = ap.parse_args()
    cfg = get_preset(a.preset)
    llm = LLM(a.preset, device="cuda", dtype="bf16", max_batch_size=1, max_num_tokens=a.chunk,
              max_seq_len=max(a.lens) + 8, kv_cache_config={"free_gpu_memory_fraction": 0.5},
              moe_config={"expert_format": a.expert_format}, linear_format=a.linear_format)
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=1, ignore_eos=True)
    for T in a.lens:
        prompt = [rng.randrange(2, cfg.vocab_size) for _ in range(T)]
        llm.generate([prompt], sp)  # untimed: shapes compile
        wall, _ = timed(lambda prompt=prompt: llm.generate([prompt], sp), repeat=3)
        sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate([prompt], sp)
            sync()
        kernels = [e for e in prof.key_averages() if e.device_time_total > 0 and e.device_type.name == "CUDA"]
        total = sum(e.device_time_total for e in kernels)
        kernels.sort(key=lambda e: -e.device_time_total)
        by_kind: dict[str, list[float]] = {}
        for e in kernels:
            got = by_kind.setdefault(kind_of(e.key), [0.0, 0])
            got[0] += e.device_time_total
            got[1] += e.count
        kind_rows = [[k, n, f"{us / 1e3:.2f}", f"{100 * us / total:.1f}%"]
                     for k, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])]
        rows = [[e.key[:80].replace("|", "/"), e.count, f"{e.device_time_total / 1e3:.2f}",
                 f"{e.device_time_total / e.count:.0f}", f"{100 * e.device_time_total / total:.1f}%"]
                for e in kernels[:a.top]]
        head = (f"{T}-token prompt: TTFT {wall * 1e3:.1f} ms (median of 3), {total / 1e3:.1f} ms of kernel time "
                f"in {sum(e.count for e in kernels)} launches")
        report(f"Prefill kernels, {a.preset}, bf16, experts {a.expert_format}, linears {a.linear_format}, "
               f"{T} tokens in chunks of {a.chunk}",
               head + "\n\n" + table(["kind", "launches", "ms", "share"], kind_rows) + "\n\n"
               + table(["kernel", "launches", "ms", "us each", "share"], rows), a.append)
        if a.ops:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                llm.generate([prompt], sp)
                sync()
            ops = [e for e in prof.key_averages(group_by_input_shape=True)
                   if e.self_device_time_total > 0 and e.key.startswith("aten::")]
            ops.sort(key=lambda e: -e.self_device_time_total)
            print(table(["torch op", "input shapes", "calls", "own device ms"],
                        [[e.key, str(e.input_shapes)[:90].replace("|", "/"), e.count,
                          f"{e.self_device_time_total / 1e3:.2f}"] for e in ops[:a.top]]))
        if a.gaps:
            timeline(llm, prompt, sp, T, a.top, a.append)
        if a.host:
            prof = cProfile.Profile()
            sync()
            prof.enable()
            llm.generate([prompt], sp)
            sync()
            prof.disable()
            st = pstats.Stats(prof)
            top = sorted(((tt, nc, f) for f, (_, nc, tt, _, _) in st.stats.items()), reverse=True)[:a.top]
            report(f"Host time of one {T}-token prefill by function (cProfile, own time; waiting for the GPU shows"
                   " in the call that synchronises)",
                   table(["function", "calls", "own ms"], [[f"{f[0].split('/')[-1]}:{f[1]} {f[2]}".replace("|", "/"),
                                                           nc, f"{tt * 1e3:.2f}"] for tt, nc, f in top]), a.append)
            ours = sorted(((ct, nc, f) for f, (_, nc, _, ct, _) in st.stats.items() if "/dsv4/" in f[0]),
                          reverse=True)[:a.top]
            report("The same, dsv4's functions by cumulative time",
                   table(["function", "calls", "cumulative ms"],
                         [[f"{f[0].split('/dsv4/')[-1]}:{f[1]} {f[2]}".replace("|", "/"), nc, f"{ct * 1e3:.2f}"]
                          for ct, nc, f in ours]), a.append)


if __name__ == "__main__":
    main()
