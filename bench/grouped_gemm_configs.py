"""The routed experts' grouped GEMM at decode shapes, for several tile configurations: time (CUDA events around
20 back-to-back launches, median of 5 such samples), bytes of expert weights read, and the share of the measured copy bandwidth.
The default configurations (dsv4.kernels.moe.GEMM_CONFIG for w1/w3, GEMM_CONFIG_SORTED for w2) are marked. Flash dimensions (d 4096, moe_inter_dim
2048, 6 of 32 experts per token), bf16; ``--fp4``: the weights packed FP4 (decoded in the GEMM), their bytes
(codes and scales) counted as stored."""

from __future__ import annotations

import argparse
import itertools

import torch
from common import copy_bandwidth, report, table

from dsv4.checkpoint.quant import pack_fp4_stacked
from dsv4.kernels.moe import GEMM_CONFIG, GEMM_CONFIG_SORTED, _grouped_gemm, align


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--fp4", action="store_true", help="packed FP4 weights")
    ap.add_argument("--append", default=None, help="append the table to this markdown file")
    a = ap.parse_args()
    E, k, d, I = 32, 6, 4096, 2048
    bw = copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = torch.randn(E, I, d, device="cuda", generator=g, dtype=torch.bfloat16)
    w2 = torch.randn(E, d, I, device="cuda", generator=g, dtype=torch.bfloat16)
    scales = {}
    if a.fp4:
        (w1, scales["w1"]), (w2, scales["w2"]) = pack_fp4_stacked(w1), pack_fp4_stacked(w2)
    per_weight = (0.5 + 1 / 32) if a.fp4 else 2
    configs = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
               for bn, bk, nw, ns in itertools.product((16, 32, 64, 128), (64, 128), (4,), (3, 4))]
    rows = []
    for B in a.batch:
        ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(b))[:k] for b in range(B)]).cuda()
        r, _, be = align(ids, E)
        m_pad = r.shape[0]
        x = torch.randn(B, d, device="cuda", generator=g, dtype=torch.bfloat16)
        h = torch.randn(m_pad, I, device="cuda", generator=g, dtype=torch.bfloat16)
        distinct = ids.unique().numel()
        for name, fn_w, sc, gather, inp in (("w1 (d -> I)", w1, scales.get("w1"), True, x),
                                            ("w2 (I -> d)", w2, scales.get("w2"), False, h)):
            nbytes = distinct * I * d * per_weight  # w1 [E, I, d] and w2 [E, d, I] alike
            results = []
            for c in configs:
                try:
                    fn = lambda: _grouped_gemm(inp, r, fn_w, be, gather, m_pad, c, scale=sc)  # noqa: E731
                    fn()
                    torch.cuda.synchronize()
                    times = []
                    for _ in range(5):  # 20 back-to-back launches per sample: the host's launch cost is hidden
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        s.record()
                        for _ in range(20):
                            fn()
                        e.record()
                        e.synchronize()
                        times.append(s.elapsed_time(e) * 1e3 / 20)
                    results.append((sorted(times)[len(times) // 2], c))
                except Exception as exc:  # a config that does not compile (shared memory): skip it
                    print("skip", c, type(exc).__name__)
            results.sort(key=lambda t: t[0])
            chosen = GEMM_CONFIG if gather else GEMM_CONFIG_SORTED
            default = next(t for t, c in results if c == chosen)
            for t, c in results[:3]:
                rows.append([B, name, f"{c['BLOCK_N']}/{c['BLOCK_K']}/{c['num_warps']}/{c['num_stages']}",
                             round(t, 1), f"{nbytes / (t * 1e-6) / bw * 100:.0f}%",
                             "" if c != chosen else "default"])
            rows.append([B, name, "default " + "/".join(str(chosen[k_]) for k_ in
                                                         ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")),
                         round(default, 1), f"{nbytes / (default * 1e-6) / bw * 100:.0f}%", "default"])
    report("Grouped expert GEMM tile configurations at decode shapes (best three and the default)"
           + (", packed FP4 weights" if a.fp4 else ""),
           table(["batch", "GEMM", "BLOCK_N/BLOCK_K/warps/stages", "us", "of copy bandwidth", ""], rows),
           a.append, notes=f"Copy bandwidth {bw / 1e12:.2f} TB/s (read + write), the same measure decode_floor.py "
                           "divides by.")


if __name__ == "__main__":
    main()
