"""SwiGLU in one kernel: silu(min(gate, L)) * clamp(up, -L, L), times an optional per-row weight, rounded once
to the output dtype (in torch: two conversions, two clamps, silu, two products and a conversion). ``swiglu_to``
runs it on CUDA; its other branch is the plain-torch twin."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import HAVE_TRITON, on, pdl

BLOCK = 1024

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter

    @triton.jit
    def swiglu_f32(g, u, limit, CLAMP: tl.constexpr):
        """silu(min(g, L)) * clamp(u, -L, L) of float32 tensors (CLAMP False: no clamp), as ``swiglu``."""
        if CLAMP:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        return g / (1.0 + tl.exp(-g)) * u

    @triton.jit
    def _swiglu_kernel(G, U, W, OUT, cols, stride_g, stride_u, limit, HAS_W: tl.constexpr,
                       CLAMP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        r, cb = tl.program_id(0), tl.program_id(1)
        c = cb * BLOCK + tl.arange(0, BLOCK)
        m = c < cols
        g = tl.load(G + r * stride_g + c, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + r * stride_u + c, mask=m, other=0.0).to(tl.float32)
        h = swiglu_f32(g, u, limit, CLAMP)
        if HAS_W:
            h = h * tl.load(W + r)
        tl.store(OUT + r * cols + c, h.to(OUT.dtype.element_ty), mask=m)


def _swiglu_to_kernel(gate: torch.Tensor, up: torch.Tensor, limit: float, row_weight: torch.Tensor | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """gate, up: [R, I] (unit stride along I); row_weight: [R] fp32 or None -> [R, I] in ``dtype``."""
    R, cols = gate.shape
    out = torch.empty(R, cols, dtype=dtype, device=gate.device)
    w = row_weight.float().contiguous() if row_weight is not None else out  # unused pointer without weights
    if R and cols:
        _swiglu_kernel[(R, triton.cdiv(cols, BLOCK))](gate, up, w, out, cols, gate.stride(0), up.stride(0),
                                                       float(limit), HAS_W=row_weight is not None,
                                                       CLAMP=limit > 0, BLOCK=BLOCK, num_warps=4, **pdl.args())
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L) in fp32 (limit <= 0 disables the clamp)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def swiglu_to(gate: torch.Tensor, up: torch.Tensor, limit: float, row_weight: torch.Tensor | None,
              dtype: torch.dtype) -> torch.Tensor:
    """``swiglu`` times an optional per-row weight [R], rounded once to ``dtype``: [R, I]. On CUDA one Triton
    kernel does it (``_swiglu_to_kernel``); the lines below are its twin."""
    if on(gate) and gate.dim() == 2 and gate.stride(-1) == 1 and up.stride(-1) == 1:
        return _swiglu_to_kernel(gate, up, limit, row_weight, dtype)
    h = swiglu(gate, up, limit)
    if row_weight is not None:
        h = h * row_weight.float()[:, None]
    return h.to(dtype)
