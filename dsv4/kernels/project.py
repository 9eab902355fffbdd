"""A compressor's per-token rows in one kernel: [kv | gate + ape[pos % ratio]] in fp32, written side by side
in one buffer, so the cache path needs no concatenation (in torch: two conversions, a remainder, a gather,
an add and a concatenation). The plain-torch twin is the CPU branch of ``Compressor.project``."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, on

BLOCK = 512

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rows_kernel(KV, GATE, APE, POS, OUT, stride_kv, stride_gate, C, ratio, BLOCK: tl.constexpr):
        t, cb = tl.program_id(0), tl.program_id(1)
        c = cb * BLOCK + tl.arange(0, BLOCK)
        m = c < C
        kv = tl.load(KV + t * stride_kv + c, mask=m, other=0.0).to(tl.float32)
        g = tl.load(GATE + t * stride_gate + c, mask=m, other=0.0).to(tl.float32)
        ape = tl.load(APE + (tl.load(POS + t) % ratio) * C + c, mask=m, other=0.0)
        tl.store(OUT + t * 2 * C + c, kv, mask=m)
        tl.store(OUT + t * 2 * C + C + c, g + ape, mask=m)


def usable(x: torch.Tensor) -> bool:
    return on(x)


def project_rows(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                 ratio: int) -> torch.Tensor:
    """kv, gate [N, C] (unit stride along C), ape [ratio, C], positions [N] -> [N, 2C] fp32."""
    N, C = kv.shape
    out = torch.empty(N, 2 * C, dtype=torch.float32, device=kv.device)
    if N:
        _rows_kernel[(N, triton.cdiv(C, BLOCK))](kv, gate, ape.float().contiguous(), positions.contiguous(), out,
                                                 kv.stride(0), gate.stride(0), C, ratio, BLOCK=BLOCK, num_warps=4)
    return out
