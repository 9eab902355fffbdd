"""Skinny GEMMs at decode sizes: y = x @ W^T for x [M, K] with few rows (M <= MAX_M) and an nn.Linear weight
W [N, K], and the grouped form y[m, g] = x[m, g] @ W[g]^T (x [M, G, K], W [G, N, K] -> [M, G, N]) that the
attention's output projection runs through ``torch.einsum("ngi,goi->ngo")``. The torch twins are
``torch.nn.functional.linear`` and that einsum; both here accumulate in fp32 and round once to the output dtype.

The problem is reading W once at memory bandwidth, so the kernel is a GEMV with the operands swapped: each
program streams a [BLOCK_N, BLOCK_K] tile of W per step (rows of W are contiguous along K: wide, coalesced
loads through a ``num_stages`` deep pipeline) and multiplies it on the tensor cores by x^T [BLOCK_K, BLOCK_M],
the x rows padded to BLOCK_M = 16 (or 32) with masks (``tl.dot`` needs every dimension >= 16; the wasted MMA
work is free next to the bytes). fp32 operands use exact fp32 products (``input_precision="ieee"``), not TF32.

Too few N tiles to fill the chip (N = 1024 at BLOCK_N = 64 is 16 programs, the H200 has 132 SMs) are split
along K: SPLIT_K programs per tile write fp32 partials to a [SPLIT_K, M, G, N] buffer and a second kernel adds
them in split order and rounds once. No atomics: the result is deterministic run to run.

    grid axis 0: m block (fastest: programs sharing a W tile run together and share it in L2), K split, N tile
    grid axis 1: group g

Batch-invariant: the tiling (BLOCK_M rows of x per program, whatever M is), the split of K (from N, K, G, the
configuration and the device's SM count, never from M) and the order of every sum are fixed, and in each MMA
a row of x meets only its own accumulator column, so a row's result is bitwise the same whatever M is and
whatever the other rows hold. (Two different configurations, or split counts, give results that differ in
rounding.) CUDA-graph capturable: no host synchronisation, shapes from the arguments only.

Configurations (``CONFIGS``, chosen by ``default_config``; bench/skinny_linear.py times them against cuBLAS):
tile sizes, warps and pipeline depth; ``split_k`` overrides the split rule of ``plan``.
"""

from __future__ import annotations

import functools

import torch

from . import HAVE_TRITON

MAX_M = 32  # rows of x usable() sends here: past it every further BLOCK_M rows reread W (from L2 at best) while
# cuBLAS' tiles catch up; where the crossover lies is for the bench (--m 32 64); the kernel itself takes any M
TARGET_WAVES = 1  # split K until (N tiles x splits) reaches this many programs per SM (powers of two: 1-2) ...
MIN_SPLIT_K = 256  # ... while every split keeps at least this many columns of K
MAX_SPLIT = 32
REDUCE_BLOCK = 1024

CONFIGS = {
    # 64 rows of W x 128 columns per step (16 KB in bf16), 4 stages: three tiles in flight per program
    "n64k128": dict(BLOCK_N=64, BLOCK_K=128, BLOCK_M=16, num_warps=4, num_stages=4),
    # the same tiles with 32 x rows per program: M up to 32 reads each W tile once (M = 1: more idle MMA work)
    "n64k128m32": dict(BLOCK_N=64, BLOCK_K=128, BLOCK_M=32, num_warps=4, num_stages=4),
    # narrow and long: 4x the N tiles of n64k128 (fewer K splits for small N), 16 rows x 512 columns a step
    "n16k512": dict(BLOCK_N=16, BLOCK_K=512, BLOCK_M=16, num_warps=4, num_stages=3),
    # fp32 weights (tests, fp32 models): exact fp32 products on the CUDA cores, smaller tiles
    "fp32": dict(BLOCK_N=32, BLOCK_K=64, BLOCK_M=16, num_warps=4, num_stages=3),
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_config(N: int, K: int, G: int = 1, dtype: torch.dtype = torch.bfloat16) -> str:
    """The configuration for a shape class (never depends on M: batch invariance)."""
    if dtype == torch.float32:
        return "fp32"
    return "n16k512" if G * N <= 512 else "n64k128"  # few rows of W: narrow tiles give programs without deep splits


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the interpreter (CPU tensors): plan as for an H200
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(N: int, K: int, G: int, cfg: dict, split_k: int | None = None, sm_count: int = 132):
    """-> (splits, K steps per split, whether no step needs a K mask). The smallest power of two of splits
    that gives TARGET_WAVES programs per SM for one block of x rows, each split at least MIN_SPLIT_K wide
    (``split_k`` forces a count). Splits are whole BLOCK_K steps; empty trailing splits are dropped."""
    BK = cfg["BLOCK_K"]
    k_steps = _cdiv(K, BK)
    if split_k is None:
        tiles = G * _cdiv(N, cfg["BLOCK_N"])
        split_k = 1
        while (tiles * split_k < TARGET_WAVES * sm_count and split_k < MAX_SPLIT
               and K // (2 * split_k) >= MIN_SPLIT_K and 2 * split_k <= k_steps):
            split_k *= 2
    split_k = max(1, min(int(split_k), k_steps))
    iters = _cdiv(k_steps, split_k)
    split_k = _cdiv(k_steps, iters)
    return split_k, iters, K % BK == 0 and split_k * iters == k_steps


def _resolve(config, N: int, K: int, G: int, dtype: torch.dtype) -> dict:
    if config is None:
        config = default_config(N, K, G, dtype)
    if isinstance(config, str):
        return CONFIGS[config]
    return dict(CONFIGS[default_config(N, K, G, dtype)], **config)  # a dict: overrides of the default


def usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether skinny_linear (weight [N, K], x [..., K]) or skinny_grouped_linear (weight [G, N, K],
    x [M, G, K]) runs this on the kernel: CUDA, Triton, at most MAX_M rows, bf16 or fp32 with x and the
    weight alike, unit stride along K."""
    if not (HAVE_TRITON and x.is_cuda and weight.is_cuda and x.device == weight.device):
        return False
    if x.dtype not in (torch.bfloat16, torch.float32) or weight.dtype != x.dtype:
        return False
    if x.dim() < 1 or x.stride(-1) != 1 or weight.stride(-1) != 1 or weight.shape[-1] != x.shape[-1]:
        return False
    if weight.dim() == 2:
        M = x.numel() // max(1, x.shape[-1])
    elif weight.dim() == 3:
        if x.dim() != 3 or x.shape[1] != weight.shape[0] or weight.shape[0] > 65535:
            return False
        M = x.shape[0]
    else:
        return False
    return M <= MAX_M and weight.shape[-1] > 0 and weight.shape[-2] > 0


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["M"])  # one compiled kernel for every M (no M == 1 special case)
    def _skinny_kernel(X, W, Y, P, M, N, K, stride_xm, stride_xg, stride_wg, stride_wn, stride_ym, stride_yg,
                       stride_ps, SPLIT_K: tl.constexpr, K_ITERS: tl.constexpr, EVEN_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        """acc[n, m] = sum over this split's K of W[g, n, k] * X[m, g, k] (fp32); SPLIT_K == 1: Y[m, g, n]
        = acc rounded, else P[split, m, g, n] = acc."""
        pid, g = tl.program_id(0), tl.program_id(1)
        m_blocks = tl.cdiv(M, BLOCK_M)
        pid_m = pid % m_blocks
        pid_s = (pid // m_blocks) % SPLIT_K
        pid_n = pid // (m_blocks * SPLIT_K)
        n0 = pid_n * BLOCK_N
        k0 = pid_s * (K_ITERS * BLOCK_K)
        offs_n = tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        n_ok = (n0 + offs_n) < N
        m_ok = offs_m < M
        # int64 bases (W may pass 2^31 elements), small int32 offsets inside the tile
        w_ptrs = (W + g.to(tl.int64) * stride_wg + n0.to(tl.int64) * stride_wn + k0
                  + offs_n[:, None] * stride_wn + offs_k[None, :])
        x_ptrs = X + g.to(tl.int64) * stride_xg + k0 + offs_m[None, :] * stride_xm + offs_k[:, None]  # x^T
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for i in range(K_ITERS):
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
                xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + i * BLOCK_K + offs_k) < K
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:  # fp32 models: exact fp32 products, not TF32
                acc = tl.dot(w, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = g * stride_yg + offs_m[None, :] * stride_ym + (n0 + offs_n)[:, None]
        ok = m_ok[None, :] & n_ok[:, None]
        if SPLIT_K == 1:
            tl.store(Y + out, acc.to(Y.dtype.element_ty), mask=ok)
        else:
            tl.store(P + pid_s.to(tl.int64) * stride_ps + out, acc, mask=ok)

    @triton.jit
    def _split_reduce_kernel(P, Y, T, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """Y[t] = P[0, t] + P[1, t] + ... in split order (fp32), rounded once."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < T
        acc = tl.load(P + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            acc += tl.load(P + s * T + offs, mask=ok, other=0.0)
        tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


def _skinny(x: torch.Tensor, w: torch.Tensor, config=None, split_k: int | None = None) -> torch.Tensor:
    """x [M, G, K] (unit stride along K, any strides else), w [G, N, K] (unit stride along K) -> y [M, G, N]
    contiguous, in x's dtype. No checks: ``usable`` is the caller's."""
    M, G, K = x.shape
    N = w.shape[1]
    cfg = _resolve(config, N, K, G, x.dtype)
    y = torch.empty(M, G, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    if K == 0:
        return y.zero_()
    S, iters, even_k = plan(N, K, G, cfg, split_k, _sm_count(x.device))
    T = M * G * N
    p = torch.empty(S, M, G, N, dtype=torch.float32, device=x.device) if S > 1 else y  # y: unused pointer
    grid = (_cdiv(M, cfg["BLOCK_M"]) * S * _cdiv(N, cfg["BLOCK_N"]), G)
    _skinny_kernel[grid](x, w, y, p, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), G * N, N, T,
                         SPLIT_K=S, K_ITERS=iters, EVEN_K=even_k, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
                         BLOCK_K=cfg["BLOCK_K"], IEEE=x.dtype == torch.float32, num_warps=cfg["num_warps"],
                         num_stages=cfg["num_stages"])
    if S > 1:
        _split_reduce_kernel[(_cdiv(T, REDUCE_BLOCK),)](p, y, T, SPLIT_K=S, BLOCK=REDUCE_BLOCK, num_warps=4)
    return y


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, config=None, split_k: int | None = None) -> torch.Tensor:
    """F.linear(x, weight) without bias: x [..., K], weight [N, K] -> [..., N] in x's dtype. ``config``: a
    name in CONFIGS or a dict of overrides (default: ``default_config``); ``split_k`` forces the K split."""
    K = x.shape[-1]
    y = _skinny(x.reshape(-1, K).unsqueeze(1), weight.unsqueeze(0), config, split_k)
    return y.view(*x.shape[:-1], weight.shape[0])


def skinny_grouped_linear(x: torch.Tensor, weight: torch.Tensor, config=None,
                          split_k: int | None = None) -> torch.Tensor:
    """torch.einsum("mgk,gnk->mgn", x, weight): x [M, G, K], weight [G, N, K] -> [M, G, N] in x's dtype."""
    return _skinny(x, weight, config, split_k)
