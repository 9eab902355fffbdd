"""mHC in three kernels instead of about forty small ops per block: the stream collapse before a sub-block
(``hc_pre``: RMS of the flattened streams, mixing logits, pre/post/Sinkhorn comb weights, weighted sum of
the streams), the final collapse (``hc_head``) and the write-back after it (``hc_post``). The plain-torch
twins are the CPU branches of ``dsv4.model.mhc``.

The collapse runs in two launches. ``_mix_partials`` splits the n*d inputs of each token into chunks and
writes, per chunk, its dot products with the mixing rows and its sum of squares; ``_collapse`` adds the
chunks in a fixed order, applies the RMS scale (m = W x / rms(x) = (W x) / rms(x)), computes the weights and
the weighted sum over a slice of d. Each token's result depends on its own inputs only (batch-invariant).
``_sinkhorn`` then turns the comb logits into the comb in place: 2 x 20 dependent normalisations of a 4 x 4
matrix, latency that nothing reads until the write-back after the sub-block (``_post``), so under a graph
capture it can run on a side stream beside the sub-block (``model.mhc.MHC_OVERLAP``).
"""

from __future__ import annotations

import torch

from . import HAVE_TRITON, on, pdl
from .side_stream import fork

BLOCK_K = 64  # inputs of one token per mixing-partial program (n*d/64 programs per token)
MIX_TOKENS = 64  # tokens per mixing-partial program, the dot's rows, whatever N is: the reductions' layout
# follows the tile, so a token's bits would change with it. A token a program (the earlier kernel, products
# summed on the CUDA cores) was latency-bound at prefill sizes: 1.5 ms a launch for 8k tokens on an H200
BLOCK_D = 512  # channels per collapse / write-back program

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter

    @triton.jit
    def _mix_partials(X, stride_x, FN, P, N, K, R: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr,
                      TOKENS: tl.constexpr, PDL: tl.constexpr):
        """Grid (cdiv(N, TOKENS), K / BLOCK): TOKENS tokens' partials over inputs chunk kb as one dot on the
        tensor cores in 3xTF32 (each operand split into a TF32 head and tail, three products: float32's accuracy;
        a bfloat16 x is its own head), the sums of squares beside it."""
        enter(PDL)
        kb = tl.program_id(1)
        t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
        k = kb * BLOCK + tl.arange(0, BLOCK)
        mk = k < K
        live = t < N
        r = tl.arange(0, RP)
        w = tl.load(FN + r[:, None] * K + k[None, :], mask=(r < R)[:, None] & mk[None, :], other=0.0).to(tl.float32)
        x = tl.load(X + t.to(tl.int64)[:, None] * stride_x + k[None, :], mask=live[:, None] & mk[None, :],
                    other=0.0).to(tl.float32)
        dots = tl.dot(x, tl.trans(w), input_precision="tf32x3")  # [TOKENS, RP]
        out = tl.where(r[None, :] == R, tl.sum(x * x, axis=1)[:, None], dots)  # column R: the sum of squares
        tl.store(P + (t.to(tl.int64)[:, None] * tl.num_programs(1) + kb) * (R + 1) + r[None, :], out,
                 mask=live[:, None] & (r <= R)[None, :])

    @triton.jit
    def _collapse(P, KB, X, stride_x, SCALE, BASE, POST, COMB, U, eps, norm_eps, K, d,
                  n: tl.constexpr, KBP: tl.constexpr, HEAD: tl.constexpr, BLOCK: tl.constexpr,
                  SLICES: tl.constexpr, PDL: tl.constexpr):
        """Grid (N, cdiv(d, BLOCK * SLICES)): token t's weights from its partials (each program computes
        them alike), then SLICES slices of BLOCK channels of the weighted sum."""
        enter(PDL)
        t, db = tl.program_id(0), tl.program_id(1)
        R: tl.constexpr = n if HEAD else (2 + n) * n
        i = tl.arange(0, n)
        kb = tl.arange(0, KBP)
        prow = P + (t * KB + kb) * (R + 1)
        mkb = kb < KB
        inv = 1.0 / tl.sqrt_rn(tl.sum(tl.load(prow + R, mask=mkb, other=0.0), axis=0) / K + norm_eps)
        m_pre = tl.sum(tl.load(prow[:, None] + i[None, :], mask=mkb[:, None], other=0.0), axis=0) * inv
        pre = tl.sigmoid(tl.load(SCALE) * m_pre + tl.load(BASE + i)) + eps
        if not HEAD:
            if db == 0:  # one program per token writes the write-back weights and the comb logits
                m_post = tl.sum(tl.load(prow[:, None] + n + i[None, :], mask=mkb[:, None], other=0.0), axis=0)
                post = 2 * tl.sigmoid(tl.load(SCALE + 1) * (m_post * inv) + tl.load(BASE + n + i))
                jk = i[:, None] * n + i[None, :]  # [j, k]
                m_c = tl.sum(tl.load(prow[:, None, None] + 2 * n + jk[None, :, :], mask=mkb[:, None, None],
                                     other=0.0), axis=0) * inv
                tl.store(POST + t * n + i, post)
                tl.store(COMB + t * n * n + jk, tl.load(SCALE + 2) * m_c + tl.load(BASE + 2 * n + jk))
        for j in range(SLICES):
            c_ = (db * SLICES + j) * BLOCK + tl.arange(0, BLOCK)
            mc = c_ < d
            x = tl.load(X + t.to(tl.int64) * stride_x + i[:, None] * d + c_[None, :], mask=mc[None, :],
                        other=0.0).to(tl.float32)
            u = tl.sum(pre[:, None] * x, axis=0)
            tl.store(U + t.to(tl.int64) * d + c_, u.to(U.dtype.element_ty), mask=mc)

    @triton.jit
    def _sinkhorn(COMB, eps, iters: tl.constexpr, n: tl.constexpr, PDL: tl.constexpr):
        """Grid (N,): token t's comb logits [j, k], in place, to the Sinkhorn-normalised comb: softmax over k
        plus eps, then columns and rows alternately (``iters`` passes, columns first)."""
        enter(PDL)
        t = tl.program_id(0)
        i = tl.arange(0, n)
        jk = i[:, None] * n + i[None, :]
        c = tl.load(COMB + t * n * n + jk)
        c = tl.exp(c - tl.max(c, axis=1)[:, None])
        c = c / tl.sum(c, axis=1)[:, None] + eps  # softmax over k, then + eps
        c = c / (tl.sum(c, axis=0)[None, :] + eps)  # columns first
        for _ in range(iters - 1):
            c = c / (tl.sum(c, axis=1)[:, None] + eps)
            c = c / (tl.sum(c, axis=0)[None, :] + eps)
        tl.store(COMB + t * n * n + jk, c)

    @triton.jit
    def _post(Y, X, POST, COMB, OUT, d, n: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        t, db = tl.program_id(0), tl.program_id(1)
        i = tl.arange(0, n)
        c_ = db * BLOCK + tl.arange(0, BLOCK)
        mc = c_ < d
        x = tl.load(X + t * n * d + i[:, None] * d + c_[None, :], mask=mc[None, :], other=0.0).to(tl.float32)
        y = tl.load(Y + t * d + c_, mask=mc, other=0.0).to(tl.float32)
        comb = tl.load(COMB + t * n * n + i[:, None] * n + i[None, :])  # [j, k]
        mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)  # [k, c]: sum over j
        out = tl.load(POST + t * n + i)[:, None] * y[None, :] + mixed
        tl.store(OUT + t * n * d + i[:, None] * d + c_[None, :], out.to(OUT.dtype.element_ty), mask=mc[None, :])


def collapse_slices(N: int, d: int) -> int:
    """Channel slices (BLOCK_D) per collapse program: one in decode-sized steps (tokens x d / BLOCK_D programs
    fill the GPU), all of d in prefill chunks, where every program read its token's partials again (8k tokens:
    0.42 ms a launch on an H200). The values do not depend on it: each program computes the weights alike."""
    return 1 if N <= 256 else triton.cdiv(d, BLOCK_D)


def usable(X: torch.Tensor) -> bool:
    n = X.shape[1]
    return on(X) and n >= 2 and (n & (n - 1)) == 0


def _collapse_launch(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                     eps: float, norm_eps: float, head: bool, side=None):
    N, n, d = X.shape
    K, R = n * d, fn.shape[0]
    X = X.contiguous()
    fn = fn.float().contiguous()
    KB = triton.cdiv(K, BLOCK_K)
    P = torch.empty(N, KB, R + 1, dtype=torch.float32, device=X.device)
    u = torch.empty(N, d, dtype=X.dtype, device=X.device)
    post = torch.empty(N, n, dtype=torch.float32, device=X.device)
    comb = torch.empty(N, n, n, dtype=torch.float32, device=X.device)
    if N:
        _mix_partials[(triton.cdiv(N, MIX_TOKENS), KB)](X, X.stride(0), fn, P, N, K, R=R,
                                                        RP=max(16, triton.next_power_of_2(R + 1)), BLOCK=BLOCK_K,
                                                        TOKENS=MIX_TOKENS, num_warps=4, **pdl.args())
        slices = collapse_slices(N, d)
        _collapse[(N, triton.cdiv(d, BLOCK_D * slices))](P, KB, X, X.stride(0), scale.float().contiguous(),
                                                         base.float().contiguous(), post, comb, u, eps, norm_eps,
                                                         K, d, n=n, KBP=triton.next_power_of_2(KB),
                                                         HEAD=head, BLOCK=BLOCK_D, SLICES=slices,
                                                         num_warps=1, **pdl.args())
        if not head:  # the Sinkhorn: a chain of 2 * iters dependent normalisations, on the side stream if given
            with fork(side, X.device):
                _sinkhorn[(N,)](comb, eps, iters=iters, n=n, num_warps=1, **pdl.args())  # warp-local reductions
    return u, post, comb


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
           norm_eps: float, side=None):
    """X [N, n, d] -> (u [N, d] in X's dtype, post [N, n], comb [N, n, n] fp32), as ``model.mhc.hc_pre``.
    ``side``: a stream (``side_stream``) the Sinkhorn forks onto; comb is then ready only after a join
    with it, and must stay alive until then."""
    return _collapse_launch(X, fn, base, scale, iters, eps, norm_eps, head=False, side=side)


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    """X [N, n, d] -> [N, d] in X's dtype, as ``model.mhc.hc_head``."""
    return _collapse_launch(X, fn, base, scale, 1, eps, norm_eps, head=True)[0]


def hc_post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [N, d], X [N, n, d] -> X' [N, n, d] in X's dtype, as ``model.mhc.hc_post``."""
    N, n, d = X.shape
    X, y = X.contiguous(), y.contiguous()
    out = torch.empty_like(X)
    if N:
        _post[(N, triton.cdiv(d, BLOCK_D))](y, X, post.float().contiguous(), comb.float().contiguous(), out, d,
                                            n=n, BLOCK=BLOCK_D, num_warps=4, **pdl.args())
    return out
