"""The one-row bf16 GEMV (``dsv4.kernels.bf16_gemv``) against cuBLAS (``F.linear``) on the bf16 products of a
Flash decode step at one request: the fused compressor and indexer projections of a ratio-4 layer and the
compressors of a ratio-128 layer (``model.fused``), and the head. GPU us per product (``graph_us``: 24 launches in one CUDA graph over several weight copies, so
the weight comes from memory, median of 5), the share of the copy bandwidth, BLOCK_N 4 / 8 / 16, and the error
of both against the product in float64."""

from __future__ import annotations

import argparse

import torch
from common import graph_us, kernel_run, rel_err, report, table

from dsv4.kernels import bf16_gemv

SHAPES = [  # name, out, in
    ("ratio-4 layer: compressor kv+gate, indexer kv+gate, weights_proj", 2 * 1024 + 2 * 256 + 64, 4096),
    ("ratio-128 layer: compressor kv+gate", 2 * 512, 4096),
    ("head", 129280, 4096),
]


def main():
    a, bw, g = kernel_run(argparse.ArgumentParser(description=__doc__))
    rows = []
    for name, N, K in SHAPES:
        copies = max(2, min(8, int(200e6 // (N * K * 2))))
        ws = [torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, K, device="cuda", generator=g, dtype=torch.bfloat16)
        ref = x.double() @ ws[0].double().t()

        e_k, e_c = rel_err(bf16_gemv.launch(x, ws[0]), ref), rel_err(torch.nn.functional.linear(x, ws[0]), ref)
        assert e_k < 1e-2, (name, e_k)
        t_c = graph_us(lambda i: torch.nn.functional.linear(x, ws[i]), copies)
        t_k = {bn: graph_us(lambda i, bn=bn: bf16_gemv.launch(x, ws[i], bn), copies) for bn in (4, 8, 16)}
        pct = lambda t: f"{100 * N * K * 2 / (t * 1e-6) / bw:.0f}%"  # noqa: E731
        d = bf16_gemv.block_n(N)
        rows.append([name, f"{N} x {K}", f"{t_c:.1f} ({pct(t_c)})", f"{t_k[d]:.1f} ({pct(t_k[d])}, BLOCK_N {d})",
                     " / ".join(f"{t_k[bn]:.1f}" for bn in (4, 8, 16)), f"{e_c:.1e} / {e_k:.1e}"])
        print(rows[-1], flush=True)
    text = table(["product", "shape", "cuBLAS us (of copy bw)", "one-row kernel us (of copy bw)",
                  "BLOCK_N 4 / 8 / 16 us", "rel err cuBLAS / kernel"], rows)
    report("The one-row bf16 GEMV against cuBLAS, Flash's bf16 products at one row", text, a.append,
           notes=f"Copy bandwidth measured in the same run: {bw / 1e12:.2f} TB/s (read + write).")


if __name__ == "__main__":
    main()
