"""Compressor window pooling in one kernel, reading the window's rows where they lie: a combined index
below the state's row count reads the compressor-state ring, one at or above it reads this step's rows
(plan.py's combined index space). Per channel, a softmax over the window's valid slots weights the kv
values; for ratio 4 (coff = 2) the first ``ratio`` slots take their rows' A-halves and the last ``ratio``
their B-halves. The plain-torch twin is ``gather_combined`` + ``Compressor.pool``'s halves +
``ops.pool_windows`` (what ``CachedBackend.write_compressed`` runs off the GPU)."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, on, pdl

BLOCK_C = 64

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter

    @triton.jit
    def _pool_kernel(STATE, STEP, IDX, VALID, OUT, state_rows, stride_state, stride_step, ratio, D,
                     S: tl.constexpr, SP: tl.constexpr, COFF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        m, cb = tl.program_id(0), tl.program_id(1)
        s = tl.arange(0, SP)
        ms = s < S
        idx = tl.load(IDX + m * S + s, mask=ms, other=0)
        ok = (tl.load(VALID + m * S + s, mask=ms, other=0) != 0) & ms
        c = cb * BLOCK + tl.arange(0, BLOCK)
        mc = c < D
        col = (s >= ratio).to(tl.int64) * D if COFF == 2 else s.to(tl.int64) * 0  # A-half, then B-half
        in_state = idx < state_rows
        off_state = tl.where(in_state, idx, 0) * stride_state + col
        off_step = tl.where(in_state, 0, idx - state_rows) * stride_step + col
        m_state = (ok & in_state)[:, None] & mc[None, :]
        m_step = (ok & (idx >= state_rows))[:, None] & mc[None, :]
        kv = (tl.load(STATE + off_state[:, None] + c[None, :], mask=m_state, other=0.0)
              + tl.load(STEP + off_step[:, None] + c[None, :], mask=m_step, other=0.0))
        sc = (tl.load(STATE + off_state[:, None] + COFF * D + c[None, :], mask=m_state, other=0.0)
              + tl.load(STEP + off_step[:, None] + COFF * D + c[None, :], mask=m_step, other=0.0))
        sc = tl.where(ok[:, None], sc, float("-inf"))
        mx = tl.max(sc, axis=0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)  # a window with no valid slot pools to zeros
        e = tl.exp(sc - mx[None, :])
        den = tl.sum(e, axis=0)
        out = tl.sum(e * kv, axis=0) / tl.where(den > 0, den, 1.0)
        tl.store(OUT + m * D + c, out, mask=mc)


def pool_rows(state: torch.Tensor, step_rows: torch.Tensor, index: torch.Tensor, valid: torch.Tensor,
              ratio: int, coff: int, D: int) -> torch.Tensor:
    """state [R, 2*coff*D] and step_rows [N, 2*coff*D] fp32 (kv halves, then score halves); index/valid
    [M, coff*ratio] combined rows -> pooled entries [M, D] fp32 (before the compressor's norm and RoPE)."""
    M, S = index.shape
    out = torch.empty(M, D, dtype=torch.float32, device=state.device)
    if M:
        _pool_kernel[(M, triton.cdiv(D, BLOCK_C))](
            state, step_rows.contiguous(), index.contiguous(), valid.contiguous(), out, state.shape[0],
            state.stride(0), step_rows.stride(0), ratio, D, S=S, SP=triton.next_power_of_2(S), COFF=coff,
            BLOCK=BLOCK_C, num_warps=4, **pdl.args())
    return out


def usable(state: torch.Tensor) -> bool:
    return on(state) and state.dtype == torch.float32 and state.stride(-1) == 1
