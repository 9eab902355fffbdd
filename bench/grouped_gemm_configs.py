"""The routed experts' grouped GEMM at decode shapes, for several tile configurations: time (CUDA events around
24 back-to-back launches cycling over 6 copies of the weights, so that no launch finds its experts in L2;
median of 5 such samples), bytes of expert weights read, and the share of the measured copy bandwidth. The
default configurations (dsv4.kernels.moe.GEMM_CONFIG for w1/w3, GEMM_CONFIG_SORTED for w2, GEMM_CONFIG_FP4 for
packed weights) are marked. Flash dimensions (d 4096, moe_inter_dim 2048, 6 of 32 experts per token), bf16
activations; ``--fp4``: the weights packed FP4 (decoded in the GEMM), their bytes (codes and scales) counted as
stored, and the bf16 weights' default timed in the same run for the ratio."""

from __future__ import annotations

import argparse
import itertools

import torch
from common import LAUNCHES, copy_bandwidth, median_us, report, table

from dsv4.checkpoint.quant import pack_fp4_stacked
from dsv4.kernels.moe import GEMM_CONFIG, GEMM_CONFIG_FP4, GEMM_CONFIG_SORTED, _grouped_gemm, align

COPIES = 6  # weight copies cycled through: 6 x 6 experts' w1 in FP4 is 160 MB, past the H200's 60 MB of L2


def cfg_name(c: dict) -> str:
    return "/".join(str(c[k]) for k in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages"))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--fp4", action="store_true", help="packed FP4 weights")
    ap.add_argument("--append", default=None, help="append the table to this markdown file")
    a = ap.parse_args()
    E, k, d, I = 32, 6, 4096, 2048
    bw = copy_bandwidth()
    g = torch.Generator(device="cuda").manual_seed(0)
    dense = {"w1": [], "w2": []}
    packed = {"w1": [], "w2": []}
    for _ in range(COPIES):
        for n, shape in (("w1", (E, I, d)), ("w2", (E, d, I))):
            w = torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)
            if a.fp4:
                packed[n].append(pack_fp4_stacked(w))
            dense[n].append(w)
    configs = [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=nw, num_stages=ns)
               for bn, bk, nw, ns in itertools.product((16, 32, 64, 128), (64, 128) + ((256,) if a.fp4 else ()),
                                                       (4,), (3, 4))]
    rows = []
    for B in a.batch:
        ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(b))[:k] for b in range(B)]).cuda()
        r, _, be = align(ids, E)
        m_pad = r.shape[0]
        x = torch.randn(B, d, device="cuda", generator=g, dtype=torch.bfloat16)
        h = torch.randn(m_pad, I, device="cuda", generator=g, dtype=torch.bfloat16)
        distinct = ids.unique().numel()
        for name, key, gather, inp in (("w1 (d -> I)", "w1", True, x), ("w2 (I -> d)", "w2", False, h)):
            def run(c, fp4):
                if fp4:
                    return lambda i: _grouped_gemm(inp, r, packed[key][i][0], be, gather, m_pad, c,
                                                   scale=packed[key][i][1])
                return lambda i: _grouped_gemm(inp, r, dense[key][i], be, gather, m_pad, c)

            per_weight = (0.5 + 1 / 32) if a.fp4 else 2
            nbytes = distinct * I * d * per_weight  # w1 [E, I, d] and w2 [E, d, I] alike
            results = []
            for c in configs:
                try:
                    results.append((median_us(run(c, a.fp4), COPIES), c))
                except Exception as exc:  # a config that does not compile (shared memory): skip it
                    print("skip", c, type(exc).__name__)
            results.sort(key=lambda t: t[0])
            bf16_default = GEMM_CONFIG if gather else GEMM_CONFIG_SORTED
            chosen = GEMM_CONFIG_FP4 if a.fp4 else bf16_default
            default = next((t for t, c in results if c == chosen), None)
            if default is None:
                default = median_us(run(chosen, a.fp4), COPIES)
            ref = median_us(run(bf16_default, False), COPIES) if a.fp4 else default
            for t, c in results[:3]:
                rows.append([B, name, cfg_name(c), round(t, 1), f"{nbytes / (t * 1e-6) / bw * 100:.0f}%",
                             f"{ref / t:.2f}x", "default" if c == chosen else ""])
            rows.append([B, name, "default " + cfg_name(chosen), round(default, 1),
                         f"{nbytes / (default * 1e-6) / bw * 100:.0f}%", f"{ref / default:.2f}x", "default"])
            if a.fp4:
                bf16_bytes = distinct * I * d * 2
                rows.append([B, name, "bf16 weights, default " + cfg_name(bf16_default), round(ref, 1),
                             f"{bf16_bytes / (ref * 1e-6) / bw * 100:.0f}%", "1.00x", "peer"])
    report("Grouped expert GEMM tile configurations at decode shapes (best three and the default)"
           + (", packed FP4 weights" if a.fp4 else ""),
           table(["batch", "GEMM", "BLOCK_N/BLOCK_K/warps/stages", "us", "of copy bandwidth",
                  "speed-up over the bf16 default", ""], rows),
           a.append, notes=f"Copy bandwidth {bw / 1e12:.2f} TB/s (read + write), the same measure decode_floor.py "
                           f"divides by. Each time: {LAUNCHES} launches cycling over {COPIES} copies of the weights "
                           "(none in L2), median of 5.")


if __name__ == "__main__":
    main()
