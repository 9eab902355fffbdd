"""Functional building blocks of DeepSeek-V4, shared by the dense reference path and the cached engine path.

Everything here is plain torch on whatever device the inputs live on. Shapes use
N = tokens, H = attention heads, D = head dim, G = key groups, Tq = queries per key group, K = keys.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import norm as norm_kernel
from ..kernels import rope as rope_kernel
from ..kernels import swiglu as swiglu_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, result in x's dtype. ``weight=None`` is the unweighted variant."""
    if x.is_cuda:  # one kernel instead of six; the lines below are its twin
        if norm_kernel.HAVE_TRITON:
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing 2*cos.shape[-1] channels of x (pairs (2i, 2i+1)); ``inverse`` uses -angle.

    x: [N, ..., D]; cos/sin: [N, R/2] (broadcast over the middle dims). On CUDA one Triton kernel does it
    (``dsv4.kernels.rope``); the lines below are its twin.
    """
    if x.is_cuda and rope_kernel.usable(x, cos):
        return rope_kernel.apply_rope(x, cos, sin, inverse)
    half = cos.shape[-1]
    nope, rope = x[..., : x.shape[-1] - 2 * half], x[..., x.shape[-1] - 2 * half:]
    while cos.dim() < rope.dim():  # [N, R/2] -> [N, 1.., R/2]
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    pairs = rope.float().unflatten(-1, (half, 2))  # [..., R/2, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """``apply_rope(rms_norm(x, weight, eps), cos, sin)``: one kernel on CUDA (``dsv4.kernels.norm``); the
    composition is its twin."""
    if x.is_cuda and norm_kernel.rope_usable(x, cos):
        return norm_kernel.rms_norm_rope(x, weight, eps, cos, sin)
    return apply_rope(rms_norm(x, weight, eps), cos, sin)


def sink_attention(q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, sink: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """Attention over one shared K=V head with a per-head sink logit in the softmax denominator.

    q: [G, Tq, H, D]; kv: [G, K, D] (keys and values are the same vectors); mask: [G, Tq, K] bool
    (True = visible); sink: [H]. Returns [G, Tq, H, D]. A query with no visible key returns zeros
    (all weight goes to the sink).
    """
    G, Tq, H, D = q.shape
    kvf = torch.where(mask.any(1).unsqueeze(-1), kv, torch.zeros_like(kv)).float()  # keep unread rows finite
    scores = torch.einsum("gthd,gkd->gthk", q.float(), kvf) * scale  # [G, Tq, H, K]
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    sink_logit = sink.float().view(1, 1, H, 1).expand(G, Tq, H, 1)
    logits = torch.cat((scores, sink_logit), dim=-1)
    probs = torch.softmax(logits, dim=-1)[..., :-1]  # drop the sink column: it has no value
    out = torch.einsum("gthk,gkd->gthd", probs, kvf)
    return out.to(q.dtype)


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


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, n_heads: int,
                 head_dim: int) -> torch.Tensor:
    """Lightning-indexer scores I(t, s) = sum_h w_h(t) * nI^-1/2 * ReLU(q_h(t) . k_s) * dI^-1/2.

    q: [G, Tq, nI, dI]; weights: [G, Tq, nI]; keys: [G, E, dI]. Returns [G, Tq, E] fp32.
    """
    dots = torch.einsum("gthd,ged->gthe", q.float(), keys.float())
    w = weights.float() * n_heads ** -0.5
    return (torch.relu(dots) * head_dim ** -0.5 * w.unsqueeze(-1)).sum(dim=2)


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
    kernel does it (``dsv4.kernels.swiglu``); the lines below are its twin."""
    if gate.is_cuda and swiglu_kernel.HAVE_TRITON and gate.dim() == 2 and gate.stride(-1) == 1 and up.stride(-1) == 1:
        return swiglu_kernel.swiglu_to(gate, up, limit, row_weight, dtype)
    h = swiglu(gate, up, limit)
    if row_weight is not None:
        h = h * row_weight.float()[:, None]
    return h.to(dtype)
