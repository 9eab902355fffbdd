"""FP8 linears (weight-only, block-128 scales: dsv4.kernels.fp8_linear) against bf16 cuBLAS at decode shapes.

Flash's projections (d 4096, 64 heads of 512, q_lora 1024, 8 output groups of o_lora 1024, shared expert 2048)
as the engine runs them on CUDA (the input projections and the shared expert's w1/w3 fused). For each, at each
row count: the kernel's time with its default tile and with the best of a small sweep, bf16 F.linear (einsum for
the grouped wo_a) on the same shapes, the bytes each reads and the share of the measured copy bandwidth. Times:
GPU time of 24 launches captured in one CUDA graph cycling over 6 weight copies (nothing in L2; the host's launch
cost left out, as in the engine's graphs), CUDA events around the replay, median of 5. The
outputs are checked against the dequantised weight's product first."""

from __future__ import annotations

import argparse
import itertools

import torch
from common import LAUNCHES, graph_us, kernel_run, rel_err, report, table

from dsv4.checkpoint.quant import e8m0_to_float, quant_fp8_block
from dsv4.kernels import fp8_linear as f8

COPIES = 6
SHAPES = [  # name, groups, out, in
    ("wq_a+wkv", 1, 1024 + 512, 4096),
    ("wq_b", 1, 64 * 512, 1024),
    ("wo_a (8 groups)", 8, 1024, 4096),
    ("wo_b", 1, 4096, 8 * 1024),
    ("shared w1+w3", 1, 2 * 2048, 4096),
    ("shared w2", 1, 4096, 2048),
    ("indexer wq_b", 1, 64 * 128, 1024),
]
SWEEP = [{"BLOCK_N": n, "num_warps": w, "num_stages": s}
         for n, w, s in itertools.product((64, 128, 256), (4, 8), (3, 4))]
GEMV_SWEEP = [{"BLOCK_N": n, "BLOCK_K": k, "num_warps": 4}
              for n, k in itertools.product((8, 16, 32, 64), (128, 256, 512))]
GEMV_SWEEP += [{"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 8}, {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 8}]


def fp8_weights(G: int, N: int, K: int, g: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """COPIES random [G, N, K] weights rounded to FP8: (e4m3 values, float32 block scales) each."""
    out = []
    for _ in range(COPIES):
        q, s = quant_fp8_block(torch.randn(G * N, K, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02)
        out.append((q.view(G, N, K), e8m0_to_float(s)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 32])
    ap.add_argument("--gemv-splits", type=int, nargs="*", default=[],
                    help="also the GEMV's best tile with each of these split-K factors (partials summed after)")
    a, bw, g = kernel_run(ap)
    rows = []
    for name, G, N, K in SHAPES:
        q8 = fp8_weights(G, N, K, g)
        bf = [f8.dequantize(q, s, torch.bfloat16) for q, s in q8]
        for M in a.rows:
            x = torch.randn(M, G, K, device="cuda", generator=g, dtype=torch.bfloat16)
            ref = torch.einsum("mgk,gnk->mgn", x.double(), bf[0].double())
            out = f8._launch(x, *q8[0])
            err = rel_err(out, ref)
            assert err < 1e-2, (name, M, err)

            def kern(cfg, gemv=False, split=None):
                return lambda i: f8._launch(x, *q8[i], config=cfg, gemv=gemv, split=split)

            if G == 1:
                x2 = x[:, 0]
                cublas = graph_us(lambda i: torch.nn.functional.linear(x2, bf[i][0]), COPIES)
            else:
                cublas = graph_us(lambda i: torch.einsum("mgk,gnk->mgn", x, bf[i]), COPIES)
            default = graph_us(kern(None, None), COPIES)  # the path the engine takes
            best, best_cfg = min((graph_us(kern(c), COPIES), i) for i, c in enumerate(SWEEP))
            c = SWEEP[best_cfg]
            gemv = "-"
            if f8.gemv_fits(M, G, N):
                err_g = rel_err(f8._launch(x, *q8[0], gemv=True), ref)
                assert err_g < 1e-2, (name, M, "gemv", err_g)
                tg, ig = min((graph_us(kern(cg, True), COPIES), i) for i, cg in enumerate(GEMV_SWEEP))
                cg = GEMV_SWEEP[ig]
                tile = "/".join(str(cg[key]) for key in ("BLOCK_N", "BLOCK_K", "num_warps"))
                gemv = f"{graph_us(kern(None, True), COPIES):.1f} / {tg:.1f} ({tile})"
                for S in a.gemv_splits:  # split-K: more programs, and the partials' sum after
                    ts, js = min((graph_us(kern(cg, True, S), COPIES), i) for i, cg in enumerate(GEMV_SWEEP))
                    cs = GEMV_SWEEP[js]
                    gemv += f"; split {S}: {ts:.1f} ({cs['BLOCK_N']}/{cs['BLOCK_K']}/{cs['num_warps']})"
            fp8_bytes, bf16_bytes = G * N * K * (1 + 4 / 128 ** 2), G * N * K * 2
            rows.append([name, M, f"{default:.1f}", f"{best:.1f} ({c['BLOCK_N']}/{c['num_warps']}/{c['num_stages']})",
                         gemv, f"{cublas:.1f}", f"{cublas / default:.2f}x",
                         f"{100 * fp8_bytes / (default * 1e-6) / bw:.0f}%",
                         f"{100 * bf16_bytes / (cublas * 1e-6) / bw:.0f}%", f"{err:.1e}"])
            print(rows[-1], flush=True)
    text = table(["projection", "rows", "fp8 us (the engine's path)",
                  "tensor-core kernel, best of sweep us (BLOCK_N/warps/stages)",
                  "GEMV us: default / best of sweep (BLOCK_N/BLOCK_K/warps)", "bf16 cuBLAS us",
                  "speed-up", "fp8 % of copy bw", "bf16 % of copy bw", "rel err"], rows)
    report("FP8 linears (weight-only kernel) vs bf16 cuBLAS, Flash projections", text, a.append,
           notes=f"Copy bandwidth measured in the same run: {bw / 1e12:.2f} TB/s (read + write). Default tiles:"
                 f" {f8.CONFIG}, GEMV (up to {f8.GEMV_MAX_ROWS} rows) {f8.GEMV_CONFIG}, split-K aiming at"
                 f" {f8.TARGET_PROGRAMS} programs. Each time: {LAUNCHES} launches in one CUDA graph cycling over"
                 f" {COPIES} weight copies, CUDA events, median of 5. Bytes: the weights as stored"
                 " (e4m3 plus float32 scales; bf16).")


if __name__ == "__main__":
    main()
