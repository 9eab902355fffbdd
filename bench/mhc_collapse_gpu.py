"""The mHC collapse before a sub-block at decode sizes (``dsv4.kernels.mhc.hc_pre``: mixing partials, the collapse,
the Sinkhorn) with the sub-block's RMSNorm folded into the collapse against the collapse followed by the RMSNorm
kernel, and the collapse's warps (``mhc.COLLAPSE_WARPS``). Flash's widths (4 streams of 4096). GPU us per call
(``graph_us``: the calls captured in one CUDA graph over 4 input copies, median of 5) and the error against the
torch twin on the CPU."""

from __future__ import annotations

import argparse

import torch
from common import graph_us, kernel_run, rel_err, report, table

from dsv4.kernels import mhc
from dsv4.kernels.norm import rms_norm
from dsv4.model import mhc as twin


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32])
    a, _, g = kernel_run(ap)
    n, d, copies = 4, 4096, 4
    fn = torch.randn((2 + n) * n, n * d, device="cuda", generator=g) * 0.02
    base = torch.randn((2 + n) * n, device="cuda", generator=g)
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    w = (torch.rand(d, device="cuda", generator=g) + 0.5).to(torch.bfloat16)
    rows = []
    for N in a.tokens:
        xs = [torch.randn(N, n, d, device="cuda", generator=g).to(torch.bfloat16) for _ in range(copies)]
        ref = twin.hc_pre(*[t.cpu() for t in (xs[0], fn, base, scale)], 20, 1e-6, 1e-6, w.cpu())[0]
        fused = lambda i: mhc.hc_pre(xs[i], fn, base, scale, 20, 1e-6, 1e-6, norm_weight=w)  # noqa: E731
        apart = lambda i: rms_norm(mhc.hc_pre(xs[i], fn, base, scale, 20, 1e-6, 1e-6)[0], w, 1e-6)  # noqa: E731
        errs = f"{rel_err(fused(0)[0].cpu(), ref):.1e} / {rel_err(apart(0).cpu(), ref):.1e}"
        times = {}
        for warps in (4, 8, 16):
            mhc.COLLAPSE_WARPS = warps
            times[warps] = (graph_us(fused, copies), graph_us(apart, copies))
        mhc.COLLAPSE_WARPS = None
        rows.append([N] + [f"{f:.1f} / {p:.1f}" for f, p in times.values()] + [errs])
        print(rows[-1], flush=True)
    report("mHC collapse with the RMSNorm folded in against collapse + RMSNorm kernel, Flash widths (n 4, d 4096),"
           " bf16", table(["tokens", "4 warps: folded / apart (us)", "8 warps", "16 warps",
                           "rel err vs twin: folded / apart"], rows), a.append)


if __name__ == "__main__":
    main()
