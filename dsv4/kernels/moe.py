"""Routed experts with tokens grouped per expert, without host synchronisation (CUDA-graph safe).

The (token, choice) pairs are sorted by expert on the device and laid out in segments padded to the GEMM's
row block, so every row block belongs to one expert; a Triton grouped GEMM then multiplies each block by
its expert's weight. Shapes are static for a given number of tokens (the padded length is bounded by
N*k + E*(BLOCK_M-1)), so the whole thing can be captured in a CUDA graph. The plain-torch twin is
``dsv4.model.moe.Experts.forward`` (a host-side loop over experts).

    pairs (token t, choice j) -> expert ids[t, j]
    sorted by expert:   [e0 e0 e0 | e1 | e3 e3 | ...]          (argsort, stable)
    padded segments:    [e0 e0 e0 - | e1 - - - | e3 e3 - - | ...]   each a multiple of BLOCK_M rows
    block b -> expert of the segment holding row b*BLOCK_M (or -1 past the end: the block exits)
"""

from __future__ import annotations

import torch

from ..model.ops import swiglu
from . import HAVE_TRITON

BLOCK_M = 16


def align(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M):
    """Device-side layout of the pairs. ids: [N, k] -> (rows [M_pad] token index or -1, pair_pos [N*k]
    row of each pair, block_expert [M_pad/block_m] expert of each row block or -1)."""
    N, k = ids.shape
    flat = ids.flatten()
    P = flat.numel()
    m_pad = P + num_experts * (block_m - 1)
    m_pad = (m_pad + block_m - 1) // block_m * block_m
    order = torch.argsort(flat, stable=True)
    e_sorted = flat[order]
    counts = torch.zeros(num_experts, dtype=torch.long, device=ids.device)  # bincount would sync on CUDA
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    seg_end = torch.cumsum(padded, 0)
    seg_start = seg_end - padded
    first = torch.cumsum(counts, 0) - counts  # index of each expert's first pair in sorted order
    pos = seg_start[e_sorted] + torch.arange(P, device=ids.device) - first[e_sorted]  # [P] sorted -> row
    rows = torch.full((m_pad,), -1, dtype=torch.long, device=ids.device)
    rows[pos] = order // k
    pair_pos = torch.empty(P, dtype=torch.long, device=ids.device)
    pair_pos[order] = pos
    block_start = torch.arange(0, m_pad, block_m, device=ids.device)
    block_expert = torch.searchsorted(seg_end, block_start, right=True)
    block_expert = torch.where(block_start < seg_end[-1], block_expert, -1)
    return rows, pair_pos, block_expert


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _grouped_gemm_kernel(A, stride_am, ROWS, W, stride_we, stride_wn, stride_wk, C, stride_cm,
                             BLOCK_EXPERT, N, K, GATHER: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        """C[rows of block] = A[rows] @ W[e].T for the expert e of this row block."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + pid_m)
        if e < 0:
            return
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        if GATHER:  # rows of A are tokens, picked through the sorted layout
            src = tl.load(ROWS + offs_m)
            row_ok = src >= 0
            src = tl.where(row_ok, src, 0)
        else:
            src = offs_m
            row_ok = tl.load(ROWS + offs_m) >= 0
        a_ptrs = A + src.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
        w_ptrs = W + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + offs_k) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & (offs_n[None, :] < N), other=0.0)
            if IEEE:  # fp32 models: exact fp32 products, not TF32
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        c_ptrs = C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=offs_n[None, :] < N)

    def _grouped_gemm(a, rows, w, block_expert, gather: bool, m_pad: int):
        """out [m_pad, n] (sorted layout) = a[rows] @ w[e].T per row block."""
        E, n, kdim = w.shape
        out = torch.empty(m_pad, n, dtype=a.dtype, device=a.device)
        bn, bk = 64, 64
        grid = (m_pad // BLOCK_M, triton.cdiv(n, bn))
        _grouped_gemm_kernel[grid](a, a.stride(0), rows, w, w.stride(0), w.stride(1), w.stride(2), out,
                                   out.stride(0), block_expert, n, kdim, GATHER=gather, BLOCK_M=BLOCK_M,
                                   BLOCK_N=bn, BLOCK_K=bk, IEEE=a.dtype == torch.float32, num_warps=4,
                                   num_stages=3)
        return out


def _grouped_gemm_torch(a, rows, w, block_expert, gather: bool, m_pad: int):
    """Plain-torch twin of the Triton grouped GEMM (same sorted layout), used off the GPU."""
    out = torch.zeros(m_pad, w.shape[1], dtype=a.dtype, device=a.device)
    for b, e in enumerate(block_expert.tolist()):
        if e < 0:
            continue
        sl = slice(b * BLOCK_M, (b + 1) * BLOCK_M)
        r = rows[sl]
        src = a[r.clamp(min=0)] if gather else a[sl]
        out[sl] = torch.where((r >= 0)[:, None], src @ w[e].t(), 0).to(a.dtype)
    return out


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                    w2: torch.Tensor, w3: torch.Tensor, limit: float,
                    keep: torch.Tensor | None = None) -> torch.Tensor:
    """Routed-expert output [N, d] fp32 (same contract as Experts.forward), no host sync on CUDA.

    ``keep`` [N, k] bool (expert parallelism): pairs with ``keep`` False belong to experts of other ranks.
    They are laid out as one extra expert E whose row blocks are skipped (no GEMM work) and contribute 0;
    their ``ids`` may be anything (clamped into range). Shapes stay static: still graph-safe."""
    N, k = ids.shape
    E = w1.shape[0]
    if keep is None:
        rows, pair_pos, block_expert = align(ids, E)
    else:
        rows, pair_pos, block_expert = align(torch.where(keep, ids.clamp(0, E - 1), E), E + 1)
        block_expert = torch.where(block_expert == E, -1, block_expert)  # the other ranks' pairs: skipped
    m_pad = rows.shape[0]
    x = x.contiguous()
    gemm = _grouped_gemm if (HAVE_TRITON and x.is_cuda) else _grouped_gemm_torch
    g = gemm(x, rows, w1, block_expert, True, m_pad)  # [m_pad, I]
    u = gemm(x, rows, w3, block_expert, True, m_pad)
    w_sorted = torch.zeros(m_pad, dtype=torch.float32, device=x.device)
    w_sorted[pair_pos] = weights.flatten().float()
    h = (swiglu(g, u, limit) * w_sorted[:, None]).to(x.dtype)  # routing weight before w2, as DeepSeek
    y = gemm(h, rows, w2, block_expert, False, m_pad)  # [m_pad, d]
    y = y[pair_pos]
    if keep is not None:  # skipped blocks were never written (torch.empty): select, never multiply
        y = torch.where(keep.reshape(-1, 1), y, 0)
    return y.view(N, k, -1).float().sum(dim=1)
