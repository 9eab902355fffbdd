"""Linears whose weights stay FP8 on the device: e4m3 values with one float32 (power-of-two) scale per 128x128
block, as DeepSeek ships its attention, shared-expert and MTP linears (the engine's ``linear_format: fp8``).

Weight-only: the activations stay in the model dtype. The kernel loads an FP8 tile, widens it to the
activation dtype (exact: an e4m3 value is a bf16 value), multiplies on the tensor cores in fp32 and scales
each 128-input block's partial sum by its block's scale (exact: a power of two). A decode step reads half the
bytes of a bf16 weight. At decode sizes the output columns alone do not fill the GPU, so the inputs are split
(split-K) into partial sums [S, M, N] added in a fixed order afterwards (deterministic, no atomics). Products of
at most GEMV_MAX_ROWS rows run a GEMV on the CUDA cores instead (``_fp8_gemv_kernel``: no tile of 16 rows to
pad, the weight widened to float32 and multiplied by the rows' inputs times their block's scale, element-wise
accumulation, one reduction at the end), with the same split-K. Products of at most ROW_MAX_ROWS rows whose K is
in whole chunks take ``_fp8_row_kernel`` (ROW_KERNEL): the weight read as 32-bit words of 4 codes, each widened by
two hardware conversions, fewer instructions per weight byte (the GEMV is bound by issuing them, not by memory),
and each word's codes serve every row (an MTP verify step of one request has 1 + k rows).

``fp8_linear_torch`` (dequantise the weight, then one GEMM) is the twin: same products, other summation
order. Steps of more than ``KERNEL_MAX_ROWS`` rows (prefill chunks) take it on the GPU too: there the GEMM is
compute-bound and a dequantised copy of the weight costs little next to it.

Measured on the H200 (bench/fp8_linear_gpu.py, BENCHMARKS.md): the tensor-core kernel reads its bytes at
15-39% of the copy bandwidth where cuBLAS reads bf16 at 38-88%, so at one row it takes 0.6-0.96x cuBLAS's time
on Flash's projections, not the half its bytes allow. The GEMV's best tile took 15% less time than the
tensor-core kernel over those projections at one row, about the same at two, more at four (hence
GEMV_MAX_ROWS = 1); ``dequantized`` stays the engine's default.
"""

from __future__ import annotations

import torch

from . import HAVE_TRITON, on, pdl

BLOCK = 128  # inputs (and outputs) per scale
KERNEL_MAX_ROWS = 128  # more rows: dequantise and run one GEMM (the twin); fixed_rows' chunks stay on the kernel
TARGET_PROGRAMS = 264  # two per SM of an H200: the split-K factor aims for this many programs
CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}  # the best of fp8_linear_gpu.py's sweep on most shapes
GEMV_MAX_ROWS = 1  # products of at most this many rows take the GEMV kernel (``gemv_fits``; at 2 about even)
GEMV_CONFIG = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3}  # BLOCK_N divides 128; BLOCK_K 128s
GEMV_MAX_ACC = 8192  # float32 accumulator elements per GEMV program (rows x BLOCK_N x BLOCK_K): BLOCK_K shrinks to fit
# The GEMV's BLOCK_N without a config: about GEMV_PROGRAMS output tiles, BLOCK_N from 8 to GEMV_MAX_BLOCK_N. At
# one row on an H100 (bench/fp8_linear_gpu.py, BENCHMARKS.md) 8 rows a program took wq_b (32768 outputs) 21.2 us
# against 17.7 at 32 (where GEMV_MAX_ACC makes BLOCK_K 256), and the grouped wo_a (8 x 1024) 19.9 against 17.7
# at 16; at 4096 outputs and fewer 8 is best
GEMV_PROGRAMS = 512
GEMV_MAX_BLOCK_N = 32
# The row kernel (one row until the 27th session; the measurements here are of one row): ``_fp8_row_kernel`` reads the
# weight as 32-bit words of 4 codes and widens each word with two cvt.rn.f16x2.e4m3x2 and four f16 -> f32 conversions
# (inline PTX), where the general GEMV's widening went through byte permutes and a shared-memory relayout of the inputs
# in every chunk: compiled for sm_90 (bench/kernel_sass.py), its K loop has 130 instructions for 32 weight bytes a
# thread against 282: the GEMV was bound by issuing instructions, not by memory. On an H100 (bench/fp8_row_gpu.py,
# BENCHMARKS.md) Flash's one-row projections took 20-25% less time (wq_b 13.6 against 16.8 us, 84% of the copy
# bandwidth), and the flash-L20-E128 step 4.30 against 4.54 ms. PREFETCH loads the next chunk's words before this
# chunk's products. The sweep found BLOCK_N 8 faster on most projections, and so it measured in the step: 4.21 against
# 4.38 ms at BLOCK_N 16 (flash-L20-E128, batch 1, H100, one call; --fp8-row-tile). ROW_KERNEL = False: the general GEMV
# for one row, the tensor-core kernel for 2 to 4 (decode_floor.py --no-fp8-row-kernel).
ROW_KERNEL = True
# Rows the row kernel takes: one accumulator a row, each row's operations the same whatever the number of rows (a
# row's result does not depend on its neighbours). At 2 rows on the tensor-core kernel instead, an MTP step (k = 1)
# of flash-L20-E128 spent 1.75 ms in its FP8 products (and 0.55 ms in 107 torch reductions and casts, most likely
# their split-K partials), against 1.34 ms for the one-row step's products (H100, profile_decode.py --mtp 1,
# BENCHMARKS.md 27th session)
ROW_MAX_ROWS = 4
ROW_CONFIG = {"BLOCK_N": 8, "BLOCK_K": 512, "PREFETCH": True, "num_warps": 4, "num_stages": 1}


def row_kernel_fits(M: int, G: int, N: int, K: int, weight: torch.Tensor, block_k: int | None = None) -> bool:
    """Whether ``_fp8_row_kernel`` can take an [M, G, K] x [G, N, K] product: at most ROW_MAX_ROWS rows, K in
    whole chunks of ``block_k`` (None: ROW_CONFIG's BLOCK_K), the weight's rows whole 32-bit words."""
    bk = ROW_CONFIG["BLOCK_K"] if block_k is None else block_k
    return 1 <= M <= ROW_MAX_ROWS and gemv_shape(G, N) and K % bk == 0 and weight.data_ptr() % 4 == 0


def gemv_block_n(outputs: int) -> int:
    """The GEMV's rows per program for a product of ``outputs`` rows of weight (groups times N)."""
    bn = GEMV_CONFIG["BLOCK_N"]
    while bn < GEMV_MAX_BLOCK_N and outputs >= 2 * bn * GEMV_PROGRAMS:
        bn *= 2
    return bn


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [..., out, in] e4m3, scale [ceil(out/128), ceil(in/128)] float32 over the weight's two last dims
    flattened to [prod(...) * out, in] (a grouped weight shares one block grid) -> dtype."""
    shape = weight.shape
    w = weight.reshape(-1, shape[-1])
    rows, cols = w.shape
    s = scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (w.to(torch.float32) * s).to(dtype).view(shape)


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., in] times the dequantised weight [out, in] -> [..., out] in x's dtype."""
    return torch.nn.functional.linear(x, dequantize(weight, scale, x.dtype))


def grouped_fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [N, g, in], weight [g, out, in] (scale over [g * out, in]) -> [N, g, out]."""
    return torch.einsum("ngi,goi->ngo", x, dequantize(weight, scale, x.dtype))


def usable(x: torch.Tensor, weight: torch.Tensor, rows: int) -> bool:
    """``rows``: the rows of the product (a grouped product's rows each hold all its groups)."""
    return (on(x, weight) and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and 0 < rows <= KERNEL_MAX_ROWS and x.stride(-1) == 1 and weight.is_contiguous())


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8_linear_torch`` on the kernel where it fits."""
    if not usable(x, weight, x.numel() // max(x.shape[-1], 1)):
        return fp8_linear_torch(x, weight, scale)
    flat = x.reshape(-1, x.shape[-1])
    out = _launch(flat.unsqueeze(1), weight.unsqueeze(0), scale)
    return out.view(*x.shape[:-1], weight.shape[0])


def grouped_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``grouped_fp8_linear_torch`` on the kernel where it fits."""
    if not usable(x, weight, x.shape[0]):
        return grouped_fp8_linear_torch(x, weight, scale)
    return _launch(x, weight, scale)


def split_for(tiles: int, k_blocks: int) -> int:
    """Input splits so that ``tiles`` output tiles make about TARGET_PROGRAMS programs (at most one split per
    128-input block)."""
    return max(1, min(k_blocks, TARGET_PROGRAMS // max(tiles, 1)))


def _block_m(M: int) -> int:
    return 16 if M <= 16 else 32 if M <= 32 else 64


def gemv_shape(G: int, N: int) -> bool:
    """Whether the GEMV kernel can take a [G, N, K] weight: each output tile of one group inside one block row
    of scales (one group, or groups of whole blocks)."""
    return G == 1 or N % BLOCK == 0


def gemv_fits(M: int, G: int, N: int) -> bool:
    """Whether the GEMV kernel takes an [M, G, K] x [G, N, K] product (the engine's choice): few rows."""
    return M <= GEMV_MAX_ROWS and gemv_shape(G, N)


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, config: dict | None = None,
            split: int | None = None, gemv: bool | str | None = None) -> torch.Tensor:
    """x [M, G, K] (unit stride along K), weight [G, N, K] e4m3 contiguous, scale over [G * N, K] -> [M, G, N].
    ``gemv``: None = the engine's choice (the row kernel where ``row_kernel_fits`` with ROW_KERNEL, else the
    GEMV where ``gemv_fits``, else the tensor-core kernel); False the tensor-core kernel, True the GEMV, "row" the
    row kernel. ``config`` is the chosen kernel's (CONFIG, GEMV_CONFIG or ROW_CONFIG keys)."""
    M, G, K = x.shape
    N = weight.shape[1]
    if gemv is None and ROW_KERNEL and row_kernel_fits(M, G, N, K, weight):
        gemv = "row"
    if gemv == "row":
        return _launch_row(x, weight, scale, {**ROW_CONFIG, **(config or {})}, split)
    gemv = gemv_fits(M, G, N) if gemv is None else gemv
    cfg = {**(dict(GEMV_CONFIG, BLOCK_N=gemv_block_n(G * N)) if gemv else CONFIG), **(config or {})}
    BN = cfg["BLOCK_N"]
    if gemv:
        if not gemv_shape(G, N):
            raise ValueError(f"the FP8 GEMV takes one group or groups of whole {BLOCK}-row blocks, got {G} x {N}")
        BM = triton.next_power_of_2(M)
        BK = cfg["BLOCK_K"]
        if BLOCK % BN or BK % BLOCK:
            raise ValueError(f"the FP8 GEMV needs BLOCK_N dividing {BLOCK} and BLOCK_K a multiple of it, got {cfg}")
        while BM * BN * BK > GEMV_MAX_ACC and BK > BLOCK:  # the accumulator stays in registers
            BK //= 2
    else:
        BM, BK = _block_m(M), BLOCK
    tiles = (1 if gemv else triton.cdiv(M, BM)) * triton.cdiv(N, BN) * G
    out, k_per_split = _partials(x, N, BK, tiles, split)
    S = out.shape[0]
    if gemv:
        grid = (triton.cdiv(N, BN), S, G)
        _fp8_gemv_kernel[grid](x, weight, scale, out, M, N, K, x.stride(0), x.stride(1), scale.stride(0),
                               k_per_split, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, EVEN_K=K % BK == 0, SB=BLOCK,
                               num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.args())
    else:
        grid = (triton.cdiv(N, BN), triton.cdiv(M, BM) * S, G)
        _fp8_kernel[grid](x, weight, scale, out, M, N, K, x.stride(0), x.stride(1), scale.stride(0), k_per_split,
                          triton.cdiv(M, BM), BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BLOCK, IEEE=x.dtype == torch.float32,
                          num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl.args())
    return _sum_partials(out, x.dtype)


def _partials(x: torch.Tensor, N: int, BK: int, tiles: int, split: int | None) -> tuple[torch.Tensor, int]:
    """The split-K of an [M, G, K] x [G, N, K] product run in chunks of BK inputs over ``tiles`` output tiles
    (``split``: forced, else ``split_for``): its partial sums' buffer [S, M, G, N] (float32 when S > 1, else the
    output itself in x's dtype) and the inputs per split, so that no split is empty."""
    M, G, K = x.shape
    k_blocks = triton.cdiv(K, BK)
    S = split or split_for(tiles, k_blocks)
    k_per_split = triton.cdiv(k_blocks, S) * BK
    S = triton.cdiv(K, k_per_split)
    return torch.empty(S, M, G, N, dtype=torch.float32 if S > 1 else x.dtype, device=x.device), k_per_split


def _sum_partials(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[M, G, N]: the one split's output, or the splits' partials added in a fixed order."""
    return out[0] if out.shape[0] == 1 else out.sum(0).to(dtype)


def _launch_row(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, cfg: dict,
                split: int | None) -> torch.Tensor:
    """``_launch`` for a few rows on ``_fp8_row_kernel`` (``row_kernel_fits``); ``cfg``: ROW_CONFIG's keys."""
    M, G, K = x.shape
    N = weight.shape[1]
    BN, BK = cfg["BLOCK_N"], cfg["BLOCK_K"]
    if not row_kernel_fits(M, G, N, K, weight, BK) or BLOCK % BN or BK % BLOCK:
        raise ValueError(f"the FP8 row kernel takes 1 to {ROW_MAX_ROWS} rows, groups of whole {BLOCK}-row blocks,"
                         f" BLOCK_N dividing {BLOCK} and K in whole BLOCK_K chunks, got {M} x {G} x {N} x {K} with"
                         f" {cfg}")
    out, k_per_split = _partials(x, N, BK, triton.cdiv(N, BN) * G, split)
    _fp8_row_kernel[(triton.cdiv(N, BN), out.shape[0], G)](x, weight.view(torch.int32), scale, out, N, K, x.stride(0),
                                                   x.stride(1), scale.stride(0), k_per_split, M=M, BLOCK_N=BN,
                                                   BLOCK_K=BK, SB=BLOCK, PREFETCH=cfg["PREFETCH"],
                                                   num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                                   **pdl.args())
    return _sum_partials(out, x.dtype)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter, load_weight_and_enter

    @triton.jit
    def _fp8_kernel(X, W, S, OUT, M, N, K, stride_xm, stride_xg, stride_s, k_per_split, m_blocks,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                    PDL: tl.constexpr):
        enter(PDL)
        # out^T = W x^T ("swap AB"): the widened weight tile is the dot's first operand, which the tensor cores
        # take from registers, so it never makes a round trip through shared memory; the few rows of x are
        # the second
        pid_n, pid_ms, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        pid_m, split = pid_ms % m_blocks, pid_ms // m_blocks
        G = tl.num_programs(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        s_row = (g * N + rn) // BLOCK_K  # the block row of each output (a group's rows continue the grid)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        k_start = split * k_per_split
        for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            xt = tl.load(X + rm[None, :] * stride_xm + g * stride_xg + k[:, None], mask=m_ok[None, :] & k_ok[:, None],
                         other=0.0)  # [BLOCK_K, BLOCK_M]
            w = tl.load(W + (g * N + rn)[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            s = tl.load(S + s_row * stride_s + k0 // BLOCK_K, mask=n_ok, other=0.0)  # [BLOCK_N]
            if IEEE:  # fp32 activations: full-precision products, not TF32
                part = tl.dot(w.to(xt.dtype), xt, input_precision="ieee", out_dtype=tl.float32)
            else:
                part = tl.dot(w.to(xt.dtype), xt, out_dtype=tl.float32)
            acc += part * s[:, None]
        dst = OUT + ((split * M + rm[None, :]) * G + g) * N + rn[:, None]
        tl.store(dst, acc.to(OUT.dtype.element_ty), mask=m_ok[None, :] & n_ok[:, None])

    @triton.jit
    def e4m3_word(w):
        """int32 words of 4 e4m3 codes (input 4i + t in byte t) -> 4 float32 tensors (the t-th holding inputs 4i + t),
        exact: each half-word to two float16 (cvt.rn.f16x2.e4m3x2, sm_89 on), each float16 to float32."""
        return tl.inline_asm_elementwise("""{
        .reg .b16 lo, hi, a0, a1, b0, b1;
        .reg .b32 a, b;
        mov.b32 {lo, hi}, $4;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mov.b32 {a0, a1}, a;
        mov.b32 {b0, b1}, b;
        cvt.f32.f16 $0, a0;
        cvt.f32.f16 $1, a1;
        cvt.f32.f16 $2, b0;
        cvt.f32.f16 $3, b1;
        }""", "=r,=r,=r,=r,r", [w], dtype=(tl.float32,) * 4, is_pure=True, pack=1)

    @triton.jit
    def _row_products(acc, x_row, sc, o0, o1, o2, o3, BW: tl.constexpr, BLOCK_K: tl.constexpr):
        """One row's chunk: its BLOCK_K inputs (at ``x_row``) split into 4 strided runs, each scaled by its block's
        scale (exact), times the widened codes they meet, accumulated element-wise into ``acc``."""
        x = tl.reshape(tl.load(x_row + tl.arange(0, BLOCK_K)).to(tl.float32), [BW, 2, 2])
        x_even, x_odd = tl.split(x)  # inputs 4i + t: t % 2, then t // 2
        x0, x2 = tl.split(x_even)
        x1, x3 = tl.split(x_odd)
        acc += o0 * (x0 * sc)[None, :]
        acc += o1 * (x1 * sc)[None, :]
        acc += o2 * (x2 * sc)[None, :]
        acc += o3 * (x3 * sc)[None, :]
        return acc

    @triton.jit
    def _fp8_row_kernel(X, W, S, OUT, N, K, stride_xm, stride_xg, stride_s, k_per_split, M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SB: tl.constexpr, PREFETCH: tl.constexpr,
                        PDL: tl.constexpr):
        # M (1 to ROW_MAX_ROWS) rows: W read as int32 words [G * N, K / 4]; each word's 4 widened codes times the
        # 4 inputs of each row they meet (``_row_products``), accumulated element-wise per word column in float32,
        # one accumulator a row, and summed over the columns once at the end. Each row's accumulator sees the
        # same operations in the same order whatever M is, so a row's result does not depend on the rows beside
        # it. With PDL RELEASE (early release, pdl.py) the first chunk of weight is loaded before the wait: no
        # kernel writes it
        pid_n, split, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        G = tl.num_programs(2)
        BW: tl.constexpr = BLOCK_K // 4
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        i = tl.arange(0, BW)
        w_rows = W + (g * N + rn).to(tl.int64)[:, None] * (K // 4)
        s_row = S + ((g * N + pid_n * BLOCK_N) // SB) * stride_s  # one block row (gemv_shape)
        x_rows = X + g * stride_xg
        acc0 = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_N, BW], dtype=tl.float32)  # rows 1 to 3: only where M has them
        acc2 = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
        acc3 = tl.zeros([BLOCK_N, BW], dtype=tl.float32)
        k_start = split * k_per_split
        k_end = tl.minimum(k_start + k_per_split, K)
        if PREFETCH:  # the next chunk's words are loaded before this chunk's products: two chunks in flight
            nxt = load_weight_and_enter(w_rows + (k_start // 4 + i)[None, :], n_ok[:, None], PDL)
        else:
            enter(PDL)
        for k0 in range(k_start, k_end, BLOCK_K):
            if PREFETCH:
                words = nxt
                nxt = tl.load(w_rows + ((k0 + BLOCK_K) // 4 + i)[None, :], mask=n_ok[:, None] & (k0 + BLOCK_K < k_end),
                              other=0)
            else:
                words = tl.load(w_rows + (k0 // 4 + i)[None, :], mask=n_ok[:, None], other=0)
            sc = tl.load(s_row + (k0 + 4 * i) // SB)
            o0, o1, o2, o3 = e4m3_word(words)
            acc0 = _row_products(acc0, x_rows + k0, sc, o0, o1, o2, o3, BW, BLOCK_K)
            if M > 1:
                acc1 = _row_products(acc1, x_rows + stride_xm + k0, sc, o0, o1, o2, o3, BW, BLOCK_K)
            if M > 2:
                acc2 = _row_products(acc2, x_rows + 2 * stride_xm + k0, sc, o0, o1, o2, o3, BW, BLOCK_K)
            if M > 3:
                acc3 = _row_products(acc3, x_rows + 3 * stride_xm + k0, sc, o0, o1, o2, o3, BW, BLOCK_K)
        dst = OUT + (split * M * G + g) * N + rn  # [S, M, G, N]: row r at dst + r * G * N
        tl.store(dst, tl.sum(acc0, axis=1).to(OUT.dtype.element_ty), mask=n_ok)
        if M > 1:
            tl.store(dst + G * N, tl.sum(acc1, axis=1).to(OUT.dtype.element_ty), mask=n_ok)
        if M > 2:
            tl.store(dst + 2 * G * N, tl.sum(acc2, axis=1).to(OUT.dtype.element_ty), mask=n_ok)
        if M > 3:
            tl.store(dst + 3 * G * N, tl.sum(acc3, axis=1).to(OUT.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _fp8_gemv_kernel(X, W, S, OUT, M, N, K, stride_xm, stride_xg, stride_s, k_per_split,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         SB: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        # On the CUDA cores: the M rows' inputs, each scaled by its block's scale (the tile's outputs share one
        # block row), times the widened weight tile, accumulated element-wise in float32 over the chunks and
        # summed over the inputs once at the end; every weight byte is read once for all M rows
        pid_n, split, g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        G = tl.num_programs(2)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        s_row = S + ((g * N + pid_n * BLOCK_N) // SB) * stride_s  # one block row (gemv_fits)
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
        k_start = split * k_per_split
        for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
            k = k0 + rk
            if EVEN_K:
                w = tl.load(W + (g * N + rn)[:, None] * K + k[None, :], mask=n_ok[:, None], other=0.0)
                x = tl.load(X + rm[:, None] * stride_xm + g * stride_xg + k[None, :], mask=m_ok[:, None], other=0.0)
                sc = tl.load(s_row + k // SB)
            else:
                k_ok = k < K
                w = tl.load(W + (g * N + rn)[:, None] * K + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                            other=0.0)
                x = tl.load(X + rm[:, None] * stride_xm + g * stride_xg + k[None, :],
                            mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                sc = tl.load(s_row + k // SB, mask=k_ok, other=0.0)
            xs = x.to(tl.float32) * sc[None, :]  # exact: a power of two
            acc += w.to(tl.float32)[None, :, :] * xs[:, None, :]
        out = tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]
        dst = OUT + ((split * M + rm[:, None]) * G + g) * N + rn[None, :]
        tl.store(dst, out.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
