"""Can the DRAM's idle time in a decode step feed the next weight GEMV? A question for the GPU, not yet a feature.

At batch 1 a Flash layer's step is weight GEMVs separated by chains of small latency-bound kernels (norms, RoPE,
attention, mHC, router: about 20 us a layer, BENCHMARKS.md), during which the DRAM idles; the H100's L2 holds 50
MB, more than any one FP8 projection. Here a stand-in chain (CHAIN RMSNorm launches on one 4096-wide row) runs
before a one-row FP8 GEMV (``fp8_linear``'s row kernel) on one of Flash's projections, and a prefetch of that
GEMV's weight into L2 is forked onto the side stream when the chain starts: ``cp.async.bulk.prefetch.L2`` (the
copy engine fetches CHUNK bytes a request into L2, no registers) or plain loads whose values are dropped. All in
one CUDA graph (``graph_us``), cycling over COPIES weight copies, so without the prefetch the weight comes from
DRAM. Columns, GPU us: the chain alone, the GEMV alone (cold, and warm: one copy again and again, in L2), chain +
GEMV without prefetch, with each prefetch; "gain" is what the prefetch took off chain + GEMV.

    python bench/l2_prefetch_gpu.py [--chain 8]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from common import graph_us, kernel_run, report, table
from fp8_linear_gpu import fp8_weights

from dsv4.kernels import fp8_linear as f8
from dsv4.kernels.norm import rms_norm
from dsv4.kernels.side_stream import fork, join, side_stream

SHAPES = [("wq_b", 32768, 1024), ("wo_b", 4096, 8192), ("shared w1+w3", 4096, 4096), ("wq_a+wkv", 1536, 4096)]
COPIES = 4
CHUNK = 16384  # bytes a bulk prefetch request


@triton.jit
def _bulk_prefetch(BASE, nbytes, CHUNK: tl.constexpr, PER: tl.constexpr):
    """Program p asks the copy engine for PER chunks of CHUNK bytes from BASE + p * PER * CHUNK into L2 (the last
    one cut to what is left; nbytes a multiple of 16)."""
    offs = (tl.program_id(0) * PER + tl.arange(0, PER)).to(tl.int64) * CHUNK
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [BASE + offs, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _load_prefetch(W, n_words, SINK, BLOCK: tl.constexpr, PER: tl.constexpr):
    """Program p loads PER blocks of BLOCK int32 words (through L2, not kept in L1) and drops them: it stores
    their sum only if it is exactly 0x7fffffff, which random weights make about never (and a store costs
    nothing here)."""
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for j in range(PER):
        offs = (tl.program_id(0) * PER + j).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(W + offs, mask=offs < n_words, other=0, cache_modifier=".cg")
    total = tl.sum(acc, axis=0)
    if total == 0x7FFFFFFF:
        tl.store(SINK, total)


def prefetch(w: torch.Tensor, how: str, sink: torch.Tensor) -> None:
    nbytes = w.numel() * w.element_size()
    if how == "bulk":
        per = 8
        _bulk_prefetch[(triton.cdiv(nbytes, CHUNK * per),)](w.data_ptr(), nbytes, CHUNK=CHUNK, PER=per, num_warps=1)
    else:
        words, block, per = w.view(torch.int32).view(-1), 1024, 16
        _load_prefetch[(triton.cdiv(words.numel(), block * per),)](words, words.numel(), sink, BLOCK=block, PER=per,
                                                                  num_warps=4)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chain", type=int, default=8, help="RMSNorm launches standing in for a layer's small kernels")
    a, bw, g = kernel_run(ap)
    row = torch.randn(1, 4096, device="cuda", generator=g, dtype=torch.bfloat16)
    nw = torch.rand(4096, device="cuda", generator=g, dtype=torch.bfloat16)
    sink = torch.zeros(1, device="cuda", dtype=torch.int32)

    def chain():
        y = row
        for _ in range(a.chain):
            y = rms_norm(y, nw, 1e-6)
        return y

    rows = []
    for name, N, K in SHAPES:
        q8 = fp8_weights(1, N, K, g)[:COPIES]
        x = torch.randn(1, 1, K, device="cuda", generator=g, dtype=torch.bfloat16)
        gemv = lambda i: f8._launch(x, *q8[i], gemv="row")  # noqa: E731

        def step(how):
            def fn(i):
                side = side_stream(x, how is not None)
                if side is not None:
                    with fork(side, x.device):
                        prefetch(q8[i][0], how, sink)
                chain()
                out = gemv(i)
                join(side, x.device)
                return out
            return fn

        t = {"chain": graph_us(lambda i: chain(), COPIES), "cold": graph_us(gemv, COPIES),
             "warm": graph_us(lambda i: gemv(0), COPIES), "none": graph_us(step(None), COPIES),
             "bulk": graph_us(step("bulk"), COPIES), "load": graph_us(step("load"), COPIES)}
        mb = N * K / 1e6
        gain = lambda how: f"{t[how]:.1f} ({t['none'] - t[how]:+.1f})"  # noqa: E731
        rows.append([name, f"{mb:.1f}", f"{t['chain']:.1f}", f"{t['cold']:.1f} / {t['warm']:.1f}", f"{t['none']:.1f}",
                     gain("bulk"), gain("load")])
        print(rows[-1], flush=True)
    report(f"L2 prefetch of a one-row FP8 GEMV's weight during a chain of {a.chain} small kernels, Flash projections",
           table(["projection", "MB", "chain us", "GEMV cold / warm us", "chain + GEMV us",
                  "with bulk prefetch (gain)", "with load prefetch (gain)"], rows), a.append,
           notes=f"Copy bandwidth measured in the same run: {bw / 1e12:.2f} TB/s. Bulk requests of {CHUNK} bytes.")


if __name__ == "__main__":
    main()
