"""The one-row FP8 GEMV (``dsv4.kernels.fp8_linear._fp8_row_kernel``: the weight read as 32-bit words of 4 codes,
widened by cvt.rn.f16x2.e4m3x2) against the general GEMV it replaces at one row and bf16 cuBLAS, on Flash's
projections (bench/fp8_linear_gpu.py's SHAPES). For each: GPU us of the general GEMV (its default tile), of the
one-row kernel with ROW_CONFIG and with the best of a small sweep (BLOCK_N/BLOCK_K/prefetch/split), the share of
the copy bandwidth, and the error against the dequantised product in float64. Times as in fp8_linear_gpu.py
(``graph_us``: 24 launches in one CUDA graph over 6 weight copies, median of 5)."""

from __future__ import annotations

import argparse
import itertools

import torch
from common import graph_us, kernel_run, rel_err, report, table
from fp8_linear_gpu import COPIES, SHAPES, fp8_weights

from dsv4.kernels import fp8_linear as f8

SWEEP = [({"BLOCK_N": n, "BLOCK_K": k, "PREFETCH": p}, None)
         for n, k, p in itertools.product((8, 16, 32), (512, 1024), (False, True))]
SWEEP += [({"BLOCK_N": n, "BLOCK_K": 512, "PREFETCH": True}, 2) for n in (8, 16)]


def tile(c: dict, split) -> str:
    return f"{c['BLOCK_N']}/{c['BLOCK_K']}/{int(c['PREFETCH'])}" + (f" split {split}" if split else "")


def main():
    a, bw, g = kernel_run(argparse.ArgumentParser(description=__doc__))
    rows = []
    for name, G, N, K in SHAPES:
        q8 = fp8_weights(G, N, K, g)
        w64 = f8.dequantize(*q8[0], torch.float64)
        bf = [f8.dequantize(*q8[i], torch.bfloat16) for i in range(2)]
        x = torch.randn(1, G, K, device="cuda", generator=g, dtype=torch.bfloat16)
        ref = torch.einsum("mgk,gnk->mgn", x.double(), w64)

        def row(c, split):
            return lambda i: f8._launch(x, *q8[i], config=c, split=split, gemv="row")

        e_row = rel_err(f8._launch(x, *q8[0], gemv="row"), ref)
        assert e_row < 1e-2, (name, e_row)
        t_gemv = graph_us(lambda i: f8._launch(x, *q8[i], gemv=True), COPIES)
        t_row = graph_us(row(None, None), COPIES)
        for c, sp in SWEEP:  # every tile right before any is timed
            assert rel_err(row(c, sp)(0), ref) < 1e-2, (name, c, sp)
        best = min(((graph_us(row(c, sp), COPIES), c, sp) for c, sp in SWEEP), key=lambda b: b[0])
        if G == 1:
            t_bf = graph_us(lambda i: torch.nn.functional.linear(x[:, 0], bf[i % 2][0]), 2)
        else:
            t_bf = graph_us(lambda i: torch.einsum("mgk,gnk->mgn", x, bf[i % 2]), 2)
        nbytes = G * N * K * (1 + 4 / 128 ** 2)
        pct = lambda t: f"{100 * nbytes / (t * 1e-6) / bw:.0f}%"  # noqa: E731
        rows.append([name, f"{t_gemv:.1f}", pct(t_gemv), f"{t_row:.1f}", pct(t_row),
                     f"{best[0]:.1f} ({tile(best[1], best[2])})", pct(best[0]), f"{t_bf:.1f}", f"{e_row:.1e}"])
        print(rows[-1], flush=True)
    text = table(["projection", "general GEMV us", "of copy bw", "one-row kernel us", "of copy bw",
                  "one-row, best of sweep (BLOCK_N/BLOCK_K/prefetch)", "of copy bw", "bf16 cuBLAS us (2 copies)",
                  "rel err"], rows)
    report("The one-row FP8 GEMV against the general GEMV, Flash projections, one row", text, a.append,
           notes=f"Copy bandwidth measured in the same run: {bw / 1e12:.2f} TB/s (read + write). ROW_CONFIG"
                 f" {f8.ROW_CONFIG}; general GEMV {f8.GEMV_CONFIG} with BLOCK_N by gemv_block_n. Sweep: "
                 + ", ".join(tile(c, sp) for c, sp in SWEEP) + ".")


if __name__ == "__main__":
    main()
