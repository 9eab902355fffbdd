"""A compressor's per-token rows in one kernel: [kv | gate + ape[pos % ratio]] in fp32, written side by side
in one buffer, so the cache path needs no concatenation (in torch: two conversions, a remainder, a gather,
an add and a concatenation). Where the backend allows it (decode-like steps, ``state_destination``) it also
stores the rows into the compressor-state ring, which saves the scatter. The plain-torch twin is the CPU branch
of ``Compressor.project``."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, on, pdl

BLOCK = 512

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter

    @triton.jit
    def _rows_kernel(KV, GATE, APE, POS, OUT, STATE, ROWS, stride_kv, stride_gate, C, ratio, BLOCK: tl.constexpr,
                     TO_STATE: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        t, cb = tl.program_id(0), tl.program_id(1)
        c = cb * BLOCK + tl.arange(0, BLOCK)
        m = c < C
        kv = tl.load(KV + t * stride_kv + c, mask=m, other=0.0).to(tl.float32)
        g = tl.load(GATE + t * stride_gate + c, mask=m, other=0.0).to(tl.float32)
        ape = tl.load(APE + (tl.load(POS + t) % ratio) * C + c, mask=m, other=0.0)
        tl.store(OUT + t * 2 * C + c, kv, mask=m)
        tl.store(OUT + t * 2 * C + C + c, g + ape, mask=m)
        if TO_STATE:  # the same row into the compressor-state ring, at row ROWS[t]
            row = STATE + tl.load(ROWS + t).to(tl.int64) * 2 * C
            tl.store(row + c, kv, mask=m)
            tl.store(row + C + c, g + ape, mask=m)


def usable(x: torch.Tensor) -> bool:
    return on(x)


def project_rows(kv: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor, positions: torch.Tensor,
                 ratio: int, state: torch.Tensor | None = None, state_rows: torch.Tensor | None = None) -> torch.Tensor:
    """kv, gate [N, C] (unit stride along C), ape [ratio, C], positions [N] -> [N, 2C] fp32; given the state
    ring ``state`` [R, 2C] fp32 (contiguous) and ``state_rows`` [N], row t is also stored at
    ``state[state_rows[t]]`` (rows that repeat, padding's null row, hold element by element one of their
    values; nothing reads them)."""
    N, C = kv.shape
    out = torch.empty(N, 2 * C, dtype=torch.float32, device=kv.device)
    to_state = state is not None
    if to_state and not (state.dtype == torch.float32 and state.is_contiguous() and state.shape[-1] == 2 * C
                         and state_rows.shape == (N,) and state_rows.device == kv.device):
        raise ValueError(f"state ring {tuple(state.shape)} {state.dtype} (contiguous: {state.is_contiguous()}) and "
                         f"rows {tuple(state_rows.shape)} do not take [{N}, {2 * C}] float32 rows")
    if N:
        _rows_kernel[(N, triton.cdiv(C, BLOCK))](
            kv, gate, ape.float().contiguous(), positions.contiguous(), out, state if to_state else out,
            state_rows.contiguous() if to_state else positions, kv.stride(0), gate.stride(0), C, ratio, BLOCK=BLOCK,
            TO_STATE=to_state, num_warps=4, **pdl.args())
    return out
