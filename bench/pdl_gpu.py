"""Programmatic dependent launch (PDL) on a chain of kernels in one CUDA graph, before the engine takes it.

A decode step is ~900 dependent launches; each waits for the last to finish and drain before its own programs
start. With PDL (Hopper: ``launch_pdl=True`` and ``griddepcontrol.wait`` at the kernel's top) the next grid is
launched while the previous one finishes, and a weight-streaming kernel can load weights that no kernel writes
before it waits. Two chains:

- tiny: CHAIN launches of a one-wave elementwise kernel, each reading the last one's output;
- gemv: a 4096 x 4096 FP8-weight GEMV (the engine's GEMV scheme: 8 rows a program, 512 inputs a chunk) then a
  one-wave norm-like kernel on its output, LAYERS times over distinct weights (nothing in L2).

Timed by common.graph_us (the chain captured LAUNCHES times in one graph). Variants: plain launches; PDL with the
wait first; PDL with the wait first and the dependents released right after it; (gemv) PDL with the first weight
chunk loaded before the wait. The outputs of every variant are
compared with the plain chain's, bit for bit."""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from common import graph_us, report, table

CHAIN = 400
LAYERS = 40


@triton.jit
def _start(PDL: tl.constexpr, EARLY: tl.constexpr):
    """The variants' dependency handling: PDL waits for the predecessor; EARLY then releases the next kernel."""
    if PDL:
        tl.extra.cuda.gdc_wait()
    if EARLY:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _tiny_kernel(X, Y, n, PDL: tl.constexpr, EARLY: tl.constexpr, BLOCK: tl.constexpr):
    _start(PDL, EARLY)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x * 0.999 + 0.001).to(Y.dtype.element_ty), mask=offs < n)


@triton.jit
def _gemv_kernel(X, W, OUT, N, K, PDL: tl.constexpr, EARLY: tl.constexpr, PREFETCH: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k0 = 0
    if PREFETCH:  # the weights are no kernel's output: the first chunk is loaded before the wait
        w0 = tl.load(W + rn[:, None] * K + rk[None, :])
    _start(PDL, EARLY)
    if PREFETCH:
        acc += w0.to(tl.float32) * tl.load(X + rk).to(tl.float32)[None, :]
        k0 = BLOCK_K
    for k in range(k0, K, BLOCK_K):
        w = tl.load(W + rn[:, None] * K + (k + rk)[None, :])
        acc += w.to(tl.float32) * tl.load(X + k + rk).to(tl.float32)[None, :]
    tl.store(OUT + rn, tl.sum(acc, axis=1).to(OUT.dtype.element_ty))


@triton.jit
def _norm_kernel(X, Y, d, PDL: tl.constexpr, EARLY: tl.constexpr, D: tl.constexpr):
    _start(PDL, EARLY)
    c = tl.arange(0, D)
    x = tl.load(X + c, mask=c < d, other=0.0).to(tl.float32)
    y = x / tl.sqrt(tl.sum(x * x, axis=0) / d + 1e-6)
    tl.store(Y + c, y.to(Y.dtype.element_ty), mask=c < d)


VARIANTS = [("plain", False, False, False), ("PDL, wait first", True, False, False),
            ("PDL, wait, release at once", True, True, False), ("PDL, weight chunk before wait", True, False, True),
            ("PDL, chunk before wait, release at once", True, True, True)]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--append", default=None)
    a = ap.parse_args()
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    n = 132 * 1024
    bufs = [torch.randn(n, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2)]

    def tiny(pdl, early):
        def run():
            for i in range(CHAIN):
                _tiny_kernel[(triton.cdiv(n, 1024),)](bufs[i % 2], bufs[(i + 1) % 2], n, PDL=pdl, EARLY=early,
                                                      BLOCK=1024, launch_pdl=pdl)
        return run

    base = None
    for name, pdl, early, pre in VARIANTS:
        if pre:
            continue
        bufs[0].copy_(torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(1)))
        us = graph_us(lambda i: tiny(pdl, early)(), copies=1)
        out = bufs[CHAIN % 2].clone()
        base = out if base is None else base
        rows.append([f"tiny x {CHAIN}", name, f"{us / CHAIN:.2f}", "", str(torch.equal(out, base))])

    N = K = 4096
    ws = [(torch.randn(N, K, device=dev, generator=g) * 8).to(torch.float8_e4m3fn) for _ in range(LAYERS)]
    x0 = torch.randn(K, device=dev, generator=g, dtype=torch.bfloat16)
    xs = [x0.clone(), torch.empty_like(x0)]

    def gemv(pdl, early, pre):
        def run():
            xs[0].copy_(x0)
            for w in ws:
                _gemv_kernel[(N // 8,)](xs[0], w, xs[1], N, K, PDL=pdl, EARLY=early, PREFETCH=pre, BLOCK_N=8,
                                        BLOCK_K=512, num_warps=4, launch_pdl=pdl)
                _norm_kernel[(1,)](xs[1], xs[0], K, PDL=pdl, EARLY=early, D=4096, num_warps=8, launch_pdl=pdl)
        return run

    base = None
    for name, pdl, early, pre in VARIANTS:
        us = graph_us(lambda i: gemv(pdl, early, pre)(), copies=1)
        out = xs[0].clone()
        base = out if base is None else base
        gbs = LAYERS * N * K / (us * 1e-6) / 1e9
        rows.append([f"gemv 4096^2 fp8 + norm x {LAYERS}", name, f"{us / LAYERS:.2f}", f"{gbs:.0f}",
                     str(torch.equal(out, base))])
    report("Programmatic dependent launch on chains of kernels in one CUDA graph",
           table(["chain", "variant", "us per link", "weight GB/s", "same bits as plain"], rows), a.append)


if __name__ == "__main__":
    main()
