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

Around the GEMMs: for small batches one Triton program computes that layout (``_align_kernel``, twin
``align_torch``), SwiGLU with the routing weight is one kernel (with packed FP4 weights at decode sizes, one
kernel with w1 and w3: ``fp4_gemv.fp4_gemv_gate_up``), and one kernel sums each token's rows of the last GEMM
back, adds the shared expert's output and rounds (``_combine_kernel``, twin: the gather and sum at the end of
``grouped_experts``).
"""

from __future__ import annotations

import functools

import torch

from .fp4 import unpack_fp4
from . import fp4_gemv as gemv_kernel
from . import HAVE_TRITON, on, pdl
from .swiglu import swiglu, swiglu_to

BLOCK_M = 16
# Rows per block for big steps (prefill chunks): once the pairs average 64 rows per expert, every row block
# reads its expert's weight tile once per 64 rows instead of 16 (a quarter of the weight traffic, the tensor
# cores' larger tiles). Smaller steps keep 16 rows: padding each expert's rows to 64 would be work for nothing.
PREFILL_BLOCK_M = 64
# tiles for 64-row blocks (bf16; fp32 and packed FP4 weights keep their own)
GEMM_CONFIG_PREFILL = {"BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
# Rows per block once the pairs average 4 x 128 rows per expert (8k-token chunks of Flash: 1536), 16-bit
# activations and unpacked weights only, with tiles of 128 x 256 (bench/prefill_moe_gpu.py, H200, 8192 tokens:
# w1 1.40 ms against 1.92 with blocks of 64, w2 1.67 against 2.13; cuBLAS's batched GEMM over equal rows per
# expert 1.05 / 1.08). Below 4 x 128 the padding of each expert's rows to 128 costs more than it saves.
LARGE_BLOCK_M = 128
GEMM_CONFIG_LARGE = {"BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4}
# tile choices measured by bench/grouped_gemm_configs.py on the H200 at batch 1 and 32 (BENCHMARKS.md): the
# gathering GEMMs (w1, w3) and the sorted-row GEMM (w2) differ
GEMM_CONFIG = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
GEMM_CONFIG_SORTED = {"BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
COMBINE_BLOCK = 1024
GEMM_CONFIG_FP32 = {"BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}  # fp32 tiles: half the shared memory
# packed FP4 weights (any activation dtype): BLOCK_K a power of two from 128 (BLOCK_K / 8 code words per output)
GEMM_CONFIG_FP4 = {"BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}


# At prefill sizes with 16-bit activations and unpacked weights, the expert GEMMs are torch._grouped_mm
# (CUTLASS's grouped GEMM on sm90) over the rows gathered once into the sorted layout, laid out in segments of
# BLOCK_M (little padding: the library takes any segment boundaries). H100, flash-L4-E32 (BENCHMARKS.md, 29th
# session): TTFT 10.4 against 11.2 ms at 1k tokens, 63.6 against 66.3 at 8k with the Triton kernel's row blocks
# (False: the Triton kernel, for the ratio).
GROUPED_MM = True


def use_grouped_mm(x: torch.Tensor, num_pairs: int, num_experts: int, invariant: bool, packed: bool) -> bool:
    """Whether ``grouped_experts`` takes torch._grouped_mm: GROUPED_MM on, the kernels on x's device, 16-bit x,
    unpacked weights, no batch invariance, and a step big enough for the prefill row blocks (``block_m_for``)."""
    return (GROUPED_MM and on(x) and x.element_size() == 2 and not packed and not invariant
            and block_m_for(num_pairs, num_experts) > BLOCK_M)


def segment_ends(block_expert: torch.Tensor, num_experts: int, block_m: int, blocks: int) -> torch.Tensor:
    """[E] int32, for torch._grouped_mm's ``offs``: the row after expert e's segment of the sorted layout, from
    the block table on the device (no host sync): expert e's segment is its blocks, the experts in order. Rows
    of the trailing blocks of no expert (-1) are outside every segment."""
    be = block_expert[:blocks]
    per = torch.zeros(num_experts, dtype=torch.int32, device=be.device)
    per.scatter_add_(0, be.clamp(min=0), (be >= 0).to(torch.int32))
    return torch.cumsum(per, 0, dtype=torch.int32) * block_m


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[rows of a, n]: each segment of ``a`` (rows already in the sorted layout, ``segment_ends``) times w[e].T
    for its expert e, as one torch._grouped_mm; rows past the last segment are left as the library leaves
    them (never read)."""
    return torch._grouped_mm(a, w.transpose(1, 2), offs=offs)


def block_m_for(num_pairs: int, num_experts: int, invariant: bool = False, large: bool = False) -> int:
    """Rows per block of a grouped GEMM over ``num_pairs`` (token, choice) pairs: PREFILL_BLOCK_M once they
    average that many per expert, LARGE_BLOCK_M once they average 4 x that many and ``large`` (16-bit
    activations, unpacked weights), else BLOCK_M (always under batch invariance: a row's sums then do not
    depend on the step's size)."""
    if invariant:
        return BLOCK_M
    if large and num_pairs >= 4 * LARGE_BLOCK_M * num_experts:
        return LARGE_BLOCK_M
    return PREFILL_BLOCK_M if num_pairs >= PREFILL_BLOCK_M * num_experts else BLOCK_M


def align(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, weights: torch.Tensor | None = None):
    """Device-side layout of the pairs. ids: [N, k] -> (rows [M_pad] token index or -1, pair_pos [N*k]
    row of each pair, block_expert [M_pad/block_m] expert of each row block or -1), and with ``weights``
    [N, k] (the routing weights) a fourth table, row_weight [M_pad] float32: each pair's weight at its row, 0
    on padding rows (what the SwiGLU multiplies by; one launch less than a scatter into zeros).

    Expert e's pairs fill rows seg_start[e] .. (padded to a multiple of block_m), in pair order. On CUDA a
    small batch takes one Triton program (``_align_kernel``); ``align_torch`` is its twin."""
    P = ids.numel()
    if on(ids) and P and _pow2(P) * _pow2(num_experts) <= ALIGN_KERNEL_MAX:
        return _align(ids, num_experts, block_m, weights)
    return align_torch(ids, num_experts, block_m, weights)


ALIGN_KERNEL_MAX = 1 << 15  # pairs x experts (powers of two) one align program holds in registers


def active_blocks(m_pad: int, block_m: int, pairs: int) -> int:
    """How many row blocks of the layout can hold pairs: a prefix (the segments start at row 0 and follow each
    other; blocks past the last are -1), and each such block holds at least one of the ``pairs``. The kernels'
    grids and the SwiGLU stop there: at a decode step of 128 experts all but a few of the m_pad / block_m blocks
    are padding (one token's 6 pairs: 6 of 121), and their programs only load -1 and exit."""
    return min(m_pad // block_m, pairs)


def _pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _m_pad(P: int, num_experts: int, block_m: int) -> int:
    m_pad = P + num_experts * (block_m - 1)
    return (m_pad + block_m - 1) // block_m * block_m


def align_torch(ids: torch.Tensor, num_experts: int, block_m: int = BLOCK_M, weights: torch.Tensor | None = None):
    N, k = ids.shape
    flat = ids.flatten()
    P = flat.numel()
    m_pad = _m_pad(P, num_experts, block_m)
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
    if weights is None:
        return rows, pair_pos, block_expert
    row_weight = torch.zeros(m_pad, dtype=torch.float32, device=ids.device)
    row_weight[pos] = weights.flatten()[order].float()
    return rows, pair_pos, block_expert, row_weight


def _align(ids: torch.Tensor, num_experts: int, block_m: int, weights: torch.Tensor | None = None):
    N, k = ids.shape
    P = N * k
    m_pad = _m_pad(P, num_experts, block_m)
    rows = torch.empty(m_pad, dtype=torch.long, device=ids.device)
    pair_pos = torch.empty(P, dtype=torch.long, device=ids.device)
    block_expert = torch.empty(m_pad // block_m, dtype=torch.long, device=ids.device)
    has_w = weights is not None
    row_weight = torch.empty(m_pad if has_w else 0, dtype=torch.float32, device=ids.device)
    _align_kernel[(1,)](ids.contiguous(), rows, pair_pos, block_expert, weights.contiguous() if has_w else row_weight,
                        row_weight, P, k, num_experts, m_pad, PP=_pow2(P), EP=_pow2(num_experts), BM=block_m,
                        MB=_pow2(m_pad // block_m), PB=min(_pow2(m_pad // block_m), _pow2(P)), HAS_W=has_w,
                        num_warps=8 if _pow2(P) * _pow2(num_experts) > 8192 else 4, **pdl.args())
    return (rows, pair_pos, block_expert, row_weight) if has_w else (rows, pair_pos, block_expert)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .fp4_gemv import as_words, e2m1_word_bf16, split8, use_asm
    from .pdl import enter

    @triton.jit
    def _combine_kernel(Y, PAIR_POS, KEEP, ADD, OUT, d, stride_y, K: tl.constexpr, HAS_KEEP: tl.constexpr,
                        HAS_ADD: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """OUT[t] = sum over j < K of Y[PAIR_POS[t*K + j]] (fp32, j in order), pairs with KEEP False left out,
        plus ADD[t] (HAS_ADD), rounded once to OUT's dtype."""
        enter(PDL)
        t, cb = tl.program_id(0), tl.program_id(1)
        c = cb * BLOCK + tl.arange(0, BLOCK)
        m = c < d
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(K):
            row = tl.load(PAIR_POS + t * K + j)
            ok = m
            if HAS_KEEP:
                ok = ok & (tl.load(KEEP + t * K + j) != 0)
            acc += tl.load(Y + row * stride_y + c, mask=ok, other=0.0).to(tl.float32)
        if HAS_ADD:
            acc += tl.load(ADD + t * d + c, mask=m, other=0.0).to(tl.float32)
        tl.store(OUT + t * d + c, acc.to(OUT.dtype.element_ty), mask=m)

    @triton.jit(do_not_specialize=["P", "m_pad"])
    def _align_kernel(IDS, ROWS, PAIR_POS, BLOCK_EXPERT, W, ROW_W, P, k, E, m_pad, PP: tl.constexpr,
                      EP: tl.constexpr, BM: tl.constexpr, MB: tl.constexpr, PB: tl.constexpr, HAS_W: tl.constexpr,
                      PDL: tl.constexpr):
        """One program: counts per expert, padded segments, each pair's rank among its expert's pairs (pair
        order), then the tables of ``align`` (HAS_W: the pairs' weights W at their rows of ROW_W too)."""
        enter(PDL)
        p = tl.arange(0, PP)
        mp = p < P
        ex = tl.arange(0, EP)
        e = tl.load(IDS + p, mask=mp, other=EP)  # padding pairs match no expert
        onehot = (e[:, None] == ex[None, :]).to(tl.int32)  # [PP, EP]
        counts = tl.sum(onehot, axis=0)
        padded = (counts + BM - 1) // BM * BM
        seg_end = tl.cumsum(padded, axis=0)
        seg_start = seg_end - padded
        rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # earlier pairs of the same expert
        pos = tl.sum(onehot * seg_start[None, :], axis=1) + rank
        r = tl.arange(0, MB * BM)  # every row and every block starts empty
        tl.store(ROWS + r, tl.full([MB * BM], -1, tl.int64), mask=r < m_pad)
        if HAS_W:
            tl.store(ROW_W + r, tl.zeros([MB * BM], tl.float32), mask=r < m_pad)
        b = tl.arange(0, MB)
        tl.store(BLOCK_EXPERT + b, tl.full([MB], -1, tl.int64), mask=b * BM < m_pad)
        tl.debug_barrier()
        tl.store(ROWS + pos, (p // k).to(tl.int64), mask=mp)
        if HAS_W:
            tl.store(ROW_W + pos, tl.load(W + p, mask=mp, other=0.0).to(tl.float32), mask=mp)
        tl.store(PAIR_POS + p, pos.to(tl.int64), mask=mp)
        # each non-empty segment holds at least one pair, so only the first PB = min(MB, PP) blocks can be in one
        # (``active_blocks``); the rest stay -1. At a decode step of 128 experts: 8 blocks computed, not 128 (592
        # instructions for sm_90 against 1480; 3.3 against 5.3 us a launch on an H100, BENCHMARKS.md 25th session)
        b = tl.arange(0, PB)
        start = b * BM
        total = tl.sum(padded, axis=0)
        be = tl.sum((seg_end[None, :] <= start[:, None]).to(tl.int32), axis=1)  # searchsorted, right
        be = tl.where(start < total, be, -1)
        tl.store(BLOCK_EXPERT + b, be.to(tl.int64), mask=start < m_pad)

    @triton.jit
    def _grouped_gemm_kernel(A, stride_am, ROWS, W, stride_we, stride_wn, stride_wk, C, stride_cm,
                             BLOCK_EXPERT, N, K, S, stride_se, stride_sn, GATHER: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             IEEE: tl.constexpr, FP4: tl.constexpr, ASM: tl.constexpr, EVEN_K: tl.constexpr,
                             PDL: tl.constexpr, FOLD: tl.constexpr = False):
        """C[rows of block] = A[rows] @ W[e].T for the expert e of this row block. ``FP4``: W holds packed
        e2m1 bytes [E, N, K/2] as int32 words [E, N, K/8] and S their scale bytes [E, N, K/32], decoded per BLOCK_K
        inputs (a power of two from 128; weight-only). ASM: ``e2m1_word_bf16``'s inline PTX (FOLD: its one-product
        form, every scale byte at most ``fp4_gemv.FOLD_MAX_SCALE``); EVEN_K: K a multiple of BLOCK_K. A
        scale byte of 0 (2**-127, below float32's normal range; real weights never have it) gives 0 here and
        its value in the twin."""
        enter(PDL)
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
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        n_ok = offs_n < N
        if FP4:
            # per BLOCK_K inputs: BLOCK_K / 8 int32 words of codes for every output n, decoded and scaled by
            # e2m1_word_bf16 into 8 bfloat16 tiles (input 8i + t in tile t), each one product with the inputs 8i + t
            BW: tl.constexpr = BLOCK_K // 8
            iw = tl.arange(0, BW)
            w_rows = W + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn
            s_rows = S + e.to(tl.int64) * stride_se + offs_n[None, :] * stride_sn
            a_rows = A + src.to(tl.int64)[:, None] * stride_am
            for k0 in range(0, K, BLOCK_K):
                kw_ok = (k0 + 8 * iw < K) | EVEN_K  # K is a multiple of 32 (expert_weights.check_fp4_shapes)
                words = tl.load(w_rows + (k0 // 8 + iw)[:, None], mask=kw_ok[:, None] & n_ok[None, :], other=0)
                sb = tl.load(s_rows + (k0 // 32 + iw // 4)[:, None], mask=kw_ok[:, None] & n_ok[None, :],
                             other=0).to(tl.int32)
                o = e2m1_word_bf16(words, sb, ASM, FOLD)
                ak = k0 + offs_k  # the inputs as one run, split into the 8 strided ones
                x = tl.load(a_rows + ak[None, :], mask=row_ok[:, None] & ((ak < K) | EVEN_K)[None, :], other=0.0)
                xs = split8(tl.reshape(x, [BLOCK_M, BW, 2, 2, 2]))
                for t in tl.static_range(8):
                    wt = o[t].to(A.dtype.element_ty)  # exact (float32 activations: the IEEE product)
                    if IEEE:
                        acc = tl.dot(xs[t], wt, acc, input_precision="ieee")
                    else:
                        acc = tl.dot(xs[t], wt, acc)
        else:
            a_ptrs = A + src.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
            w_ptrs = W + e.to(tl.int64) * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
            for k0 in range(0, K, BLOCK_K):
                k_ok = (k0 + offs_k) < K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
                if IEEE:  # fp32 models: exact fp32 products, not TF32
                    acc += tl.dot(a, w, input_precision="ieee")
                else:
                    acc += tl.dot(a, w)
                a_ptrs += BLOCK_K
                w_ptrs += BLOCK_K * stride_wk
        c_ptrs = C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=offs_n[None, :] < N)

    def _grouped_gemm(a, rows, w, block_expert, gather: bool, m_pad: int, config: dict | None = None,
                      scale: torch.Tensor | None = None, block_m: int = BLOCK_M, blocks: int | None = None,
                      fold: bool = False):
        """out [m_pad, n] (sorted layout) = a[rows] @ w[e].T per row block. ``config``: BLOCK_N, BLOCK_K,
        num_warps, num_stages (bench/grouped_gemm_configs.py measures the choices). ``scale``: w is packed
        FP4 [E, n, k/2] with these scale bytes [E, n, k/32]; ``fold``: every one of them is at most
        ``fp4_gemv.FOLD_MAX_SCALE`` (``fp4_gemv.fold_scales``), so the decode takes one product. ``blocks``: only
        the first row blocks have programs (``active_blocks``; None: all of them); the rows of the others are not
        written."""
        E, n, kdim = w.shape
        if scale is not None:
            kdim *= 2
        s = scale if scale is not None else w  # unused without FP4
        out = torch.empty(m_pad, n, dtype=a.dtype, device=a.device)
        base = (GEMM_CONFIG_FP4 if scale is not None else GEMM_CONFIG_FP32 if a.element_size() > 2
                else GEMM_CONFIG_LARGE if block_m >= LARGE_BLOCK_M else GEMM_CONFIG_PREFILL if block_m > BLOCK_M
                else GEMM_CONFIG if gather else GEMM_CONFIG_SORTED)
        c = dict(base, **(config or {}))
        grid = (m_pad // block_m if blocks is None else blocks, triton.cdiv(n, c["BLOCK_N"]))
        if scale is not None:
            if c["BLOCK_K"] < 128 or c["BLOCK_K"] & (c["BLOCK_K"] - 1):
                raise ValueError(f"packed FP4 weights need BLOCK_K a power of two from 128, got {c['BLOCK_K']}")
            w = as_words(w)
        _grouped_gemm_kernel[grid](a, a.stride(0), rows, w, w.stride(0), w.stride(1), w.stride(2), out,
                                   out.stride(0), block_expert, n, kdim, s, s.stride(0), s.stride(1),
                                   GATHER=gather, BLOCK_M=block_m, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                                   IEEE=a.dtype == torch.float32, FP4=scale is not None, ASM=use_asm(a),
                                   EVEN_K=kdim % c["BLOCK_K"] == 0, FOLD=fold and scale is not None,
                                   num_warps=c["num_warps"], num_stages=c["num_stages"], **pdl.args())
        return out


def _gemv(a, rows, w, block_expert, gather: bool, m_pad: int, scale: torch.Tensor, block_m: int = BLOCK_M,
          blocks: int | None = None):
    """``_grouped_gemm``'s call for packed FP4 weights at decode sizes (``fp4_gemv``)."""
    return gemv_kernel.fp4_gemv(a, rows, w, scale, block_expert, gather, m_pad, block_m, blocks=blocks)


def _grouped_gemm_torch(a, rows, w, block_expert, gather: bool, m_pad: int, scale: torch.Tensor | None = None,
                        block_m: int = BLOCK_M, blocks: int | None = None):
    """Plain-torch twin of the Triton grouped GEMM (same sorted layout), used off the GPU. Rows of blocks past
    ``blocks`` stay 0 (the kernel leaves them unwritten)."""
    out = torch.zeros(m_pad, w.shape[1], dtype=a.dtype, device=a.device)
    for b, e in enumerate(block_expert.tolist()[:blocks]):
        if e < 0:
            continue
        sl = slice(b * block_m, (b + 1) * block_m)
        r = rows[sl]
        src = a[r.clamp(min=0)] if gather else a[sl]
        we = w[e] if scale is None else unpack_fp4(w[e], scale[e], a.dtype)
        out[sl] = torch.where((r >= 0)[:, None], src @ we.t(), 0).to(a.dtype)
    return out


def gate_up_torch(a: torch.Tensor, rows: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor,
                  s3: torch.Tensor, block_expert: torch.Tensor, m_pad: int, block_m: int, limit: float,
                  row_weight: torch.Tensor, blocks: int | None = None) -> torch.Tensor:
    """Twin of ``fp4_gemv_gate_up``: the grouped products of the decoded weights in float32, SwiGLU times the
    row weight, rounded once to a's dtype (rows of the layout that hold no pair: 0)."""
    r = (m_pad // block_m if blocks is None else blocks) * block_m
    g, u = (_grouped_gemm_torch(a.float(), rows, w, block_expert, True, m_pad, scale=s, block_m=block_m,
                                blocks=blocks)[:r] for w, s in ((w1, s1), (w3, s3)))
    return (swiglu(g, u, limit) * row_weight.float()[:r, None]).to(a.dtype)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
                    w2: torch.Tensor, w3: torch.Tensor, limit: float,
                    keep: torch.Tensor | None = None, scales: tuple | None = None,
                    invariant: bool = False, add=None, out_dtype: torch.dtype = torch.float32,
                    fold: bool = False) -> torch.Tensor:
    """Routed-expert output [N, d] plus ``add`` [N, d] (the shared expert's, or a function giving it), in
    ``out_dtype`` (same contract as Experts.forward), no host sync on CUDA: the sum over a token's pairs, the
    addition and the rounding are the combine's one kernel.

    ``keep`` [N, k] bool (expert parallelism): pairs with ``keep`` False belong to experts of other ranks.
    They are laid out as one extra expert E whose row blocks are skipped (no GEMM work) and contribute 0;
    their ``ids`` may be anything (clamped into range). Shapes stay static: still graph-safe. ``scales``
    (w1, w2, w3 scale bytes): the weights are packed FP4 (``dsv4.model.expert_weights``); ``fold``: every scale
    byte is at most ``fp4_gemv.FOLD_MAX_SCALE`` (the tensor-core GEMM's one-product decode; same bits).
    ``invariant``: row blocks of BLOCK_M whatever the step's size (``block_m_for``; batch invariance)."""
    N, k = ids.shape
    E = w1.shape[0]
    mm = use_grouped_mm(x, N * k, E, invariant, scales is not None)
    bm = BLOCK_M if mm else block_m_for(N * k, E, invariant, large=scales is None and x.element_size() == 2)
    if keep is None:
        rows, pair_pos, block_expert, w_sorted = align(ids, E, bm, weights)
    else:
        rows, pair_pos, block_expert, w_sorted = align(torch.where(keep, ids.clamp(0, E - 1), E), E + 1, bm,
                                                       weights)
        block_expert = torch.where(block_expert == E, -1, block_expert)  # the other ranks' pairs: skipped
    m_pad = rows.shape[0]
    blocks = active_blocks(m_pad, bm, N * k)
    x = x.contiguous()
    gemm = _grouped_gemm if on(x) else _grouped_gemm_torch
    if scales is not None and on(x) and gemv_kernel.use_gemv(N * k, E, invariant):
        gemm = _gemv  # packed FP4 at decode sizes: a GEMV per row
    elif scales is not None and on(x) and fold:
        gemm = functools.partial(_grouped_gemm, fold=True)
    s1, s2, s3 = scales if scales is not None else (None, None, None)
    r = blocks * bm  # rows past the active blocks are padding: never computed, never read
    if mm:  # the tokens' rows gathered once into the sorted layout, then three library grouped GEMMs
        offs = segment_ends(block_expert, E, bm, blocks)
        xs = x[rows[:r].clamp(min=0)]
        h = swiglu_to(grouped_mm(xs, w1, offs), grouped_mm(xs, w3, offs), limit, w_sorted[:r], x.dtype)
        y = grouped_mm(h, w2, offs)  # [r, d]: the combine reads the pairs' rows, all < r
    else:
        if gemm is _gemv and gemv_kernel.GATE_UP_FUSED:  # w1, w3 and the SwiGLU in one launch
            h = gemv_kernel.fp4_gemv_gate_up(x, rows, w1, s1, w3, s3, block_expert, m_pad, bm, limit, w_sorted,
                                             blocks=blocks)
        else:
            g = gemm(x, rows, w1, block_expert, True, m_pad, scale=s1, block_m=bm, blocks=blocks)  # [m_pad, I]
            u = gemm(x, rows, w3, block_expert, True, m_pad, scale=s3, block_m=bm, blocks=blocks)
            h = swiglu_to(g[:r], u[:r], limit, w_sorted[:r], x.dtype)  # routing weight before w2, as DeepSeek
        y = gemm(h, rows, w2, block_expert, False, m_pad, scale=s2, block_m=bm, blocks=blocks)  # [m_pad, d]
    add = add() if callable(add) else add  # Experts.forward's contract: a function is called just before adding
    if on(x):  # one kernel; the lines below are its twin
        return _combine(y, pair_pos, keep, N, k, add, out_dtype)
    y = y[pair_pos]
    if keep is not None:  # skipped blocks were never written (torch.empty): select, never multiply
        y = torch.where(keep.reshape(-1, 1), y, 0)
    return add_to(y.view(N, k, -1).float().sum(dim=1), add, out_dtype)


def add_to(y: torch.Tensor, add: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """fp32 y plus ``add`` (promoted to fp32: exact), rounded once to ``dtype``: the combine's ending."""
    return (y if add is None else y + add).to(dtype)


def _combine(y: torch.Tensor, pair_pos: torch.Tensor, keep: torch.Tensor | None, N: int, k: int,
             add: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, d] in ``out_dtype``: each token's fp32 sum over its k pairs' rows of the sorted GEMM output (pairs kept
    only), plus ``add``."""
    d = y.shape[1]
    out = torch.empty(N, d, dtype=out_dtype, device=y.device)
    if add is not None:
        add = add.contiguous()
        if add.shape != (N, d):
            raise ValueError(f"grouped_experts: add {tuple(add.shape)} must be the output's shape {(N, d)}")
    if N:
        _combine_kernel[(N, triton.cdiv(d, COMBINE_BLOCK))](
            y, pair_pos, keep.reshape(-1).contiguous() if keep is not None else pair_pos,
            add if add is not None else out, out, d, y.stride(0), K=k, HAS_KEEP=keep is not None,
            HAS_ADD=add is not None, BLOCK=COMBINE_BLOCK, num_warps=4, **pdl.args())
    return out
