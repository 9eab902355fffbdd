"""mHC mixing weights in one kernel: pre (sigmoid), post (2*sigmoid) and the Sinkhorn-normalised comb from
the mixing logits, one program per token (about a hundred tiny ops in plain torch). The plain-torch twin is
the body of ``dsv4.model.mhc.hc_pre``."""

from __future__ import annotations

import torch

from . import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _hc_weights_kernel(M, stride_m, SCALE, BASE, PRE, POST, COMB, iters, eps, n: tl.constexpr):
        t = tl.program_id(0)
        i = tl.arange(0, n)
        row = M + t * stride_m
        s0, s1, s2 = tl.load(SCALE), tl.load(SCALE + 1), tl.load(SCALE + 2)
        pre = tl.sigmoid(s0 * tl.load(row + i) + tl.load(BASE + i)) + eps
        post = 2 * tl.sigmoid(s1 * tl.load(row + n + i) + tl.load(BASE + n + i))
        jk = i[:, None] * n + i[None, :]  # [j, k]
        c = s2 * tl.load(row + 2 * n + jk) + tl.load(BASE + 2 * n + jk)
        c = tl.exp(c - tl.max(c, axis=1)[:, None])
        c = c / tl.sum(c, axis=1)[:, None] + eps  # softmax over k, then + eps
        c = c / (tl.sum(c, axis=0)[None, :] + eps)  # columns first
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + eps)
            c = c / (tl.sum(c, axis=0)[None, :] + eps)
        tl.store(PRE + t * n + i, pre)
        tl.store(POST + t * n + i, post)
        tl.store(COMB + t * n * n + jk, c)


def hc_weights(m: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float):
    """m: [N, (2+n)n] fp32 mixing logits -> (pre [N, n], post [N, n], comb [N, n, n]) fp32 (n a power of 2)."""
    N = m.shape[0]
    pre = torch.empty(N, n, dtype=torch.float32, device=m.device)
    post = torch.empty_like(pre)
    comb = torch.empty(N, n, n, dtype=torch.float32, device=m.device)
    if N:
        _hc_weights_kernel[(N,)](m, m.stride(0), scale.float().contiguous(), base.float().contiguous(), pre, post,
                                 comb, iters, eps, n=n, num_warps=1)
    return pre, post, comb


def usable(X: torch.Tensor) -> bool:
    n = X.shape[1]
    return HAVE_TRITON and X.is_cuda and n >= 2 and (n & (n - 1)) == 0
