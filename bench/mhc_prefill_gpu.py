"""mHC's prefill kernels alone. The mixing partials (``dsv4.kernels.mhc._mix_partials``, the first launch of
``hc_pre``): a bfloat16 X against the mixing rows in bfloat16 products (the rows split in three parts, ``BF16``)
or in 3xTF32, over chunks of 64 or 128 inputs, 4 or 8 warps, Triton's pipeline depth or another. Flash's widths (4
streams of 4096, 24 mixing rows). GPU us per launch (``graph_us``: LAUNCHES launches captured in one CUDA graph
over 4 input copies, median of 5), the streams' read bandwidth, and the summed partials' error against float64 on
the GPU. Then ``hc_pre`` whole with ``mhc.MIX_BF16`` on and off. Then the write-back (``hc_post``) in programs of
512 to 4096 channels (``mhc.BLOCK_D`` at every N) and 4 to 16 warps (``mhc.POST_WARPS``): us and its bandwidth (X
and y read, X' written). With ``--post-mix`` only the write-back and the collapse after it: apart (``hc_post``
then ``hc_pre``) against the write-back computing the collapse's mixing partials (``hc_post_mix``, then
``hc_pre`` with them), in chunks of 64 or 32 channels (``mhc.POST_MIX_BLOCK``) and 8 or 4 warps."""

from __future__ import annotations

import argparse

import torch
import triton
from common import graph_us, kernel_run, rel_err, report, table

from dsv4.kernels import mhc


def partials(X, fn, bf16: bool, block: int, warps: int, stages: int | None, loop: int):
    N, n, d = X.shape
    K, R = n * d, fn.shape[0]
    KB = triton.cdiv(K, block * loop)
    P = torch.empty(N, KB, R + 1, dtype=torch.float32, device=X.device)
    extra = {} if stages is None else {"num_stages": stages}
    mhc._mix_partials[(triton.cdiv(N, mhc.MIX_TOKENS), KB)](
        X, X.stride(0), fn, P, N, K, loop, R=R, RP=32, BLOCK=block, TOKENS=mhc.MIX_TOKENS, BF16=bf16,
        num_warps=warps, PDL=0, **extra)
    return P


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[32, 1024, 8192])
    ap.add_argument("--quick", action="store_true", help="the current layout and its BF16 twin only")
    ap.add_argument("--post-mix", action="store_true", help="the write-back and collapse, apart and fused only")
    a, bw, g = kernel_run(ap)
    n, d, copies = 4, 4096, 4
    fn = torch.randn((2 + n) * n, n * d, device="cuda", generator=g) * 0.02
    if a.post_mix:
        post_mix(a, bw, g, fn, n, d, copies)
        return
    variants = [(bf16, block, warps, stages) for bf16 in (False, True) for block in (64, 128) for warps in (4, 8)
                for stages in (None, 2, 4)]
    if a.quick:
        variants = [(False, 64, 4, None), (True, 64, 4, None)]
    rows, post_rows = [], []
    defaults = mhc.BLOCK_D, mhc.POST_WARPS, mhc.POST_WIDE_TOKENS
    for N in a.tokens:
        xs = [torch.randn(N, n, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(copies)]
        ref = torch.cat((xs[0].flatten(1).double() @ fn.double().T, xs[0].flatten(1).double().square().sum(1, True)),
                        1)
        for bf16, block, warps, stages in variants:
            loop = max(1, mhc.mix_loop(N, n * d, False) * mhc.BLOCK_K // block)
            try:
                err = rel_err(partials(xs[0], fn, bf16, block, warps, stages, loop).sum(1), ref)
                us = graph_us(lambda i: partials(xs[i], fn, bf16, block, warps, stages, loop), copies)  # noqa: B023
            except Exception as e:  # noqa: BLE001 (a configuration that does not compile: its row says so)
                rows.append([N, "bf16" if bf16 else "tf32x3", block, warps, stages or "-", loop, "-", "-",
                             type(e).__name__])
                print(rows[-1], flush=True)
                continue
            rows.append([N, "bf16" if bf16 else "tf32x3", block, warps, stages or "-", loop, f"{us:.1f}",
                         f"{xs[0].numel() * 2 / us / 1e3:.0f}", f"{err:.1e}"])
            print(rows[-1], flush=True)
        base = torch.randn((2 + n) * n, device="cuda", generator=g)
        scale = torch.rand(3, device="cuda", generator=g) + 0.5
        whole = []
        for on in (False, True):
            mhc.MIX_BF16 = on
            whole.append(graph_us(lambda i: mhc.hc_pre(xs[i], fn, base, scale, 20, 1e-6, 1e-6), copies))
        mhc.MIX_BF16 = True
        print(f"hc_pre whole, {N} tokens: 3xTF32 {whole[0]:.1f} us, bf16 {whole[1]:.1f} us", flush=True)
        y = torch.randn(N, d, device="cuda", generator=g).to(torch.bfloat16)
        post = torch.rand(N, n, device="cuda", generator=g)
        comb = torch.rand(N, n, n, device="cuda", generator=g)
        ref = mhc.hc_post(y, xs[0], post, comb)
        for block, warps in ((512, 4), (1024, 4), (1024, 8), (2048, 8), (4096, 8), (4096, 16)):
            mhc.BLOCK_D, mhc.POST_WARPS, mhc.POST_WIDE_TOKENS = block, warps, N + 1  # this tile at every N
            same = torch.equal(mhc.hc_post(y, xs[0], post, comb), ref)
            us = graph_us(lambda i: mhc.hc_post(y, xs[i], post, comb), copies)  # noqa: B023
            post_rows.append([N, block, warps, f"{us:.1f}", f"{(2 * xs[0].numel() + y.numel()) * 2 / us / 1e3:.0f}",
                              same])
            print(post_rows[-1], flush=True)
        mhc.BLOCK_D, mhc.POST_WARPS, mhc.POST_WIDE_TOKENS = defaults
    report(f"mHC mixing partials alone, Flash widths (n 4, d 4096, 24 rows), bf16 streams; copy {bw / 1e9:.0f} GB/s",
           table(["tokens", "products", "block", "warps", "stages", "run", "us", "GB/s read", "rel err vs f64"],
                 rows), a.append)
    report("mHC write-back alone, Flash widths, bf16", table(["tokens", "channels a program", "warps", "us", "GB/s",
                                                               "bits equal 512 / 4's"], post_rows), a.append)


def post_mix(a, bw, g, fn, n: int, d: int, copies: int) -> None:
    rows = []
    base = torch.randn((2 + n) * n, device="cuda", generator=g)
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    w = torch.rand(d, device="cuda", generator=g).to(torch.bfloat16) + 0.5
    defaults = mhc.POST_MIX_BLOCK, mhc.POST_MIX_WARPS
    for N in a.tokens:
        xs = [torch.randn(N, n, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(copies)]
        y = torch.randn(N, d, device="cuda", generator=g).to(torch.bfloat16)
        post = torch.rand(N, n, device="cuda", generator=g)
        comb = torch.rand(N, n, n, device="cuda", generator=g)
        comb = comb / comb.sum(1, keepdim=True)

        def apart(i):
            out = mhc.hc_post(y, xs[i], post, comb)  # noqa: B023
            return out, mhc.hc_pre(out, fn, base, scale, 20, 1e-6, 1e-6, norm_weight=w)

        def fused(i):
            out, P = mhc.hc_post_mix(y, xs[i], post, comb, fn)  # noqa: B023
            return out, mhc.hc_pre(out, fn, base, scale, 20, 1e-6, 1e-6, norm_weight=w, partials=P)

        ref_out, ref = apart(0)
        us = graph_us(apart, copies)
        post_us = graph_us(lambda i: mhc.hc_post(y, xs[i], post, comb), copies)  # noqa: B023
        nbytes = (2 * xs[0].numel() + y.numel()) * 2
        rows.append([N, "apart", "-", "-", f"{us:.1f}", f"{post_us:.1f}", f"{nbytes / post_us / 1e3:.0f}", "-"])
        print(rows[-1], flush=True)
        for block in (64, 32):
            for warps in (8, 4):
                mhc.POST_MIX_BLOCK, mhc.POST_MIX_WARPS = block, warps
                out, res = fused(0)
                err = max(rel_err(out, ref_out), rel_err(res[0], ref[0]), rel_err(res[2], ref[2]))
                us = graph_us(fused, copies)
                wb = graph_us(lambda i: mhc.hc_post_mix(y, xs[i], post, comb, fn), copies)  # noqa: B023
                rows.append([N, "fused", block, warps, f"{us:.1f}", f"{wb:.1f}", f"{nbytes / wb / 1e3:.0f}",
                             f"{err:.1e}"])
                print(rows[-1], flush=True)
        mhc.POST_MIX_BLOCK, mhc.POST_MIX_WARPS = defaults
    report(f"mHC write-back then collapse, apart and fused (POST_MIX), Flash widths, bf16; copy {bw / 1e9:.0f} GB/s",
           table(["tokens", "write-back", "chunk", "warps", "both us", "write-back us", "write-back GB/s",
                  "rel err vs apart"], rows), a.append)


if __name__ == "__main__":
    main()
