"""Manifold-constrained hyper-connections (mHC): the residual stream is n parallel copies of the hidden state.

A sub-block (attention or MoE) reads a weighted sum of the streams (``pre``), and writes its output back
spread over the streams (``post``) plus a doubly-stochastic mix of the old streams (``comb``, Sinkhorn).
All mixing maths in fp32. X: [N, n, d].
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels import mhc as kernel
from ..kernels.side_stream import join, side_stream
from .ops import rms_norm
from .rows import active as rows_fixed
from .rows import linear, row_chunks

# With MHC_OVERLAP the Sinkhorn of each collapse (kernels.mhc._sinkhorn: 2 x 20 dependent normalisations of the
# 4 x 4 comb, one warp, latency only) runs on the side stream while a CUDA graph is captured, beside the sub-block
# it precedes; the write-back joins it. Same kernels and inputs, so the same bits. Measured on an H100
# (flash-L20-E128, FP4 experts, FP8 linears, batch 1; decode_floor.py --no-mhc-overlap is the A/B): overlapped
# step 4.05 against 4.18 ms (BENCHMARKS.md, 25th session).
MHC_OVERLAP = True
# With NORM_IN_COLLAPSE the sub-block's RMSNorm (and the final one before the head) is computed by the collapse's
# kernel (kernels.mhc._collapse, NORM), not by a launch of its own after it (decode_floor.py --no-norm-in-collapse
# is the A/B).
NORM_IN_COLLAPSE = True
# With POST_MIX the write-back before a collapse (every one but the first layer's attention's) computes the
# collapse's mixing partials of the streams it writes (kernels.mhc.hc_post_mix), so the collapse does not read
# the streams back for them in a launch of its own (``hc_post_mix`` / ``hc_pre(..., mix=)``). Off until a GPU has
# run its test and measured it (bench/run_session42_gpu.sh: mhc_prefill_gpu.py --post-mix, prefill.py --post-mix
# on|off, the decode step either way): the saving would be a read of the streams a sub-block (8k tokens of Flash:
# 268 MB) and a launch (decode: 40 a step of flash-L20).
POST_MIX = False


class Mix(NamedTuple):
    """Streams' mixing partials for the mixing rows ``fn``, from the write-back that wrote the streams."""

    fn: torch.Tensor
    partials: torch.Tensor


def _mix_logits(X: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """W v with v = flatten(X) / rms(flatten(X)) (unweighted RMS over all n*d values): [N, rows]."""
    flat = X.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return linear(flat, fn.float())


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
           eps: float, norm_eps: float, norm_weight: torch.Tensor | None = None, mix: Mix | None = None
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Collapse the streams for a sub-block. Returns (u [N, d] in X's dtype, post [N, n], comb [N, n, n]); with
    ``norm_weight`` u is the sub-block's RMSNorm of it (eps ``norm_eps``), on the GPU in the collapse's kernel.
    ``mix``: X's mixing partials from the write-back that wrote X (``hc_post_mix``), for these rows ``fn``."""
    if kernel.usable(X):  # three kernels on the GPU (two with ``mix``); the lines below are their twin
        if mix is not None and mix.fn is not fn:
            raise ValueError("hc_pre: the streams' mixing partials were computed for other mixing rows")
        inside, after = _norm_split(norm_weight)
        u, post, comb = kernel.hc_pre(X, fn, base, scale, sinkhorn_iters, eps, norm_eps,
                                      side_stream(X, MHC_OVERLAP), inside, invariant=rows_fixed(),
                                      partials=None if mix is None else mix.partials)
        return _normed(u, after, norm_eps), post, comb
    return row_chunks(X, lambda X: _hc_pre_torch(X, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight))


def _hc_pre_torch(X, fn, base, scale, sinkhorn_iters, eps, norm_eps, norm_weight):
    n = X.shape[1]
    m = _mix_logits(X, fn, norm_eps)  # [N, (2+n)n]
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(scale[0] * m[:, :n] + base[:n]) + eps  # [N, n]
    post = 2 * torch.sigmoid(scale[1] * m[:, n:2 * n] + base[n:2 * n])  # [N, n]
    comb = scale[2] * m[:, 2 * n:].view(-1, n, n) + base[2 * n:].view(n, n)  # [N, j, k]
    comb = torch.softmax(comb, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)  # columns first
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    u = torch.einsum("nj,njd->nd", pre, X.float()).to(X.dtype)
    return _normed(u, norm_weight, norm_eps), post, comb


def _normed(u: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return u if weight is None else rms_norm(u, weight, eps)


def _norm_split(weight: torch.Tensor | None) -> tuple:
    """(the norm weight the collapse's kernel applies, the one applied after it): NORM_IN_COLLAPSE decides."""
    return (weight, None) if NORM_IN_COLLAPSE else (None, weight)


def hc_post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_k = post_k * y + sum_j comb[j, k] * X_j (the sum runs over the FIRST index of comb)."""
    if kernel.usable(X):  # one fused kernel on the GPU (after hc_pre's Sinkhorn); the lines below are its twin
        join(side_stream(X, MHC_OVERLAP), X.device)
        return kernel.hc_post(y, X, post, comb)
    out = post.unsqueeze(-1) * y.float().unsqueeze(1) + torch.einsum("njk,njd->nkd", comb, X.float())
    return out.to(X.dtype)


def hc_post_mix(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                fn: torch.Tensor | None) -> tuple[torch.Tensor, Mix | None]:
    """``hc_post`` and, where the kernel takes it (POST_MIX, 4 streams on the GPU) and ``fn`` is given, the
    mixing partials of X' for the collapse with rows ``fn`` that reads it next: (X', Mix or None)."""
    if fn is None or not (POST_MIX and kernel.fuses(X)):
        return hc_post(y, X, post, comb), None
    join(side_stream(X, MHC_OVERLAP), X.device)
    out, partials = kernel.hc_post_mix(y, X, post, comb, fn, invariant=rows_fixed())
    return out, Mix(fn, partials)


def hc_discard(X: torch.Tensor) -> None:
    """End an ``hc_pre`` whose write-back does not run (a sub-block whose output nobody reads): the side stream
    its Sinkhorn may run on is joined, as ``hc_post`` joins it."""
    if kernel.usable(X):
        join(side_stream(X, MHC_OVERLAP), X.device)


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float, norm_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Final collapse of the streams before the output norm: [N, n, d] -> [N, d] (with ``norm_weight``: that
    RMSNorm of it, on the GPU in the collapse's kernel)."""
    if kernel.usable(X):  # two fused kernels on the GPU; the lines below are their twin
        inside, after = _norm_split(norm_weight)
        u = kernel.hc_head(X, fn, base, scale, eps, norm_eps, inside, invariant=rows_fixed())
        return _normed(u, after, norm_eps)

    def head(X):
        m = _mix_logits(X, fn, norm_eps)  # [N, n]
        pre = torch.sigmoid(scale.float()[0] * m + base.float()) + eps
        return _normed(torch.einsum("nj,njd->nd", pre, X.float()).to(X.dtype), norm_weight, norm_eps)
    return row_chunks(X, head)
