"""RMSNorm in one kernel: fp32 statistics and scaling, one rounding to the input dtype. The plain-torch twin
is the CPU branch of ``dsv4.model.ops.rms_norm`` (float, square, mean, rsqrt, two products, to)."""

from __future__ import annotations

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(X, W, OUT, stride_x, stride_o, d, eps, HAS_W: tl.constexpr, DP: tl.constexpr):
        r = tl.program_id(0)
        c = tl.arange(0, DP)
        m = c < d
        x = tl.load(X + r * stride_x + c, mask=m, other=0.0).to(tl.float32)
        y = x * (1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / d + eps))
        if HAS_W:
            y = tl.load(W + c, mask=m, other=0.0).to(tl.float32) * y
        tl.store(OUT + r * stride_o + c, y.to(OUT.dtype.element_ty), mask=m)


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
                                         HAS_W=weight is not None, DP=DP, num_warps=8 if DP >= 2048 else 4)
    return out.view(x.shape)
