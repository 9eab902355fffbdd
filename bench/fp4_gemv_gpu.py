"""Packed FP4 experts at decode sizes: the GEMV path (dsv4.kernels.fp4_gemv) against the FP4 grouped GEMM
(tensor cores, ``moe.GEMM_CONFIG_FP4``) and the bf16 grouped GEMM on the same experts, GPU time (``graph_us``:
24 launches in one CUDA graph, cycling over 6 weight copies so none sits in L2), Flash's expert shapes (d 4096,
moe_inter_dim 2048, 6 experts per token) with 128 experts (flash-E128). Checks each against the twin (the
weights decoded, one bf16 GEMM) first. Every kernel's grid stops at the row blocks that can hold pairs
(``moe.active_blocks``, as in the engine); the "all blocks" rows launch a program per row block of the layout,
as before; "FOLD" is the tensor-core GEMM's one-product decode (``fp4_gemv.FOLD``). The gate-up rows time the
experts' first half: w1, w3 and the SwiGLU fused in one GEMV launch (``fp4_gemv_gate_up``) against the two GEMVs
and the SwiGLU kernel. Prints short tables; ``--sweep`` also tries GEMV tiles.

    python3 bench/fp4_gemv_gpu.py [--batch 1 32 --experts 128 --sweep]
"""

from __future__ import annotations

import argparse

import torch
from common import copy_bandwidth, graph_us, report, table

from dsv4.checkpoint.quant import pack_fp4_stacked
from dsv4.kernels.fp4_gemv import (GEMV_CONFIG, GEMV_CONFIG_GATE_UP, fold_scales, fp4_gemv, fp4_gemv_gate_up,
                                   gate_up_config)
from dsv4.kernels.moe import (GEMM_CONFIG_FP4, _grouped_gemm, _grouped_gemm_torch, active_blocks, align,
                              gate_up_torch)
from dsv4.kernels.swiglu import swiglu_to

COPIES = 6


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--gate-up-only", action="store_true", help="only the first half's table (with --sweep: every tile)")
    ap.add_argument("--gemv-sweep-only", action="store_true", help="with --sweep: the tensor-core GEMM at its default"
                    " tile only")
    ap.add_argument("--join-sweep", action="store_true", help="sweep GEMV tiles with JOIN (the decoded tiles joined,"
                    " fp4_gemv.join8) against the defaults; the tensor-core GEMM at its default only")
    ap.add_argument("--append", default=None)
    a = ap.parse_args()
    if a.join_sweep:
        a.sweep, a.gemv_sweep_only = True, True
    E, k, d, I = a.experts, 6, 4096, 2048
    bw = copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    dense, packed = {"w1": [], "w2": []}, {"w1": [], "w2": []}
    for c in range(COPIES):
        for n, shape in (("w1", (E, I, d)), ("w2", (E, d, I))):
            w = torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
            packed[n].append(pack_fp4_stacked(w))
            if c < 2:  # (bf16 peer: 2 copies of 128 experts are already 8 GB)
                dense[n].append(w)
            del w
    configs = [GEMV_CONFIG]
    if a.sweep:  # tiles and warps
        tiles = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w) for bn in (8, 16, 32) for bk in (256, 512, 1024, 2048)
                 for w in (4, 8)]
        if a.join_sweep:
            tiles = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=4, JOIN=True) for bn in (8, 16, 32) for bk in (256, 512)]
        configs += [dict(GEMV_CONFIG, **t) for t in tiles]
        configs = [c for i, c in enumerate(configs) if c not in configs[:i]]
    tc_configs = [GEMM_CONFIG_FP4]
    if a.sweep and not a.gemv_sweep_only:
        tc_configs += [dict(GEMM_CONFIG_FP4, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st)
                       for bn, bk, w in ((64, 128, 4), (128, 128, 4), (128, 128, 8), (256, 128, 8), (64, 256, 4),
                                         (128, 256, 8), (32, 512, 4), (64, 512, 8)) for st in (2, 3, 4)]
        tc_configs = [c for i, c in enumerate(tc_configs) if c not in tc_configs[:i]]
    rows = []
    for B in [] if a.gate_up_only else a.batch:
        ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(b))[:k] for b in range(B)]).cuda()
        r, _, be = align(ids, E)
        m_pad = r.shape[0]
        valid = r >= 0
        distinct = ids.unique().numel()
        nb = active_blocks(m_pad, 16, B * k)  # the engine's grids (every kernel below but the "all blocks" rows)
        x = torch.randn(B, d, device="cuda", generator=g, dtype=torch.bfloat16)
        h = torch.randn(m_pad, I, device="cuda", generator=g, dtype=torch.bfloat16)
        for name, key, gather, inp in (("w1 (d -> I)", "w1", True, x), ("w2 (I -> d)", "w2", False, h)):
            codes, scale = packed[key][0]
            ref = _grouped_gemm_torch(inp, r, codes, be, gather, m_pad, scale=scale)[valid].float()
            nbytes = distinct * I * d * (0.5 + 1 / 32)

            def gemv(c, blocks=nb):
                return lambda i: fp4_gemv(inp, r, packed[key][i][0], packed[key][i][1], be, gather, m_pad, 16, c,
                                          blocks=blocks)

            def tc(c, blocks=nb, fold=False):
                return lambda i: _grouped_gemm(inp, r, packed[key][i][0], be, gather, m_pad, c,
                                               scale=packed[key][i][1], blocks=blocks, fold=fold)

            def bf16(blocks):
                return lambda i: _grouped_gemm(inp, r, dense[key][i % 2], be, gather, m_pad, blocks=blocks)

            t_bf16 = graph_us(bf16(nb), 2)  # (2 copies: partly in L2 at batch 1, so this flatters bf16)
            t_bf16_all = graph_us(bf16(None), 2)
            def measure(make, cs):
                out = []
                for c in cs:
                    try:
                        got = make(c)(0)[valid].float()
                        out.append((graph_us(make(c), COPIES), c, ((got - ref).norm() / ref.norm()).item()))
                    except Exception as exc:  # a tile that does not compile: skip it
                        print("skip", c, type(exc).__name__, str(exc)[:80])
                return out

            results, tcs = measure(gemv, configs), measure(tc, tc_configs)
            t_tc = tcs[0][0]
            picks = [("gemv (default)", results[0]),
                     ("gemv (default), all blocks", measure(lambda c: gemv(c, None), configs[:1])[0])]
            if a.sweep:
                picks.append(("gemv, best of sweep", min(results, key=lambda t: t[0])))
            picks.append(("fp4 TC GEMM (default)", tcs[0]))
            if fold_scales(*(sc for _, sc in packed[key])):
                picks.append(("fp4 TC GEMM (default), one-product decode (FOLD)",
                              measure(lambda c: tc(c, fold=True), tc_configs[:1])[0]))
            picks.append(("fp4 TC GEMM (default), all blocks", measure(lambda c: tc(c, None), tc_configs[:1])[0]))
            if a.sweep:
                picks.append(("fp4 TC GEMM, best of sweep", min(tcs, key=lambda t: t[0])))
            for label, (t, c, err) in picks:
                rows.append([B, name, label, "/".join(str(v) for v in c.values()), round(t, 1),
                             f"{nbytes / (t * 1e-6) / bw * 100:.0f}%", f"{t_tc / t:.2f}x", f"{t_bf16 / t:.2f}x",
                             f"{err:.1e}"])
            for label, t in (("bf16 grouped GEMM (peer)", t_bf16), ("bf16 grouped GEMM, all blocks", t_bf16_all)):
                rows.append([B, name, label, "default", round(t, 1),
                             f"{distinct * I * d * 2 / (t * 1e-6) / bw * 100:.0f}%", "", f"{t_bf16 / t:.2f}x", ""])
    gu_rows = []
    gu_configs = [None]  # the engine's choice (gate_up_config)
    if a.sweep:
        gu_configs += [dict(GEMV_CONFIG_GATE_UP, BLOCK_N=bn, BLOCK_K=bk, num_warps=w)
                       for bn in (4, 8, 16) for bk in (256, 512, 1024, 2048) for w in (4, 8)]
        if a.join_sweep:
            gu_configs[1:] = [dict(GEMV_CONFIG_GATE_UP, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, JOIN=True)
                              for bn in (8, 16, 32) for bk in (256, 512)]
        gu_configs = [c for i, c in enumerate(gu_configs) if c not in gu_configs[:i]]
    for B in a.batch:
        ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(b))[:k] for b in range(B)]).cuda()
        wts = torch.rand(B, k, device="cuda", generator=g)
        r, _, be, rw = align(ids, E, 16, wts)
        m_pad = r.shape[0]
        nb = active_blocks(m_pad, 16, B * k)
        valid = r[:nb * 16] >= 0
        x = torch.randn(B, d, device="cuda", generator=g, dtype=torch.bfloat16)
        w13 = [(packed["w1"][i], packed["w1"][(i + 1) % COPIES]) for i in range(COPIES)]
        (c1, s1), (c3, s3) = w13[0]
        ref = gate_up_torch(x, r, c1, s1, c3, s3, be, m_pad, 16, 10.0, rw, nb)[valid].float()
        nbytes = 2 * ids.unique().numel() * I * d * (0.5 + 1 / 32)

        def fused(c):
            return lambda i: fp4_gemv_gate_up(x, r, *w13[i][0], *w13[i][1], be, m_pad, 16, 10.0, rw, c, nb)

        def separate(i):
            (p1, q1), (p3, q3) = w13[i]
            gg = fp4_gemv(x, r, p1, q1, be, True, m_pad, 16, blocks=nb)
            uu = fp4_gemv(x, r, p3, q3, be, True, m_pad, 16, blocks=nb)
            return swiglu_to(gg[:nb * 16], uu[:nb * 16], 10.0, rw[:nb * 16], x.dtype)

        t_sep = graph_us(separate, COPIES)
        err_sep = ((separate(0)[valid].float() - ref).norm() / ref.norm()).item()
        timed_cfgs = []
        for c in gu_configs:
            try:
                err = ((fused(c)(0)[valid].float() - ref).norm() / ref.norm()).item()
                timed_cfgs.append((graph_us(fused(c), COPIES), c, err))
            except Exception as exc:  # a tile that does not compile: skip it
                print("skip", c, type(exc).__name__, str(exc)[:80])
        picks = [("fused (default)", timed_cfgs[0])]
        if a.sweep:
            picks.append(("fused, best of sweep", min(timed_cfgs, key=lambda t: t[0])))
        if a.sweep and a.gate_up_only:
            picks += [("fused", t) for t in timed_cfgs[1:]]
        for label, (t, c, err) in picks + [("w1 GEMV + w3 GEMV + SwiGLU (3 launches)", (t_sep, GEMV_CONFIG, err_sep))]:
            gu_rows.append([B, label, "/".join(str(v) for v in (c or gate_up_config(nb, E)).values()), round(t, 1),
                            f"{nbytes / (t * 1e-6) / bw * 100:.0f}%", f"{t_sep / t:.2f}x", f"{err:.1e}"])
    heads = ["batch", "GEMM", "kernel", "config (GEMV: " + "/".join(GEMV_CONFIG) + "; TC: "
             + "/".join(GEMM_CONFIG_FP4) + ")", "GPU us", "of copy bw (FP4 bytes; bf16: its own)",
             "vs fp4 TC default", "vs bf16", "rel err vs twin"]
    if rows:
        report(f"Packed FP4 experts at decode sizes, GEMV vs tensor-core GEMM, {E} experts", table(heads, rows),
               a.append, notes=f"copy bandwidth {bw / 1e12:.2f} TB/s; bench/fp4_gemv_gpu.py")
    report(f"Packed FP4 experts' first half (w1, w3, SwiGLU), {E} experts",
           table(["batch", "kernel", "config (" + "/".join(GEMV_CONFIG_GATE_UP) + ")", "GPU us",
                  "of copy bw (w1 + w3 FP4 bytes)", "vs 3 launches", "rel err vs twin"], gu_rows),
           a.append, notes="bench/fp4_gemv_gpu.py")


if __name__ == "__main__":
    main()
