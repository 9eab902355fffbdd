"""RMSNorm in one kernel: fp32 statistics and scaling, one rounding to the input dtype. The plain-torch twin
is the CPU branch of ``dsv4.model.ops.rms_norm`` (float, square, mean, rsqrt, two products, to).

``rms_norm_rope`` fuses the RoPE that follows every norm of a key or query (q per head, the K=V head, the
compressors' entries): the normed row is rounded to the input dtype, then rotated in fp32 like
``dsv4.kernels.rope`` (angles computed in the kernel, no fused multiply-adds), then rounded again; its twin is
``apply_rope(rms_norm(x, w, eps), rope)``. It can store its rows straight into a cache's rows (``out_rows``),
which saves the scatter and the cast that would follow it. A row is loaded and stored contiguously and split into
its pairs' even and odd halves in registers (``tl.split`` / ``tl.join``), so a pair's partner is at hand."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, pdl
from .fp8 import FP8, FP8_BLOCK
from .rope import angles_fit, rows_by_head

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter
    from .rope import angle_inputs, cos_sin

    @triton.jit
    def _rms_norm_kernel(X, W, OUT, stride_x, stride_o, d, eps, HAS_W: tl.constexpr, DP: tl.constexpr,
                         PDL: tl.constexpr):
        enter(PDL)
        r = tl.program_id(0)
        c = tl.arange(0, DP)
        m = c < d
        x = tl.load(X + r * stride_x + c, mask=m, other=0.0).to(tl.float32)
        if HAS_W:  # loaded with x, not after the sum: one round trip to memory
            w = tl.load(W + c, mask=m, other=0.0).to(tl.float32)
        y = x * (1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / d + eps))
        if HAS_W:
            y = w * y
        tl.store(OUT + r * stride_o + c, y.to(OUT.dtype.element_ty), mask=m)


    @triton.jit
    def norm_rope_halves(x, wa, wb, pos, freq, in_rope, eps, D: tl.constexpr, HAS_W: tl.constexpr,
                         BLOCK_H: tl.constexpr):
        """Rows x [BLOCK_H, D] RMS-normed in fp32 (times the weight's even and odd halves wa, wb with HAS_W) and
        rounded to x's dtype, then each pair (2i, 2i+1) where ``in_rope`` [D/2] rotated by pos * freq in fp32 ->
        the pairs' even and odd halves [BLOCK_H, D/2] in fp32, which the caller rounds to x's dtype as the twin's
        rows are. The fused norm + rope's steps, which the attention's prologue takes too (``sparse_attention``,
        its raw q)."""
        a, b = tl.split(tl.reshape(x.to(tl.float32), (BLOCK_H, D // 2, 2)))
        cs, sn = cos_sin(pos, freq, in_rope)
        cs, sn = cs[None, :], sn[None, :]
        rstd = 1.0 / tl.sqrt_rn((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / D + eps)
        a = a * rstd[:, None]
        b = b * rstd[:, None]
        if HAS_W:
            a = wa.to(tl.float32)[None, :] * a
            b = wb.to(tl.float32)[None, :] * b
        a = a.to(x.dtype).to(tl.float32)  # the norm's rounding, as in the two-kernel path
        b = b.to(x.dtype).to(tl.float32)
        ra = tl.where(in_rope[None, :], a * cs - b * sn, a)
        rb = tl.where(in_rope[None, :], a * sn + b * cs, b)
        return ra, rb

    @triton.jit
    def _rms_norm_rope_kernel(X, W, POS, FREQ, OUT, ROWS, SCALE, Hm, stride_xn, stride_xh, stride_on, stride_oh,
                              eps, D: tl.constexpr, R: tl.constexpr, HAS_W: tl.constexpr, BLOCK_H: tl.constexpr,
                              SCATTER: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        n = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        c = tl.arange(0, D)
        i = tl.arange(0, D // 2)  # pair (2i, 2i+1)
        m = (h < Hm)[:, None]
        # the row loaded contiguously (vector loads), then split into its pairs' halves in registers
        x = tl.load(X + n * stride_xn + h[:, None] * stride_xh + c[None, :], mask=m, other=0.0)
        # the weights and the angles' inputs loaded with x, before any sum or broadcast: one round trip
        in_rope = i >= (D - R) // 2
        j = tl.where(in_rope, i - (D - R) // 2, 0)
        pos, freq = angle_inputs(POS, FREQ, n, j, in_rope)
        wa, wb = pos, pos  # (unused without a weight)
        if HAS_W:
            wa, wb = tl.split(tl.reshape(tl.load(W + c), (D // 2, 2)))
        ra, rb = norm_rope_halves(x, wa, wb, pos, freq, in_rope, eps, D, HAS_W, BLOCK_H)
        if SCATTER:  # row n goes to OUT[ROWS[n]] (a cache's rows, in its dtype)
            dst = OUT + tl.load(ROWS + n).to(tl.int64) * stride_on + h[:, None] * stride_oh + c[None, :]
        else:
            dst = OUT + n * stride_on + h[:, None] * stride_oh + c[None, :]
        # rounded to x's dtype, as the twin's rows; then, stored in a cache of another dtype, to that one
        ra = ra.to(X.dtype.element_ty).to(tl.float32)
        rb = rb.to(X.dtype.element_ty).to(tl.float32)
        if FP8:  # an FP8 cache (kernels.fp8.quantize_fp8): e4m3 values and one scale per 64 channels (32 pairs)
            NB: tl.constexpr = D // 64
            amax = tl.maximum(tl.max(tl.reshape(tl.abs(ra), (BLOCK_H, NB, 32)), axis=2),
                              tl.max(tl.reshape(tl.abs(rb), (BLOCK_H, NB, 32)), axis=2))  # [BLOCK_H, NB]
            sc = tl.div_rn(amax, 448.0)
            tl.store(SCALE + tl.load(ROWS + n).to(tl.int64) * NB + h[:, None] * NB + tl.arange(0, NB)[None, :], sc,
                     mask=m)
            div = tl.reshape(tl.broadcast_to(tl.maximum(sc, 1.1754943508222875e-38)[:, :, None], (BLOCK_H, NB, 32)),
                             (BLOCK_H, D // 2))
            ra = tl.minimum(tl.maximum(tl.div_rn(ra, div), -448.0), 448.0)
            rb = tl.minimum(tl.maximum(tl.div_rn(rb, div), -448.0), 448.0)
        y = tl.reshape(tl.join(ra, rb), (BLOCK_H, D))  # the pairs interleaved again: contiguous stores
        tl.store(dst, y.to(OUT.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    DP = triton.next_power_of_2(d)
    w = weight.contiguous() if weight is not None else x2  # x2: an unused pointer when there is no weight
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, w, out, x2.stride(0), out.stride(0), d, eps,
                                         HAS_W=weight is not None, DP=DP, num_warps=8 if DP >= 2048 else 4,
                                         **pdl.args())
    return out.view(x.shape)


def rope_usable(x: torch.Tensor, table: torch.Tensor, positions: torch.Tensor) -> bool:
    """The fused kernel's case: x [N, ..., D] with D a power of two, positions [N] integers, a float32 table
    [R/2]."""
    D = x.shape[-1] if x.dim() else 0
    return angles_fit(x, table, positions) and x.numel() > 0 and D >= 2 and D & (D - 1) == 0


def scatter_usable(x: torch.Tensor, out: torch.Tensor, out_rows: torch.Tensor,
                   out_scale: torch.Tensor | None = None) -> bool:
    """``rms_norm_rope(..., out, out_rows, out_scale)``'s case: x [N, D] rows stored to rows of out [R, D] (unit
    stride along D, a float dtype) given by out_rows [N] integers on x's device; with ``out_scale`` an FP8
    cache's (e4m3 out, float32 scales [R, D/64], D a multiple of 64)."""
    ok = (x.dim() == 2 and out.dim() == 2 and out.shape[1] == x.shape[1] and out.stride(1) == 1
          and out_rows.dim() == 1 and out_rows.shape[0] == x.shape[0] and not out_rows.is_floating_point()
          and out.device == out_rows.device == x.device)
    if out_scale is None:
        return ok and out.dtype in (torch.float32, torch.bfloat16, torch.float16)
    return (ok and out.dtype == FP8 and x.shape[1] % FP8_BLOCK == 0 and out_scale.dtype == torch.float32
            and out_scale.is_contiguous() and out_scale.shape == (out.shape[0], x.shape[1] // FP8_BLOCK)
            and out_scale.device == x.device)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, table: torch.Tensor,
                  positions: torch.Tensor, out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None,
                  out_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """The normed, roped rows; or, given ``out`` and ``out_rows`` (``scatter_usable``), nothing: row i is
    stored to ``out[out_rows[i]]`` as ``kernels.fp8.store_rows`` stores it (in out's dtype, one rounding of the
    row; with ``out_scale``, FP8 values and their scales). Rows that repeat in out_rows (padding's null row)
    hold, element by element, one of their values (nothing reads them)."""
    N, D = x.shape[0], x.shape[-1]
    x3, table, positions, res = rows_by_head(x, table, positions, alloc_out=out is None)
    Hm = x3.shape[1]
    BLOCK_H = max(1, min(triton.next_power_of_2(Hm), 4096 // D))
    w = weight.contiguous() if weight is not None else x3
    dst, rows = (res, x3) if out is None else (out, out_rows.contiguous())  # x3: an unused pointer
    _rms_norm_rope_kernel[(N, triton.cdiv(Hm, BLOCK_H))](
        x3, w, positions, table, dst, rows, x3 if out_scale is None else out_scale, Hm, x3.stride(0),
        x3.stride(1), dst.stride(0), res.stride(1) if out is None else 0, eps, D=D, R=2 * table.shape[-1],
        HAS_W=weight is not None, BLOCK_H=BLOCK_H, SCATTER=out is not None, FP8=out_scale is not None,
        enable_fp_fusion=False, num_warps=4 if BLOCK_H * D <= 2048 else 8, **pdl.args())
    return res.view(x.shape) if out is None else None
