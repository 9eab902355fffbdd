"""Functional building blocks of DeepSeek-V4, shared by the dense reference path and the cached engine path.

Everything here is plain torch on whatever device the inputs live on. Shapes use
N = tokens, H = attention heads, D = head dim, G = key groups, Tq = queries per key group, K = keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import kernels
from ..kernels import norm as norm_kernel
from ..kernels import rope as rope_kernel
from ..kernels.fp8 import store_rows
from ..kernels.indexer import index_scores  # noqa: F401  (the twins live beside their kernels)
from ..kernels.moe import add_to  # noqa: F401
from ..kernels.sparse_attention import sink_attention  # noqa: F401
from ..kernels.swiglu import swiglu, swiglu_to  # noqa: F401


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, result in x's dtype. ``weight=None`` is the unweighted variant."""
    if x.is_cuda:  # one kernel instead of six; the lines below are its twin
        if kernels.on(x):
            return norm_kernel.rms_norm(x, weight, eps)
        w = weight.float() if weight is not None else None
        return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)
    xf = x.float()
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


# ---- RoPE on the trailing rope_dim channels, interleaved (GPT-J) pairs --------------------------
def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of angle position * inv_freq: [..., rope_dim/2] fp32."""
    ang = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device, torch.float32)
    return ang.cos(), ang.sin()


class Rope:
    """The RoPE angles of N rows: position * table, positions [N] (integers), table [R/2] fp32 (a layer's
    ``inv_freq``). The kernels compute the angles' cos/sin themselves from these two; the torch lines take
    ``cos_sin()``, computed on first use and kept (a step's rope is shared by its layers, ``step_rope``)."""

    __slots__ = ("table", "positions", "_cos_sin")

    def __init__(self, table: torch.Tensor, positions: torch.Tensor):
        self.table, self.positions, self._cos_sin = table, positions, None

    @property
    def half(self) -> int:
        """R/2: rotated pairs per row."""
        return self.table.shape[-1]

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, R/2] fp32 (``rope_cos_sin``)."""
        if self._cos_sin is None:
            self._cos_sin = rope_cos_sin(self.table, self.positions)
        return self._cos_sin


def apply_rope(x: torch.Tensor, rope: Rope, inverse: bool = False, in_place: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*rope.half channels of x (pairs (2i, 2i+1)) by the rows' angles; ``inverse`` uses
    -angle. ``in_place``: the caller gives x up, and the kernel may rotate it where it lies (reading and writing
    the rope channels only); use the returned tensor either way.

    x: [N, ..., D] (the angles broadcast over the middle dims). On CUDA one Triton kernel does it
    (``dsv4.kernels.rope``, angles included); the lines below are its twin.
    """
    if x.is_cuda and rope_kernel.usable(x, rope.table, rope.positions):
        return rope_kernel.apply_rope(x, rope.table, rope.positions, inverse, in_place)
    cos, sin = rope.cos_sin()
    half = rope.half
    nope, rot = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    while cos.dim() < rot.dim():  # [N, R/2] -> [N, 1.., R/2]
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    pairs = rot.float().unflatten(-1, (half, 2))  # [..., R/2, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, rope: Rope,
                  out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None,
                  out_scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """``apply_rope(rms_norm(x, weight, eps), rope)``: one kernel on CUDA (``dsv4.kernels.norm``, angles
    included); the composition is its twin. Given ``out`` [R, D] and ``out_rows`` [N] (a cache's rows and where
    this step's go; ``out_scale``: an FP8 cache's scales), it returns nothing and stores row i at
    ``out[out_rows[i]]`` as the cache stores rows (``kernels.fp8.store_rows``): on CUDA the kernel's own
    stores, with no scatter, cast or quantisation after it."""
    if x.is_cuda and norm_kernel.rope_usable(x, rope.table, rope.positions) and (
            out is None or norm_kernel.scatter_usable(x, out, out_rows, out_scale)):
        return norm_kernel.rms_norm_rope(x, weight, eps, rope.table, rope.positions, out, out_rows, out_scale)
    y = apply_rope(rms_norm(x, weight, eps), rope)
    if out is None:
        return y
    store_rows(out, out_scale, out_rows, y)
    return None


def pool_windows(kv: torch.Tensor, score: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Gated pooling of compressor windows: per channel, softmax over the slots of a window.

    kv, score: [M, S, C] fp32 (score already includes the ape bias); valid: [M, S] bool or None.
    Returns [M, C] = sum_s softmax_s(score)[s, c] * kv[s, c]. Invalid slots get weight 0.
    """
    score = score.float()
    if valid is not None:
        score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
        kv = torch.where(valid.unsqueeze(-1), kv, torch.zeros_like(kv))
    pooled = (torch.softmax(score, dim=1) * kv.float()).sum(dim=1)
    if valid is not None:  # a window with no valid slot (a padded row) pools to zeros, not NaN
        pooled = torch.where(valid.any(1, keepdim=True), pooled, torch.zeros_like(pooled))
    return pooled


def topk_mask(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """Select the top-k visible entries per query: [G, Tq, E] scores + visibility -> selection mask."""
    E = scores.shape[-1]
    if E == 0:
        return visible
    k = min(k, E)
    masked = scores.masked_fill(~visible, float("-inf"))
    idx = masked.topk(k, dim=-1).indices
    sel = torch.zeros_like(visible).scatter_(-1, idx, True)
    return sel & visible  # surplus picks of queries with fewer than k visible entries are dropped
