"""The routed experts' grouped GEMM at prefill sizes (bf16): rows per block (``block_m``) and tiles (BLOCK_N /
BLOCK_K / warps / stages) on one chunk's (token, expert) pairs, Flash's shapes (d 4096, moe_inter_dim 2048, 6 of
32 experts per token, routed at random: about N * 6 / 32 rows an expert). Each variant is checked against
torch's matmul per expert, then timed with CUDA events (median of 5 single launches). Beside the Triton kernel's
row blocks: torch._grouped_mm (CUTLASS's grouped GEMM on sm90, ``moe.GROUPED_MM``) over segments of 16 rows,
w1's time including the gather of the tokens' rows into the sorted layout (the engine gathers once for w1 and
w3). The peer, timed in the same run: cuBLAS's batched GEMM over the experts with the same rows per expert, no
gather."""

from __future__ import annotations

import argparse
import itertools

import torch
from common import event_ms, report, table

from dsv4.kernels import moe


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192])
    ap.add_argument("--block-m", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--block-n", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--block-k", type=int, nargs="+", default=[64])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--append", default=None)
    a = ap.parse_args()
    E, k, d, I = 32, 6, 4096, 2048
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(E, I, d, device="cuda", generator=g, dtype=torch.bfloat16) * d ** -0.5
    w2 = torch.randn(E, d, I, device="cuda", generator=g, dtype=torch.bfloat16) * I ** -0.5
    rows_out = []

    def check(out, inp, r, be, bm, w, gather, m_pad):
        """Relative error of ``out``'s live rows against each expert's rows times its weights in fp32."""
        src = r.clamp(min=0) if gather else torch.arange(m_pad, device="cuda")
        ex = be.repeat_interleave(bm)[:m_pad]
        live = ((r >= 0) & (ex >= 0))[:out.shape[0]]
        ref = torch.zeros(out.shape[0], w.shape[1], device="cuda")
        for e in range(E):
            sel = live & (ex[:out.shape[0]] == e)
            ref[sel] = inp[src[:out.shape[0]][sel]].float() @ w[e].float().T
        return ((out[live].float() - ref[live]).abs().max() / ref[live].abs().max()).item()

    for N in a.tokens:
        ids = torch.rand(N, E, device="cuda", generator=g).argsort(1)[:, :k]
        x = torch.randn(N, d, device="cuda", generator=g, dtype=torch.bfloat16)
        flops = 2 * N * k * d * I
        per = N * k // E
        xa = torch.randn(E, per, d, device="cuda", generator=g, dtype=torch.bfloat16)
        ha = torch.randn(E, per, I, device="cuda", generator=g, dtype=torch.bfloat16)
        peers = {"w1 (d -> I)": event_ms(lambda: torch.bmm(xa, w1.transpose(1, 2))),
                 "w2 (I -> d)": event_ms(lambda: torch.bmm(ha, w2.transpose(1, 2)))}
        for bm in a.block_m:
            r, _, be = moe.align(ids, E, bm)
            m_pad = r.shape[0]
            h = torch.randn(m_pad, I, device="cuda", generator=g, dtype=torch.bfloat16)
            for name, w, gather, inp in (("w1 (d -> I)", w1, True, x), ("w2 (I -> d)", w2, False, h)):
                default = moe.GEMM_CONFIG_PREFILL if bm > moe.BLOCK_M else None
                configs = [None] + [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns) for bn, bk, nw, ns in
                                    itertools.product(a.block_n, a.block_k, a.warps, a.stages)]
                for c in configs:
                    label = "default" if c is None else "/".join(str(c[key]) for key in
                                                                 ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))
                    if c is not None and c == default:
                        continue
                    fn = lambda c=c: moe._grouped_gemm(inp, r, w, be, gather, m_pad, c, block_m=bm)  # noqa: E731
                    try:
                        err = check(fn(), inp, r, be, bm, w, gather, m_pad)
                        ms = event_ms(fn)
                    except Exception as exc:  # shared memory, registers
                        rows_out.append([N, bm, name, label, f"failed: {type(exc).__name__}", "", "", ""])
                        continue
                    rows_out.append([N, bm, name, label, f"{err:.1e}", f"{ms:.3f}", f"{flops / ms / 1e9:.0f}",
                                     f"{peers[name] / ms:.2f}x"])
        bm = moe.BLOCK_M  # torch._grouped_mm over segments of 16 rows
        r, _, be = moe.align(ids, E, bm)
        m_pad = r.shape[0]
        blocks = moe.active_blocks(m_pad, bm, N * k)
        h = torch.randn(blocks * bm, I, device="cuda", generator=g, dtype=torch.bfloat16)
        offs = moe.segment_ends(be, E, bm, blocks)  # (once per MoE in the engine, for its three GEMMs)
        for name, w, gather, inp in (("w1 (d -> I)", w1, True, x), ("w2 (I -> d)", w2, False, h)):
            fn = (lambda w=w, inp=inp, gather=gather:  # noqa: E731
                  moe.grouped_mm(inp[r[:blocks * bm].clamp(min=0)] if gather else inp, w, offs))
            err = check(fn(), inp, r, be, bm, w, gather, m_pad)
            ms = event_ms(fn)
            rows_out.append([N, bm, name, "torch._grouped_mm" + (", gather included" if gather else ""),
                             f"{err:.1e}", f"{ms:.3f}", f"{flops / ms / 1e9:.0f}", f"{peers[name] / ms:.2f}x"])
        for name, ms in peers.items():
            rows_out.append([N, "", name, "cuBLAS bmm, equal rows per expert (peer)", "", f"{ms:.3f}",
                             f"{flops / ms / 1e9:.0f}", "1.00x"])
    report("Grouped expert GEMM at prefill sizes, bf16 (rows per block and tiles)",
           table(["tokens", "block_m", "GEMM", "BLOCK_N/BLOCK_K/warps/stages", "rel err", "ms", "TFLOP/s",
                  "vs the peer"], rows_out), a.append)


if __name__ == "__main__":
    main()
