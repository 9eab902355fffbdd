"""Packed FP4 experts at decode sizes: the grouped product as one GEMV per row, on the CUDA cores, and the
word decode both FP4 kernels use.

At a decode step an expert sees one or two of the step's rows, and the grouped GEMM (``moe._grouped_gemm``)
pads each expert's rows to a tensor-core tile of 16 and converts every decoded weight tile to the dot's layout.
Here a program owns BLOCK_N outputs of one expert's row block and runs over its valid rows (a prefix of the block
in the sorted layout, ``moe.align``): per pair of rows, the codes of BLOCK_K inputs for each output are one
contiguous load of int32 words, 8 codes each, decoded by ``e2m1_word`` into 8 float32 tiles (input 8i + t of
word i in tile t), each multiplied by its strided run of inputs (one contiguous load, split), summed per group of
32 inputs (4 words) and scaled by the group's e8m0 byte (a power of two), in float32; the groups are summed
once, after the K loop. A block's third and later rows read its expert's tiles again, from L2.
Rows of the block past its valid ones are not written (nothing reads them: the combine and the SwiGLU's valid
rows take only valid rows). The twin is ``moe._grouped_gemm_torch`` (the weights decoded by ``fp4.unpack_fp4``).

``fp4_gemv_gate_up`` runs the experts' first half, w1 and w3 of the same rows and the SwiGLU with the routing
weight, as one launch: each program decodes both weights' tiles against one load of the row's inputs and applies
the SwiGLU to the float32 sums (the separate path rounds the two products to the activations' dtype first). Its
twin is ``moe.gate_up_torch``.

``moe.grouped_experts`` takes this path when the step's (token, choice) pairs average at most
GEMV_MAX_ROWS_PER_EXPERT per expert, and never under batch invariance (one path whatever the batch).
"""
from __future__ import annotations

import torch

from . import HAVE_TRITON, pdl

GEMV_MAX_ROWS_PER_EXPERT = 1  # pairs per expert, on average, up to which the GEMV path runs
# The single GEMV runs w2 (w1 and w3 run fused, below): 16/512 took 18.2 / 108 / 376 us at batch 1 / 8 / 32 of
# 128 experts on an H100, 32/256 19.9 / 122 / 398 (bench/fp4_gemv_gpu.py --sweep, BENCHMARKS.md)
GEMV_CONFIG = {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3, "JOIN": True}  # BLOCK_K: 32s
# JOIN (``join8``): 17.0 against 17.5 us for w2 at batch 1, and the first half at batch 1 (GEMV_CONFIG_GATE_UP_FEW)
# 30.9 against 32.5 (H100, fp4_gemv_gpu.py --join-sweep, BENCHMARKS.md 25th session); not measured at batch 8,
# where GEMV_CONFIG_GATE_UP keeps the split inputs
# w1 and w3 in one program hold two weights' decoded tiles (at BLOCK_N 32 and BLOCK_K 256, 255 registers a thread
# compiled for sm_90; at 16, 128). Measured on an H100 with 128 experts: 8/512 best at batch 1 (33.4 us against
# 38.9 for the three launches), 16/256 from batch 8 on (204 against 219 at 8, 386 against 404 at 16)
GEMV_CONFIG_GATE_UP = {"BLOCK_N": 16, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3, "JOIN": False}
GEMV_CONFIG_GATE_UP_FEW = {"BLOCK_N": 8, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3,
                           "JOIN": True}  # blocks <= experts / 4
# PREFETCH: each chunk's words and scale bytes (both weights' with GATE_UP) load one chunk ahead, before the
# chunk's decode and products, so two chunks are in flight (as the FP8 row kernel's PREFETCH); without it a chunk's
# loads wait for the products of the one before (compiled for sm_90, the loop issues them at its top and uses them
# at once). Same arithmetic, same bits; 128 registers a thread for the fused first half (120 without). Measured
# on an H100 (flash-L20-E128, one call, decode_floor.py --no-fp4-prefetch): batch 8 9.83 against 10.17 ms, batch 1
# 3.53 against 3.52; the MTP k = 1 step's FP4 GEMVs 1.77 against 1.97 ms (two calls). Row 0's inputs a chunk ahead
# too (139 registers, 3 programs an SM instead of 4) measured 10.05 and 3.56. A config's "PREFETCH" key overrides it
PREFETCH = True
GATE_UP_FUSED = True  # w1, w3 and the SwiGLU as one launch at decode sizes (bench/decode_floor.py's A/B: False)


def gate_up_config(blocks: int, num_experts: int) -> dict:
    """The fused first half's tile for a launch over ``blocks`` row blocks (``moe.active_blocks``: one per pair
    at decode sizes, 6 at batch 1 of Flash)."""
    return GEMV_CONFIG_GATE_UP_FEW if 4 * blocks <= num_experts else GEMV_CONFIG_GATE_UP


def use_gemv(num_pairs: int, num_experts: int, invariant: bool) -> bool:
    return not invariant and num_pairs <= GEMV_MAX_ROWS_PER_EXPERT * num_experts


def as_words(w: torch.Tensor) -> torch.Tensor:
    """Packed codes [..., K/2] (uint8) as int32 words [..., K/8], the layout ``e2m1_word`` decodes (no copy)."""
    return (w if w.stride(-1) == 1 else w.contiguous()).view(torch.int32)


FOLD_MAX_SCALE = 128  # scale bytes up to which the tensor-core kernel's decode takes one product (FOLD)
FOLD = True  # the one-product decode where the scales allow it (bench/decode_floor.py --no-fp4-fold: the A/B)


def fold_scales(*scales: torch.Tensor) -> bool:
    """Whether every scale byte of these weights is at most FOLD_MAX_SCALE (2**1): then the tensor-core kernel
    decodes with one bfloat16 product a weight pair (``e2m1_word_bf16``'s FOLD). Reads the bytes (a host sync):
    once, at load (``StackedExperts.note_scales``). False while FOLD is off."""
    return FOLD and all(s.numel() == 0 or int(s.max()) <= FOLD_MAX_SCALE for s in scales)


def use_asm(t: torch.Tensor) -> bool:
    """The inline-PTX decode on CUDA; its Triton-op twin under Triton's interpreter (CPU tensors)."""
    return t.device.type == "cuda"


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter
    from .swiglu import swiglu_f32

    @triton.jit
    def e2m1_f16(nib):
        """e2m1 codes (int32 nibbles s|e1e0|m) -> 2**-14 times their values (the kernels scale each
        group's sum back by 2**14 with its scale), as float16:
        the sign to bit 15, e1 e0 m to bits 11-9 (the exponent field's low two bits and the mantissa's top one),
        so e > 0 reads 2**(e-15) * (1 + m/2) and e = 0 the subnormal m/2 * 2**-14. Exact, five integer ops; the
        twin is ``fp4.unpack_fp4``."""
        bits = ((nib & 8) << 12) | ((nib & 7) << 9)
        return bits.to(tl.int16).to(tl.float16, bitcast=True)

    # One 32-bit word of codes (inputs 8i .. 8i + 7, nibble t at bits 4t .. 4t + 3) -> 8 float32, 2**-14 of the
    # values, two codes per step in 16-bit halves (the way Marlin's dequantisation does it): the half's top nibble
    # has its sign at bit 15 already and its e1 e0 m at bits 14-12, three places above their float16 spot, so
    # (q & 0x80008000) | ((q & 0x70007000) >> 3) is two float16 codes, the inputs 3 and 7; the word shifted
    # left by 4 gives inputs 2 and 6, and so on. About 2.5 integer ops per code against e2m1_f16's 7.
    _E2M1_WORD_ASM = tl.constexpr("""{
    .reg .b32 q, t, u;
    .reg .b16 l, h;
    mov.b32 q, $8;
    and.b32 t, q, 0x70007000; shr.b32 t, t, 3; and.b32 u, q, 0x80008000; or.b32 u, u, t;
    mov.b32 {l, h}, u; cvt.f32.f16 $3, l; cvt.f32.f16 $7, h;
    shl.b32 q, q, 4;
    and.b32 t, q, 0x70007000; shr.b32 t, t, 3; and.b32 u, q, 0x80008000; or.b32 u, u, t;
    mov.b32 {l, h}, u; cvt.f32.f16 $2, l; cvt.f32.f16 $6, h;
    shl.b32 q, q, 4;
    and.b32 t, q, 0x70007000; shr.b32 t, t, 3; and.b32 u, q, 0x80008000; or.b32 u, u, t;
    mov.b32 {l, h}, u; cvt.f32.f16 $1, l; cvt.f32.f16 $5, h;
    shl.b32 q, q, 4;
    and.b32 t, q, 0x70007000; shr.b32 t, t, 3; and.b32 u, q, 0x80008000; or.b32 u, u, t;
    mov.b32 {l, h}, u; cvt.f32.f16 $0, l; cvt.f32.f16 $4, h;
    }""")

    @triton.jit
    def e2m1_word(w, ASM: tl.constexpr):
        """int32 words of 8 codes -> 8 float32 tensors (input 8i + t in the t-th), 2**-14 of the values. ASM: the
        inline PTX above; otherwise e2m1_f16 per nibble (its twin, and what the Triton interpreter runs)."""
        if ASM:
            return tl.inline_asm_elementwise(_E2M1_WORD_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r", [w],
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=1)
        else:
            return (e2m1_f16(w & 0xF).to(tl.float32), e2m1_f16((w >> 4) & 0xF).to(tl.float32),
                    e2m1_f16((w >> 8) & 0xF).to(tl.float32), e2m1_f16((w >> 12) & 0xF).to(tl.float32),
                    e2m1_f16((w >> 16) & 0xF).to(tl.float32), e2m1_f16((w >> 20) & 0xF).to(tl.float32),
                    e2m1_f16((w >> 24) & 0xF).to(tl.float32), e2m1_f16((w >> 28) & 0xF).to(tl.float32))

    # Two words ($8, $9; their scale bytes $10, $11) -> 8 registers of two bfloat16 weights each, for the
    # tensor-core kernel (its dot takes them as they are): the words' low halves are paired in one register and
    # their high halves in another, so each step yields the same code of both words, the pair the dot operand
    # holds. e1 e0 m go to bits 8-6 (the exponent field's low two bits and the mantissa's top one): each half
    # reads 2**-126 of its code's value (e = 0 a bfloat16 subnormal, as Marlin's FP4 path has it), and two
    # bf16x2 products, by 2**126 and by the group's 2**(b-127) (bits b << 7; b = 0 gives 0), make it the
    # weight, exact for every b (one product by 2**(b-1) would overflow past b = 128).
    _E2M1_BF16_STEP = """
    and.b32 t, {r}, 0x70007000; shr.b32 t, t, 6; and.b32 u, {r}, 0x80008000; or.b32 u, u, t;
    mul.rn.bf16x2 u, u, c; mul.rn.bf16x2 ${out}, u, f;"""
    _E2M1_WORD_BF16_ASM = tl.constexpr("""{
    .reg .b32 a, b, t, u, f, c;
    prmt.b32 a, $8, $9, 0x5410;
    prmt.b32 b, $8, $9, 0x7632;
    shl.b32 f, $10, 7; shl.b32 t, $11, 23; or.b32 f, f, t;
    mov.b32 c, 0x7E807E80;""" + "\n    shl.b32 a, a, 4; shl.b32 b, b, 4;".join(
        _E2M1_BF16_STEP.format(r="a", out=t) + _E2M1_BF16_STEP.format(r="b", out=t + 4) for t in (3, 2, 1, 0))
        + "\n    }")

    # FOLD: where every scale byte of a weight is at most FOLD_MAX_SCALE (``fold_scales``; real checkpoints' are
    # near 120), the two products are one, by 2**(b-1) (bits (b + 126) << 7, the largest 2**127 at b = 128): one
    # bf16x2 multiply an output register instead of two, exact alike (b = 0 gives the twin's 2**-127 here, not 0)
    _E2M1_BF16_STEP_FOLD = """
    and.b32 t, {r}, 0x70007000; shr.b32 t, t, 6; and.b32 u, {r}, 0x80008000; or.b32 u, u, t;
    mul.rn.bf16x2 ${out}, u, f;"""
    _E2M1_WORD_BF16_FOLD_ASM = tl.constexpr("""{
    .reg .b32 a, b, t, u, f;
    prmt.b32 a, $8, $9, 0x5410;
    prmt.b32 b, $8, $9, 0x7632;
    shl.b32 f, $10, 7; shl.b32 t, $11, 23; or.b32 f, f, t; add.u32 f, f, 0x3F003F00;""" + (
        "\n    shl.b32 a, a, 4; shl.b32 b, b, 4;".join(
            _E2M1_BF16_STEP_FOLD.format(r="a", out=t) + _E2M1_BF16_STEP_FOLD.format(r="b", out=t + 4)
            for t in (3, 2, 1, 0)) + "\n    }"))

    @triton.jit
    def e2m1_word_bf16(w, sb, ASM: tl.constexpr, FOLD: tl.constexpr = False):
        """int32 words of 8 codes and their scale bytes (int32, one per word) -> 8 bfloat16 tensors of weights
        (input 8i + t in the t-th), exact. ASM: the inline PTX above (FOLD: one product a weight pair, for scale
        bytes up to FOLD_MAX_SCALE only); otherwise ``e2m1_word`` times the scale, rounded to bfloat16 (exact
        too)."""
        if ASM:
            if FOLD:
                return tl.inline_asm_elementwise(_E2M1_WORD_BF16_FOLD_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
                                                 [w, sb], dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
            return tl.inline_asm_elementwise(_E2M1_WORD_BF16_ASM, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [w, sb],
                                             dtype=(tl.bfloat16,) * 8, is_pure=True, pack=2)
        else:
            o = e2m1_word(w, False)
            sc = (sb << 23).to(tl.float32, bitcast=True) * 16384.0  # 2**(b-127) * 2**14; b = 0 -> 0
            return ((o[0] * sc).to(tl.bfloat16), (o[1] * sc).to(tl.bfloat16), (o[2] * sc).to(tl.bfloat16),
                    (o[3] * sc).to(tl.bfloat16), (o[4] * sc).to(tl.bfloat16), (o[5] * sc).to(tl.bfloat16),
                    (o[6] * sc).to(tl.bfloat16), (o[7] * sc).to(tl.bfloat16))

    @triton.jit
    def split8(x):
        """x [..., 2, 2, 2], runs of 8 inputs (input 8i + 4u + 2v + w at [i, u, v, w]) -> the 8 strided runs
        [...] (the t-th holding inputs 8i + t), matching ``e2m1_word``'s tiles."""
        x_0, x_1 = tl.split(x)  # w
        x_00, x_01 = tl.split(x_0)  # v
        x_10, x_11 = tl.split(x_1)
        x0, x4 = tl.split(x_00)  # u
        x2, x6 = tl.split(x_01)
        x1, x5 = tl.split(x_10)
        x3, x7 = tl.split(x_11)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @triton.jit
    def _row_inputs(a, k0, K, BW: tl.constexpr, EVEN_K: tl.constexpr, JOIN: tl.constexpr):
        """One row's inputs k0 .. k0 + 8 BW in float32, as the 8 strided runs ``e2m1_word``'s tiles take, or with
        JOIN as [BW, 2, 2, 2] (input 8i + 4u + 2v + w at [i, u, v, w]), the layout ``join8`` gives the codes."""
        k = k0 + tl.arange(0, 8 * BW)
        x = (tl.load(a + k) if EVEN_K else tl.load(a + k, mask=k < K, other=0.0)).to(tl.float32)
        x = tl.reshape(x, [BW, 2, 2, 2])
        if JOIN:
            return x
        else:
            return split8(x)

    @triton.jit
    def join8(o):
        """``e2m1_word``'s 8 tiles [..., BW] as one [..., BW, 2, 2, 2] (code 4u + 2v + w of word i at [i, u, v, w]):
        the joined dimensions are each thread's own registers, so inputs in that layout meet their codes
        without being split into 8 strided runs first."""
        return tl.join(tl.join(tl.join(o[0], o[4]), tl.join(o[2], o[6])),
                       tl.join(tl.join(o[1], o[5]), tl.join(o[3], o[7])))

    @triton.jit
    def _tile_words(w_rows, s_rows, k0, K, i, g, n_ok, EVEN_K: tl.constexpr):
        """The codes of inputs k0 .. k0 + BLOCK_K for BLOCK_N outputs as int32 words [BLOCK_N, BW], and their
        scale bytes [BLOCK_N, G]; nothing past K (a prefetch past the last chunk loads nothing)."""
        if EVEN_K:
            k_ok = k0 < K
            words = tl.load(w_rows + (k0 // 8 + i)[None, :], mask=n_ok[:, None] & k_ok, other=0)
            sb = tl.load(s_rows + (k0 // 32 + g)[None, :], mask=n_ok[:, None] & k_ok, other=0)
        else:  # K is a multiple of 32 (expert_weights.check_fp4_shapes)
            words = tl.load(w_rows + (k0 // 8 + i)[None, :], mask=n_ok[:, None] & (k0 + 8 * i < K)[None, :], other=0)
            sb = tl.load(s_rows + (k0 // 32 + g)[None, :], mask=n_ok[:, None] & (k0 + 32 * g < K)[None, :], other=0)
        return words, sb

    @triton.jit
    def _decode_tile(words, sb, ASM: tl.constexpr, JOIN: tl.constexpr):
        """``_tile_words``' words decoded (8 tiles [BLOCK_N, BW], or joined, 2**-14 of the values) and the group
        scales [BLOCK_N, G] that undo the 2**-14."""
        sc = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0  # 2**(b-127) * 2**14; 0 -> 0
        o = e2m1_word(words, ASM)
        if JOIN:
            return join8(o), sc
        else:
            return o, sc

    @triton.jit
    def _word_dot(x, o, sc, BLOCK_N: tl.constexpr, BW: tl.constexpr, JOIN: tl.constexpr):
        """A row's split inputs ``x`` against the decoded words ``o``: the sum per group of 32 inputs (4 words),
        scaled by ``sc`` -> [BLOCK_N, BW / 4] (summed across groups, and so across threads, after the K loop)."""
        if JOIN:
            p = tl.reshape(o * x[None, :, :, :, :], [BLOCK_N, BW // 4, 32])
            return tl.sum(p, axis=2) * sc
        else:
            p = o[0] * x[0][None, :] + o[1] * x[1][None, :] + o[2] * x[2][None, :] + o[3] * x[3][None, :]
            p += o[4] * x[4][None, :] + o[5] * x[5][None, :] + o[6] * x[6][None, :] + o[7] * x[7][None, :]
            return tl.sum(tl.reshape(p, [BLOCK_N, BW // 4, 4]), axis=2) * sc

    @triton.jit
    def _gemv_out(acc, accu, ROW_W, row, limit, GATE_UP: tl.constexpr, CLAMP: tl.constexpr):
        """A row's outputs from its group sums: the product, or with GATE_UP the SwiGLU of the gate (``acc``) and
        up (``accu``) products times the row's routing weight, in float32."""
        y = tl.sum(acc, axis=1)
        if GATE_UP:
            y = swiglu_f32(y, tl.sum(accu, axis=1), limit, CLAMP) * tl.load(ROW_W + row)
        return y

    @triton.jit
    def _fp4_gemv_kernel(A, stride_am, ROWS, W, W3, stride_we, stride_wn, S, S3, stride_se, stride_sn, C, stride_cm,
                         BLOCK_EXPERT, ROW_W, limit, N, K, GATHER: tl.constexpr, GATE_UP: tl.constexpr,
                         CLAMP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, ASM: tl.constexpr, JOIN: tl.constexpr, PREFETCH: tl.constexpr,
                         PDL: tl.constexpr):
        """C[r] = A[row r] @ decode(W[e]).T for each valid row r of row block pid 0 (expert e), outputs of
        tile pid 1. W: the packed e2m1 bytes [E, N, K/2] read as int32 words [E, N, K/8]; S: their scale bytes
        [E, N, K/32]. GATE_UP: W3, S3 (w3, the same shape) too, and C[r] = SwiGLU(A W1, A W3) times ROW_W[r]
        (``swiglu.swiglu_f32``, the clamp at ``limit`` with CLAMP), from the float32 sums: both products of a
        row share its input loads, one launch instead of three. EVEN_K: K is a multiple of BLOCK_K, so no
        load is masked along K (masks that vary along the words keep the loads scalar). JOIN: the 8 decoded tiles
        joined into one (``join8``) against the inputs reshaped alike, instead of the inputs split in 8 runs. PREFETCH:
        each chunk's words and scale bytes load a chunk ahead (the module's PREFETCH)."""
        enter(PDL)
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + pid_m)
        if e < 0:
            return
        G: tl.constexpr = BLOCK_K // 32
        BW: tl.constexpr = BLOCK_K // 8
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        i = tl.arange(0, BW)
        g = tl.arange(0, G)
        w_off = e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        s_off = e.to(tl.int64) * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
        first = pid_m * BLOCK_M
        count = tl.sum((tl.load(ROWS + first + tl.arange(0, BLOCK_M)) >= 0).to(tl.int32), axis=0)
        for r in range(0, count, 2):  # two rows at a time: each decoded tile serves both
            two = r + 1 < count
            if GATHER:  # rows of A are tokens, picked through the sorted layout
                src0 = tl.load(ROWS + first + r)
                src1 = tl.load(ROWS + first + r + 1, mask=two, other=0)
            else:
                src0 = first + r
                src1 = first + r + 1
            a0 = A + src0.to(tl.int64) * stride_am
            a1 = A + src1.to(tl.int64) * stride_am
            acc0 = tl.zeros([BLOCK_N, G], dtype=tl.float32)
            acc1 = tl.zeros([BLOCK_N, G], dtype=tl.float32)
            accu0 = tl.zeros([BLOCK_N, G], dtype=tl.float32)  # GATE_UP: the up products
            accu1 = tl.zeros([BLOCK_N, G], dtype=tl.float32)
            if PREFETCH:  # each chunk's words load a chunk ahead (the first here): two chunks in flight
                words, sb = _tile_words(W + w_off, S + s_off, 0, K, i, g, n_ok, EVEN_K)
                if GATE_UP:
                    words3, sb3 = _tile_words(W3 + w_off, S3 + s_off, 0, K, i, g, n_ok, EVEN_K)
            for k0 in range(0, K, BLOCK_K):
                if PREFETCH:
                    nxt, nxt_sb = _tile_words(W + w_off, S + s_off, k0 + BLOCK_K, K, i, g, n_ok, EVEN_K)
                    if GATE_UP:
                        nxt3, nxt_sb3 = _tile_words(W3 + w_off, S3 + s_off, k0 + BLOCK_K, K, i, g, n_ok, EVEN_K)
                else:
                    words, sb = _tile_words(W + w_off, S + s_off, k0, K, i, g, n_ok, EVEN_K)
                    if GATE_UP:
                        words3, sb3 = _tile_words(W3 + w_off, S3 + s_off, k0, K, i, g, n_ok, EVEN_K)
                o, sc = _decode_tile(words, sb, ASM, JOIN)
                x0 = _row_inputs(a0, k0, K, BW, EVEN_K, JOIN)
                acc0 += _word_dot(x0, o, sc, BLOCK_N, BW, JOIN)
                if GATE_UP:
                    o3, sc3 = _decode_tile(words3, sb3, ASM, JOIN)
                    accu0 += _word_dot(x0, o3, sc3, BLOCK_N, BW, JOIN)
                if two:
                    x1 = _row_inputs(a1, k0, K, BW, EVEN_K, JOIN)
                    acc1 += _word_dot(x1, o, sc, BLOCK_N, BW, JOIN)
                    if GATE_UP:
                        accu1 += _word_dot(x1, o3, sc3, BLOCK_N, BW, JOIN)
                if PREFETCH:
                    words, sb = nxt, nxt_sb
                    if GATE_UP:
                        words3, sb3 = nxt3, nxt_sb3
            y0 = _gemv_out(acc0, accu0, ROW_W, first + r, limit, GATE_UP, CLAMP)
            tl.store(C + (first + r).to(tl.int64) * stride_cm + offs_n, y0.to(C.dtype.element_ty), mask=n_ok)
            if two:
                y1 = _gemv_out(acc1, accu1, ROW_W, first + r + 1, limit, GATE_UP, CLAMP)
                tl.store(C + (first + r + 1).to(tl.int64) * stride_cm + offs_n, y1.to(C.dtype.element_ty),
                         mask=n_ok)

    def _launch(a, rows, w, scale, block_expert, gather: bool, m_pad: int, block_m: int, config: dict | None,
                blocks: int | None, w3=None, scale3=None, limit: float = 0.0, row_weight=None):
        E, n, half_k = w.shape
        gate_up = w3 is not None
        nb = m_pad // block_m if blocks is None else blocks
        c = dict(gate_up_config(nb, E) if gate_up else GEMV_CONFIG, **(config or {}))
        if c["BLOCK_K"] % 32:
            raise ValueError(f"packed FP4 weights need BLOCK_K a multiple of 32, got {c['BLOCK_K']}")
        out = torch.empty(nb * block_m if gate_up else m_pad, n, dtype=a.dtype, device=a.device)
        words = as_words(w)
        words3 = as_words(w3) if gate_up else words
        if gate_up and (w3.shape != w.shape or scale3.stride() != scale.stride() or words3.stride() != words.stride()):
            raise ValueError(f"fp4_gemv_gate_up: w1 {tuple(w.shape)} and w3 {tuple(w3.shape)} need one shape and"
                             " layout (the kernel indexes both alike)")
        _fp4_gemv_kernel[(nb, triton.cdiv(n, c["BLOCK_N"]))](
            a, a.stride(0), rows, words, words3, words.stride(0), words.stride(1), scale,
            scale3 if gate_up else scale, scale.stride(0), scale.stride(1), out, out.stride(0), block_expert,
            row_weight.float().contiguous() if gate_up else out, float(limit), n, 2 * half_k, GATHER=gather,
            GATE_UP=gate_up, CLAMP=limit > 0, BLOCK_M=block_m, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
            EVEN_K=2 * half_k % c["BLOCK_K"] == 0, ASM=use_asm(a), JOIN=c["JOIN"],
            PREFETCH=c.get("PREFETCH", PREFETCH), num_warps=c["num_warps"],
            num_stages=c["num_stages"], **pdl.args())
        return out

    def fp4_gemv(a: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                 block_expert: torch.Tensor, gather: bool, m_pad: int, block_m: int,
                 config: dict | None = None, blocks: int | None = None) -> torch.Tensor:
        """out [m_pad, n] (sorted layout; only valid rows written) = a[rows] @ decode(w[e]).T per row block, as
        ``moe._grouped_gemm(..., scale=scale, blocks=blocks)``. ``config``: GEMV_CONFIG's keys
        (bench/fp4_gemv_gpu.py)."""
        return _launch(a, rows, w, scale, block_expert, gather, m_pad, block_m, config, blocks)

    def fp4_gemv_gate_up(a: torch.Tensor, rows: torch.Tensor, w1: torch.Tensor, s1: torch.Tensor, w3: torch.Tensor,
                         s3: torch.Tensor, block_expert: torch.Tensor, m_pad: int, block_m: int, limit: float,
                         row_weight: torch.Tensor, config: dict | None = None,
                         blocks: int | None = None) -> torch.Tensor:
        """h [blocks * block_m, I] (sorted layout; valid rows written) = SwiGLU(a[rows] @ w1[e].T,
        a[rows] @ w3[e].T) times row_weight, rounded once to a's dtype: the three launches of the grouped
        experts' first half in one. ``config``: GEMV_CONFIG_GATE_UP's keys. Its twin is ``moe.gate_up_torch``."""
        return _launch(a, rows, w1, s1, block_expert, True, m_pad, block_m, config, blocks, w3, s3, limit,
                       row_weight)
