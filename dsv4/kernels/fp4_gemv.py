"""Packed FP4 experts at decode sizes: the grouped product as one GEMV per row, on the CUDA cores.

At a decode step an expert sees one or two of the step's rows, and the grouped GEMM (``moe._grouped_gemm``)
pads each expert's rows to a tensor-core tile of 16 and rebuilds every weight tile in registers in the dot's
layout: it reads the packed bytes at a few percent of the bandwidth. Here a program owns BLOCK_N outputs of one
expert's row block and runs over its valid rows (a prefix of the block in the sorted layout, ``moe.align``): per
pair of rows, the codes of BLOCK_K inputs for each output are one contiguous load, decoded to float32
(``e2m1_f16``: a few integer ops and one conversion), the low nibbles multiplied by the even inputs and the high
ones by the odd inputs, summed per group of 32 and scaled by the group's e8m0 byte (a power of two), in float32.
(A form that scaled each decoded code and accumulated element-wise, reducing once at the end, measured 10-20%
slower.)
A block's third and later rows read its expert's tiles again, from L2.
Rows of the block past its valid ones are not written (nothing reads them: the combine and the SwiGLU's valid
rows take only valid rows). The twin is ``moe._grouped_gemm_torch`` (the weights decoded by ``fp4.unpack_fp4``).

``moe.grouped_experts`` takes this path when the step's (token, choice) pairs average at most
GEMV_MAX_ROWS_PER_EXPERT per expert, and never under batch invariance (one path whatever the batch).
"""

from __future__ import annotations

import torch

from . import HAVE_TRITON

GEMV_MAX_ROWS_PER_EXPERT = 1  # pairs per expert, on average, up to which the GEMV path runs
GEMV_CONFIG = {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3, "CONTIG_A": True}  # BLOCK_K: 32s


def use_gemv(num_pairs: int, num_experts: int, invariant: bool) -> bool:
    return not invariant and num_pairs <= GEMV_MAX_ROWS_PER_EXPERT * num_experts


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def e2m1_f16(nib):
        """e2m1 codes (int32 nibbles s|e1e0|m) -> 2**-14 times their values (the kernels scale each
        group's sum back by 2**14 with its scale), as float16:
        the sign to bit 15, e1 e0 m to bits 11-9 (the exponent field's low two bits and the mantissa's top one),
        so e > 0 reads 2**(e-15) * (1 + m/2) and e = 0 the subnormal m/2 * 2**-14. Exact, five integer ops; the
        twin is ``fp4.unpack_fp4``."""
        bits = ((nib & 8) << 12) | ((nib & 7) << 9)
        return bits.to(tl.int16).to(tl.float16, bitcast=True)

    @triton.jit
    def _inputs(a, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, CONTIG_A: tl.constexpr):
        """A row's inputs k0 .. k0 + BLOCK_K as (even, odd) halves in float32, loaded as one contiguous run
        and split (CONTIG_A) or as two strided loads."""
        HALF: tl.constexpr = BLOCK_K // 2
        if CONTIG_A:
            k = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(a + k) if EVEN_K else tl.load(a + k, mask=k < K, other=0.0)
            even, odd = tl.split(tl.reshape(x.to(tl.float32), [HALF, 2]))
        else:
            k = k0 + 2 * tl.arange(0, HALF)
            even = (tl.load(a + k) if EVEN_K else tl.load(a + k, mask=k < K, other=0.0)).to(tl.float32)
            odd = (tl.load(a + k + 1) if EVEN_K else tl.load(a + k + 1, mask=k < K, other=0.0)).to(tl.float32)
        return even, odd

    @triton.jit
    def _fp4_gemv_kernel(A, stride_am, ROWS, W, stride_we, stride_wn, S, stride_se, stride_sn, C, stride_cm,
                         BLOCK_EXPERT, N, K, GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, CONTIG_A: tl.constexpr):
        """C[r] = A[row r] @ decode(W[e]).T for each valid row r of row block pid 0 (expert e), outputs of
        tile pid 1. W: packed e2m1 bytes [E, N, K/2]; S: their scale bytes [E, N, K/32]. EVEN_K: K is a
        multiple of BLOCK_K, so no load is masked along K (masks that vary per byte keep loads scalar)."""
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
        e = tl.load(BLOCK_EXPERT + pid_m)
        if e < 0:
            return
        G: tl.constexpr = BLOCK_K // 32
        HALF: tl.constexpr = BLOCK_K // 2
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        j = tl.arange(0, HALF)  # byte j of a chunk: inputs 2j (low nibble) and 2j + 1 (high nibble)
        g = tl.arange(0, G)
        w_rows = W + e.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn
        s_rows = S + e.to(tl.int64) * stride_se + offs_n.to(tl.int64)[:, None] * stride_sn
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
            acc0 = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                if EVEN_K:
                    codes = tl.load(w_rows + (k0 // 2 + j)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
                    sb = tl.load(s_rows + (k0 // 32 + g)[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
                else:  # K is a multiple of 32 (expert_weights.check_fp4_shapes)
                    k_ok = k0 + 2 * j < K
                    codes = tl.load(w_rows + (k0 // 2 + j)[None, :], mask=n_ok[:, None] & k_ok[None, :],
                                    other=0).to(tl.int32)
                    g_ok = k0 + 32 * g < K
                    sb = tl.load(s_rows + (k0 // 32 + g)[None, :], mask=n_ok[:, None] & g_ok[None, :],
                                 other=0).to(tl.int32)
                lo = e2m1_f16(codes & 0xF).to(tl.float32)
                hi = e2m1_f16(codes >> 4).to(tl.float32)
                sc = (sb << 23).to(tl.float32, bitcast=True) * 16384.0  # 2**(b-127) * 2**14; b = 0 -> 0
                a_even, a_odd = _inputs(a0, k0, K, BLOCK_K, EVEN_K, CONTIG_A)
                p = lo * a_even[None, :] + hi * a_odd[None, :]
                acc0 += tl.sum(tl.sum(tl.reshape(p, [BLOCK_N, G, 16]), axis=2) * sc, axis=1)  # per 32 inputs
                if two:
                    a_even, a_odd = _inputs(a1, k0, K, BLOCK_K, EVEN_K, CONTIG_A)
                    p = lo * a_even[None, :] + hi * a_odd[None, :]
                    acc1 += tl.sum(tl.sum(tl.reshape(p, [BLOCK_N, G, 16]), axis=2) * sc, axis=1)
            tl.store(C + (first + r).to(tl.int64) * stride_cm + offs_n, acc0.to(C.dtype.element_ty), mask=n_ok)
            tl.store(C + (first + r + 1).to(tl.int64) * stride_cm + offs_n, acc1.to(C.dtype.element_ty),
                     mask=n_ok & two)

    def fp4_gemv(a: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                 block_expert: torch.Tensor, gather: bool, m_pad: int, block_m: int,
                 config: dict | None = None) -> torch.Tensor:
        """out [m_pad, n] (sorted layout; only valid rows written) = a[rows] @ decode(w[e]).T per row block, as
        ``moe._grouped_gemm(..., scale=scale)``. ``config``: GEMV_CONFIG's keys (bench/fp4_gemv_gpu.py)."""
        E, n, half_k = w.shape
        c = dict(GEMV_CONFIG, **(config or {}))
        if c["BLOCK_K"] % 32:
            raise ValueError(f"packed FP4 weights need BLOCK_K a multiple of 32, got {c['BLOCK_K']}")
        out = torch.empty(m_pad, n, dtype=a.dtype, device=a.device)
        grid = (m_pad // block_m, triton.cdiv(n, c["BLOCK_N"]))
        _fp4_gemv_kernel[grid](a, a.stride(0), rows, w, w.stride(0), w.stride(1), scale, scale.stride(0),
                               scale.stride(1), out, out.stride(0), block_expert, n, 2 * half_k, GATHER=gather,
                               BLOCK_M=block_m, BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                               EVEN_K=2 * half_k % c["BLOCK_K"] == 0, CONTIG_A=c["CONTIG_A"],
                               num_warps=c["num_warps"], num_stages=c["num_stages"])
        return out
