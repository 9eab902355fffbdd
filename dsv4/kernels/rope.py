"""RoPE on the trailing rope channels (interleaved pairs) in one kernel: the plain-torch twin is
``dsv4.model.ops.apply_rope``'s body (a dozen small ops: float, four products, sub, add, stack, cat, to).
The kernel does the same fp32 arithmetic without fused multiply-adds, so it matches the twin exactly."""

from __future__ import annotations

import torch

from . import HAVE_TRITON, enabled

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rope_kernel(X, COS, SIN, OUT, Hm, stride_xn, stride_xh, stride_on, stride_oh, stride_cn,
                     D: tl.constexpr, R: tl.constexpr, DP: tl.constexpr, BLOCK_H: tl.constexpr,
                     INVERSE: tl.constexpr):
        n = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        c = tl.arange(0, DP)
        m = (h < Hm)[:, None] & (c < D)[None, :]
        in_rope = (c >= D - R) & (c < D)
        row = X + n * stride_xn + h[:, None] * stride_xh
        x = tl.load(row + c[None, :], mask=m, other=0.0).to(tl.float32)
        xp = tl.load(row + (c ^ 1)[None, :], mask=m & in_rope[None, :], other=0.0).to(tl.float32)
        j = tl.where(in_rope, (c - (D - R)) // 2, 0)
        cs = tl.load(COS + n * stride_cn + j, mask=in_rope, other=1.0)[None, :]
        sn = tl.load(SIN + n * stride_cn + j, mask=in_rope, other=0.0)[None, :]
        if INVERSE:
            sn = -sn
        even = ((c % 2) == 0)[None, :]
        # pair (a, b) = (x[2i], x[2i+1]): even channel a*cos - b*sin, odd channel a*sin + b*cos
        rot = tl.where(even, x * cs - xp * sn, xp * sn + x * cs)
        y = tl.where(in_rope[None, :], rot, x)
        tl.store(OUT + n * stride_on + h[:, None] * stride_oh + c[None, :], y.to(OUT.dtype.element_ty), mask=m)


def usable(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """The kernel's case: CUDA (or Triton's interpreter), x [N, ..., D] and cos/sin [N, R/2] with an even
    nope width, so pairs are (even, odd) channels."""
    if not enabled() or cos.dim() != 2 or x.dim() < 2 or x.shape[0] != cos.shape[0] or x.numel() == 0:
        return False  # (an empty x, e.g. a step that closes no compressor window, takes the torch lines)
    return (x.shape[-1] - 2 * cos.shape[-1]) % 2 == 0 and cos.dtype == torch.float32


def rows_by_head(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x [N, ..., D] as [N, Hm, D] with unit stride along D, cos/sin contiguous, and an empty output of that
    shape: the launch arguments of this kernel and of the fused norm + rope (``dsv4.kernels.norm``)."""
    x3 = x.reshape(x.shape[0], -1, x.shape[-1])
    if x3.stride(-1) != 1:
        x3 = x3.contiguous()
    return x3, cos.contiguous(), sin.contiguous(), torch.empty(x3.shape, dtype=x.dtype, device=x.device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    N, D, R = x.shape[0], x.shape[-1], 2 * cos.shape[-1]
    x3, cos, sin, out = rows_by_head(x, cos, sin)
    Hm = x3.shape[1]
    DP = triton.next_power_of_2(D)
    BLOCK_H = max(1, min(triton.next_power_of_2(max(Hm, 1)), 4096 // DP))
    if N and Hm:
        _rope_kernel[(N, triton.cdiv(Hm, BLOCK_H))](
            x3, cos, sin, out, Hm, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), cos.stride(0),
            D=D, R=R, DP=DP, BLOCK_H=BLOCK_H, INVERSE=inverse, enable_fp_fusion=False)
    return out.view(x.shape)
