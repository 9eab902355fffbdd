"""Products of one to MAX_ROWS rows with bf16 weights (the linears DeepSeek ships in bf16: the compressors', the
indexer's weights_proj, fused per layer by ``model.fused``, and the head; with ``linear_format: dequantized`` every
linear, the attention's grouped wo_a through ``grouped_linear``) on the CUDA cores: a decode step of one request
has one row, its MTP verify step 1 + k, the MTP catch-up pass as many.

At a decode step of one request cuBLAS runs a compressor product as a split-K GEMM plus a reduction kernel: two
launches, 8.1 + 1.8 us a layer for 8-22 MB of weight on an H100 (flash-L20-E128). ``_row_kernel`` reads the
weight as 32-bit words of two values (each widened to float32 by a shift or a mask: one integer op a value),
times the inputs split into their even and odd runs, accumulated element-wise and summed once at the end: one
launch, no partial sums. BLOCK_N shrinks (to 4) so that a small product still has about ROW_PROGRAMS programs;
the chunk of inputs is 512 at Flash's widths, and for a small model's (mini's 256, 128, 96) the largest power of
two that divides K (``block_k``).
Measured on an H100 (bench/bf16_row_gpu.py, BENCHMARKS.md, 25th session): 9.1 against 12.0 us on a ratio-4
layer's 2624 x 4096, 6.0 against 7.6 on a ratio-128 layer's 1024 x 4096, 331 against 364 us on the head
(129280 x 4096); the flash-L20-E128 step at batch 1 4.03 against 4.11 ms with the compressors' products and the
head on it (decode_floor.py --no-bf16-row-kernel). The twin is ``F.linear`` (same products, other summation
order). Each of a launch's rows has its own accumulator and the same operations in the same order whatever the
number of rows, so a row's result does not depend on the rows beside it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import HAVE_TRITON, on, pdl

ENABLED = True  # False: few-row bf16 products stay on cuBLAS / einsum (decode_floor.py --no-bf16-row-kernel)
BLOCK_K = 512  # inputs per chunk at most (``block_k``): K must be whole chunks
MIN_BLOCK_K = 32
ROW_PROGRAMS = 256  # BLOCK_N halves from MAX_BLOCK_N (down to 4) until the outputs make at least this many programs
MAX_BLOCK_N = 16
MAX_ROWS = 4  # rows the kernel takes (an MTP verify step of one request has 1 + k); more go to F.linear


def block_n(N: int) -> int:
    bn = MAX_BLOCK_N
    while bn > 4 and N < bn * ROW_PROGRAMS:
        bn //= 2
    return bn


def block_k(K: int) -> int | None:
    """Inputs per chunk for K inputs: the largest power of two up to BLOCK_K that divides K (Flash's widths take
    512; a small model's 256 or 96 take 256 or 32), None below MIN_BLOCK_K."""
    bk = BLOCK_K
    while bk >= MIN_BLOCK_K and K % bk:
        bk //= 2
    return bk if bk >= MIN_BLOCK_K else None


def _weight_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """What both products ask of their operands: the kernel on, CUDA, bf16, a contiguous weight whose rows start on
    a 32-bit word, K a multiple of MIN_BLOCK_K (``block_k``)."""
    return (ENABLED and on(x, weight) and weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16
            and weight.is_contiguous() and block_k(x.shape[-1]) is not None and weight.data_ptr() % 4 == 0)


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """1 to MAX_ROWS rows (x [..., K]) and a weight [N, K] that ``_weight_fits`` (anything else, a K that does not
    match among it, goes to ``F.linear`` and its errors)."""
    return (x.dim() > 0 and 0 < x.numel() <= MAX_ROWS * x.shape[-1] and weight.dim() == 2
            and weight.shape[1] == x.shape[-1] and _weight_fits(x, weight))


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight)`` on the row kernel where it is ``usable``."""
    return launch(x, weight) if usable(x, weight) else F.linear(x, weight)


def grouped_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """x [M, G, K] with 1 to MAX_ROWS rows and a weight [G, N, K] that ``_weight_fits``."""
    return (x.dim() == 3 and weight.dim() == 3 and 0 < x.shape[0] <= MAX_ROWS
            and x.shape[1:] == (weight.shape[0], weight.shape[2]) and _weight_fits(x, weight))


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, G, K], weight [G, N, K] -> [M, G, N], each group's rows times its own weight (the attention's wo_a):
    the row kernel where ``grouped_usable``, else one batched GEMM (einsum on the CPU)."""
    if grouped_usable(x, weight):
        return launch(x, weight.view(-1, weight.shape[-1]), groups=weight.shape[0])
    if x.is_cuda:  # one batched GEMM storing each group's rows straight into [M, G, N] (no transposing copy after)
        out = torch.empty(*x.shape[:-1], weight.shape[1], dtype=torch.result_type(x, weight), device=x.device)
        torch.bmm(x.transpose(0, 1), weight.transpose(1, 2), out=out.transpose(0, 1))
        return out
    return torch.einsum("ngi,goi->ngo", x, weight)


def launch(x: torch.Tensor, weight: torch.Tensor, bn: int | None = None, groups: int = 1) -> torch.Tensor:
    """The kernel on a ``usable`` product whatever its size; ``bn``: BLOCK_N (None: ``block_n``). ``groups``: x is
    [M, groups, K] and weight [groups * N, K], group g's rows times its N rows of weight -> [M, groups, N]."""
    GN, K = weight.shape
    N = GN // groups
    out = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    bn = bn or block_n(GN)
    _row_kernel[(triton.cdiv(N, bn), groups)](x.reshape(-1).contiguous(), weight.view(torch.int32), out, N, K,
                                              M=x.numel() // (K * groups), BLOCK_N=bn, BLOCK_K=block_k(K),
                                              num_warps=4, num_stages=1, **pdl.args())
    return out


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import load_weight_and_enter

    @triton.jit
    def _row_products(acc, x_row, lo, hi, BW: tl.constexpr, BLOCK_K: tl.constexpr):
        """One row's chunk: its inputs (at ``x_row``) split into even and odd runs times the weights they meet,
        accumulated element-wise into ``acc``."""
        x_even, x_odd = tl.split(tl.reshape(tl.load(x_row + tl.arange(0, BLOCK_K)).to(tl.float32), [BW, 2]))
        x_even, x_odd = x_even[None, :], x_odd[None, :]
        acc += lo * x_even
        acc += hi * x_odd
        return acc

    @triton.jit
    def _row_kernel(X, W, OUT, N, K, M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """OUT[m, g, n] = sum_k X[m, g, k] W[g N + n, k] for BLOCK_N outputs of group g (program axis 1; one group:
        X [M, K], OUT [M, N]) and the M (1 to MAX_ROWS) rows of X [M, G, K], W read as int32 words [G N, K / 2]
        (value 2i in the low half, 2i + 1 in the high half), each word's values serving
        every row, one accumulator a row (a row's operations are the same whatever M is); the next chunk's words
        load before this chunk's products, the first chunk's before the wait with PDL RELEASE (early release in
        passes of few rows: no kernel writes a weight)."""
        BW: tl.constexpr = BLOCK_K // 2
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        g, G = tl.program_id(1), tl.num_programs(1)
        n_ok = rn < N
        i = tl.arange(0, BW)
        w_rows = W + (g * N + rn).to(tl.int64)[:, None] * (K // 2)
        X += g * K  # row m of group g at X + m * G * K
        OUT += g * N  # and its outputs at OUT + m * G * N
        acc0 = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BW], dtype=tl.float32)  # rows 1 to 3: only where M has them
        acc2 = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
        nxt = load_weight_and_enter(w_rows + i[None, :], n_ok[:, None], PDL)
        for k0 in range(0, K, BLOCK_K):
            words = nxt
            nxt = tl.load(w_rows + ((k0 + BLOCK_K) // 2 + i)[None, :], mask=n_ok[:, None] & (k0 + BLOCK_K < K),
                          other=0)
            lo = (words << 16).to(tl.float32, bitcast=True)  # the even input's weight (bf16 bits as float32)
            hi = (words & -65536).to(tl.float32, bitcast=True)
            acc0 = _row_products(acc0, X + k0, lo, hi, BW, BLOCK_K)
            if M > 1:
                acc1 = _row_products(acc1, X + G * K + k0, lo, hi, BW, BLOCK_K)
            if M > 2:
                acc2 = _row_products(acc2, X + 2 * G * K + k0, lo, hi, BW, BLOCK_K)
            if M > 3:
                acc3 = _row_products(acc3, X + 3 * G * K + k0, lo, hi, BW, BLOCK_K)
        tl.store(OUT + rn, tl.sum(acc0, axis=1).to(OUT.dtype.element_ty), mask=n_ok)
        if M > 1:
            tl.store(OUT + G * N + rn, tl.sum(acc1, axis=1).to(OUT.dtype.element_ty), mask=n_ok)
        if M > 2:
            tl.store(OUT + 2 * G * N + rn, tl.sum(acc2, axis=1).to(OUT.dtype.element_ty), mask=n_ok)
        if M > 3:
            tl.store(OUT + 3 * G * N + rn, tl.sum(acc3, axis=1).to(OUT.dtype.element_ty), mask=n_ok)
