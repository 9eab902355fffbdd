"""Skinny GEMMs y = x @ W^T at decode sizes (M = 1, 8, 32 rows of x), the DeepSeek-V4-Flash projections (bf16):
cuBLAS (F.linear; for the grouped wo_a the model's torch.einsum) against the Triton kernel of
dsv4.kernels.linear in each of its configurations. Every Triton result is checked against cuBLAS first (the
script stops on a mismatch). Timing: one CUDA graph of many back-to-back calls (no launch gaps but the graph's
own), cycling through enough copies of the weight that together they are 4x the L2, so every call reads its
weight from memory; CUDA events around each replay, the median of the replays over the number of calls.
GB/s counts the weight, x and y once; '% of copy' divides by the measured device-to-device copy bandwidth
(read + write), the measure decode_floor.py uses."""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F
from common import copy_bandwidth, report, table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from bench/ without install
from dsv4.kernels.linear import CONFIGS, _sm_count, default_config, plan, skinny_grouped_linear, skinny_linear  # noqa: E402

SHAPES = [  # name, N, K, G (G > 1: the grouped output projection, x [M, G, K], W [G, N, K])
    ("wq_a / compressor", 1024, 4096, 1),
    ("wq_b", 32768, 1024, 1),
    ("wkv", 512, 4096, 1),
    ("8192x4096", 8192, 4096, 1),
    ("wo_b", 4096, 8192, 1),
    ("shared w1/w3", 2048, 4096, 1),
    ("shared w2", 4096, 2048, 1),
    ("indexer wq_b", 8192, 1024, 1),
    ("indexer weights_proj", 64, 4096, 1),
    ("compressor (256)", 256, 4096, 1),
    ("wo_a (8 groups)", 1024, 4096, 8),
]


def graph_us(calls, n_calls: int, repeats: int) -> tuple[float, float]:
    """One CUDA graph of n_calls calls cycling through ``calls`` (one closure per weight copy), replayed
    ``repeats`` times -> (median us per call, (max - min) / median over the replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # compilation, cuBLAS handles: outside the capture
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            calls[i % len(calls)]()
    graph.replay()  # warm-up
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n_calls)
    del graph
    med = statistics.median(times)
    return med, (max(times) - min(times)) / med


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 32], help="rows of x")
    ap.add_argument("--configs", nargs="+", default=[c for c in CONFIGS if c != "fp32"], choices=list(CONFIGS))
    ap.add_argument("--split-k", type=int, nargs="*", default=[],
                    help="also time the default configuration with these forced K splits")
    ap.add_argument("--shapes", nargs="*", default=None, help="names of SHAPES to run (default: all)")
    ap.add_argument("--repeats", type=int, default=15, help="graph replays per measurement")
    ap.add_argument("--min-calls", type=int, default=64, help="calls per graph at least")
    ap.add_argument("--append", default=None, help="append the table to this markdown file")
    a = ap.parse_args()
    dev = torch.device("cuda")
    dt = torch.bfloat16
    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    sms = _sm_count(dev)
    g = torch.Generator(device="cuda").manual_seed(0)
    cands = [(c, c, None) for c in a.configs]  # (label, config, split_k); None config: the default
    cands += [(f"default s{s}", None, s) for s in a.split_k]
    rows, spreads, noise, speedups = [], [], [], {m: [] for m in a.m}
    for name, N, K, G in SHAPES:
        if a.shapes and name not in a.shapes:
            continue
        wshape = (G, N, K) if G > 1 else (N, K)
        wbytes = G * N * K * 2
        copies = max(2, math.ceil(4 * l2 / wbytes))
        ws = [(torch.randn(*wshape, device=dev, generator=g) * K ** -0.5).to(dt) for _ in range(copies)]
        n_calls = max(a.min_calls, copies)
        dflt = default_config(N, K, G, dt)
        S_dflt = plan(N, K, G, CONFIGS[dflt], None, sms)[0]
        for M in a.m:
            x = torch.randn(*((M, G, K) if G > 1 else (M, K)), device=dev, generator=g).to(dt)
            if G > 1:
                ref_fn = lambda w: torch.einsum("ngi,goi->ngo", x, w)  # noqa: E731  (what attention.py runs)
                tri_fn = lambda w, c, s: skinny_grouped_linear(x, w, config=c, split_k=s)  # noqa: E731
            else:
                ref_fn = lambda w: F.linear(x, w)  # noqa: E731
                tri_fn = lambda w, c, s: skinny_linear(x, w, config=c, split_k=s)  # noqa: E731
            ref = ref_fn(ws[0]).float()
            for label, c, s in cands:  # correctness before any timing
                y = tri_fn(ws[0], c, s)
                err = ((y.float() - ref).norm() / ref.norm()).item()
                if not (y.shape == ref.shape and torch.isfinite(y).all() and err < 1e-2):
                    raise SystemExit(f"MISMATCH: {name} N={N} K={K} G={G} M={M} config {label}: relative error "
                                     f"{err:.3g} against cuBLAS (shape {tuple(y.shape)}), not timing a wrong kernel")
            nbytes = wbytes + x.numel() * 2 + M * G * N * 2
            t_cublas, sp = graph_us([lambda w=w: ref_fn(w) for w in ws], n_calls, a.repeats)
            spreads.append(sp)
            times = {}
            for label, c, s in cands:
                times[label], sp = graph_us([lambda w=w, c=c, s=s: tri_fn(w, c, s) for w in ws], n_calls, a.repeats)
                spreads.append(sp)
            t_again, _ = graph_us([lambda w=w: ref_fn(w) for w in ws], n_calls, a.repeats)  # the same version twice
            noise.append(abs(t_again - t_cublas) / t_cublas)
            best = min(times, key=times.get)
            tb = times[best]
            speedups[M].append(t_cublas / times[dflt] if dflt in times else t_cublas / tb)
            rows.append([name, f"{N}x{K}" + (f" x{G}" if G > 1 else ""), M, round(t_cublas, 1),
                         *[round(times[lbl], 1) for lbl, _, _ in cands], best, round(nbytes / (tb * 1e-6) / 1e9),
                         f"{nbytes / (tb * 1e-6) / bw * 100:.0f}%", f"{nbytes / (t_cublas * 1e-6) / bw * 100:.0f}%",
                         f"{t_cublas / tb:.2f}x", f"{dflt} s{S_dflt}",
                         f"{t_cublas / times[dflt]:.2f}x" if dflt in times else "-"])
            print(" | ".join(str(v) for v in rows[-1]), flush=True)
        del ws
        torch.cuda.empty_cache()
    geo = ", ".join(f"M={m}: {math.exp(statistics.fmean(math.log(v) for v in s)):.2f}x"
                    for m, s in speedups.items() if s)
    headers = (["GEMM", "N x K", "M", "cuBLAS us"] + [f"{lbl} us" for lbl, _, _ in cands]
               + ["best", "best GB/s", "best % of copy", "cuBLAS % of copy", "best speed-up", "default (split)",
                  "default speed-up"])
    report("Skinny GEMMs at decode sizes: cuBLAS against dsv4.kernels.linear's Triton configurations (bf16)",
           table(headers, rows), a.append,
           notes=f"Copy bandwidth {bw / 1e12:.2f} TB/s (read + write); {sms} SMs; L2 {l2 >> 20} MB. Each time: one "
                 f"CUDA graph of >= {a.min_calls} calls cycling over weight copies worth 4x the L2, median of "
                 f"{a.repeats} replays. Spread (max - min) / median of the replays: at most "
                 f"{max(spreads) * 100:.1f}%; cuBLAS timed twice differed by at most {max(noise) * 100:.1f}%. "
                 f"Geometric-mean speed-up of the default configuration over cuBLAS: {geo}.")


if __name__ == "__main__":
    main()
