"""mHC in three kernels instead of about forty small ops per block: the stream collapse before a sub-block
(``hc_pre``: RMS of the flattened streams, mixing logits, pre/post/Sinkhorn comb weights, weighted sum of
the streams), the final collapse (``hc_head``) and the write-back after it (``hc_post``). The plain-torch
twins are the CPU branches of ``dsv4.model.mhc``.

The collapse runs in two launches. ``_mix_partials`` splits the n*d inputs of each token into chunks and
writes, per chunk (per run of MIX_LOOP chunks at prefill sizes, ``mix_loop``), its dot products with the mixing
rows on the tensor cores to float32's accuracy (a bfloat16 X in bfloat16 products, the float32 rows split in three
bfloat16 parts; else 3xTF32) and its sum of squares; ``_collapse`` adds the chunks in a fixed order, applies the
RMS scale (m = W x / rms(x) = (W x) / rms(x)), computes the weights and the weighted sum, one program a token
over all of d, and then, given the sub-block's norm weight, the RMSNorm that the sub-block reads (the norm's own
launch saved). Each token's result depends on its own inputs and on the run
length N gives (under batch invariance on its own inputs only).
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
# A mixing-partial program of a prefill chunk sums up to MIX_LOOP chunks of BLOCK_K inputs before it writes
# (mix_loop): a chunk each wrote N x n*d/64 x 25 float32 partials, 210 MB for 8k tokens of Flash (as many bytes as
# the streams it reads), then read back by the collapse (8k tokens on an H100, with the run a constant: the collapse
# 102 against about 160 us, the partials about 250 us either way; bench/run_session38_gpu.sh). Since the run is an
# argument the collapse's tile of partials is that of a run of 1 (masked past the run's count; not timed). As many
# as leave MIX_PROGRAMS programs or more (8k tokens of Flash: 16, 1k: 4, 256: 1), outside batch invariance (the
# sums' order, so a token's bits, then depend on N). The run's length is an argument of both kernels, so no N
# compiles another kernel after warmup
MIX_LOOP = 16
MIX_PROGRAMS = 1024
MIX_BF16 = True  # a bfloat16 X's partials in bfloat16 products (the mixing rows in three parts), else 3xTF32: on
# an H100 (bench/mhc_prefill_gpu.py, Flash's widths, float64's error alike) 8k tokens 279 -> 124 us (2.2 TB/s of
# streams read), 1k 38.8 -> 23.0, 32 3.7 -> 3.5; hc_pre whole at 8k 399 -> 247 us. No x in float32 to split: the
# loop is 318 SASS instructions against 552, 80 registers against 158
# (a partial program: 4 warps, Triton's pipeline depth; 8 warps, 2 or 4 stages, or chunks of 128 inputs were slower
# at 1k and 8k tokens in either precision)
BLOCK_D = 512  # channels per write-back program below POST_WIDE_TOKENS tokens, twice as many from there on: on an
# H100 (bench/mhc_prefill_gpu.py, Flash's widths) 8k tokens 236 -> 217 us, 1k 29.0 -> 28.5, 1 token 1.5 -> 1.6; the
# same bits (each channel's sum over the streams is the same whatever the tile)
POST_WIDE_TOKENS = 256
POST_WARPS = 4  # warps of a write-back program
# The write-back that computes the next collapse's mixing partials of what it writes (``hc_post_mix``): warps of a
# program, and channels of a chunk (BLOCK_K: the partials of _mix_partials' layout where d is a multiple of a run;
# sm_90 SASS, Triton 3.6, 64 tokens: 232 registers, 146 with 32, no spills either way)
POST_MIX_WARPS = 8
POST_MIX_BLOCK = BLOCK_K
COLLAPSE_WARPS: int | None = None  # warps of a collapse program (one a token); None: 8 from d = 2048 on, else 4

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter, load_weight_and_enter

    @triton.jit
    def _mix_chunk(X, stride_x, t, live, k, mk, w, BF16: tl.constexpr):
        """TOKENS tokens' inputs ``k`` ([TOKENS, BLOCK], 0 past N or K) against the mixing rows' chunk ``w``
        (float32 [RP, BLOCK]): ``_mix_dots`` of them loaded."""
        x = tl.load(X + t.to(tl.int64)[:, None] * stride_x + k[None, :], mask=live[:, None] & mk[None, :],
                    other=0.0)
        return _mix_dots(x, w, BF16)

    @triton.jit
    def _mix_dots(x, w, BF16: tl.constexpr):
        """Inputs ``x`` ([TOKENS, BLOCK] in X's dtype) against the mixing rows' chunk ``w`` (float32 [RP, BLOCK])
        -> (the dots [TOKENS, RP] on the tensor cores to float32's accuracy, the sums of squares [TOKENS]). BF16
        (a bfloat16 x): w split into three bfloat16 parts (w0 + w1 + w2 holds its 24 bits), three bfloat16
        products into one float32 sum, smallest part first; x as it is (exact). Else x in float32 and 3xTF32
        (each operand split into a TF32 head and tail, three products)."""
        if BF16:
            w0 = w.to(tl.bfloat16)
            rest = w - w0.to(tl.float32)
            w1 = rest.to(tl.bfloat16)
            w2 = (rest - w1.to(tl.float32)).to(tl.bfloat16)
            dots = tl.dot(x, tl.trans(w2))
            dots = tl.dot(x, tl.trans(w1), dots)
            dots = tl.dot(x, tl.trans(w0), dots)
            xf = x.to(tl.float32)
            return dots, tl.sum(xf * xf, axis=1)
        x = x.to(tl.float32)
        return tl.dot(x, tl.trans(w), input_precision="tf32x3"), tl.sum(x * x, axis=1)

    @triton.jit(do_not_specialize=["LOOP"])  # a run of 1 is not a kernel of its own
    def _mix_partials(X, stride_x, FN, P, N, K, LOOP, R: tl.constexpr, RP: tl.constexpr, BLOCK: tl.constexpr,
                      TOKENS: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
        """Grid (cdiv(N, TOKENS), cdiv(K, BLOCK * LOOP)): TOKENS tokens' partials over LOOP chunks of BLOCK
        inputs (kb * LOOP ..), the chunks' dots on the tensor cores to float32's accuracy (``_mix_chunk``) summed
        in order, the sums of squares beside them. LOOP is an argument, not a constant, nor specialised on (Triton
        would compile a run of 1 apart): one compiled kernel whatever N (``mix_loop``)."""
        kb = tl.program_id(1)
        t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
        live = t < N
        r = tl.arange(0, RP)
        k = kb * LOOP * BLOCK + tl.arange(0, BLOCK)
        mk = k < K
        w_rows = FN + r[:, None] * K + k[None, :]  # the mixing rows: a weight, before the wait under PDL RELEASE
        w = load_weight_and_enter(w_rows, (r < R)[:, None] & mk[None, :], PDL).to(tl.float32)
        dots, sq = _mix_chunk(X, stride_x, t, live, k, mk, w, BF16)
        for j in range(1, LOOP):  # prefill sizes: fewer partials to write and read back
            k = (kb * LOOP + j) * BLOCK + tl.arange(0, BLOCK)
            mk = k < K
            w = tl.load(FN + r[:, None] * K + k[None, :], mask=(r < R)[:, None] & mk[None, :], other=0.0)
            d_j, sq_j = _mix_chunk(X, stride_x, t, live, k, mk, w.to(tl.float32), BF16)
            dots += d_j
            sq += sq_j
        out = tl.where(r[None, :] == R, sq[:, None], dots)  # column R: the sum of squares
        tl.store(P + (t.to(tl.int64)[:, None] * tl.num_programs(1) + kb) * (R + 1) + r[None, :], out,
                 mask=live[:, None] & (r <= R)[None, :])

    @triton.jit(do_not_specialize=["KB"])  # the partials' count follows mix_loop's run: one kernel for all
    def _collapse(P, KB, X, stride_x, SCALE, BASE, POST, COMB, NW, U, eps, norm_eps, K, d,
                  n: tl.constexpr, KBP: tl.constexpr, RP: tl.constexpr, DP: tl.constexpr, HEAD: tl.constexpr,
                  NORM: tl.constexpr, PDL: tl.constexpr):
        """Grid (N,): token t's weights from its partials (one [KB, R + 1] tile, rows contiguous), then the
        weighted sum of its streams over all d channels, and with NORM the RMSNorm of it (weight NW). Every load
        that does not wait for a sum is issued first (the streams too, for n = 4), so the program's global reads
        are one round trip, not one after each reduction."""
        enter(PDL)
        t = tl.program_id(0)
        R: tl.constexpr = n if HEAD else (2 + n) * n
        i = tl.arange(0, n)
        jk = i[:, None] * n + i[None, :]  # [j, k]
        c = tl.arange(0, DP)
        mc = c < d
        xrow = X + t.to(tl.int64) * stride_x + c
        if n == 4:  # the streams, in flight while the partials are summed
            x0 = tl.load(xrow, mask=mc, other=0.0)
            x1 = tl.load(xrow + d, mask=mc, other=0.0)
            x2 = tl.load(xrow + 2 * d, mask=mc, other=0.0)
            x3 = tl.load(xrow + 3 * d, mask=mc, other=0.0)
        if NORM:
            nw = tl.load(NW + c, mask=mc, other=0.0).to(tl.float32)
        scale_pre = tl.load(SCALE)
        base_pre = tl.load(BASE + i)
        if not HEAD:
            scale_post = tl.load(SCALE + 1)
            scale_comb = tl.load(SCALE + 2)
            base_post = tl.load(BASE + n + i)
            base_comb = tl.load(BASE + 2 * n + jk)
        kb = tl.arange(0, KBP)
        r = tl.arange(0, RP)
        part = tl.load(P + (t * KB + kb[:, None]) * (R + 1) + r[None, :],
                       mask=(kb < KB)[:, None] & (r <= R)[None, :], other=0.0)
        s = tl.sum(part, axis=0)  # [RP]: the R mixing dot products, then the sum of squares at R
        inv = 1.0 / tl.sqrt_rn(tl.sum(tl.where(r == R, s, 0.0), axis=0) / K + norm_eps)
        m = s * inv
        pre = tl.sum(tl.where(r[None, :] == i[:, None], m[None, :], 0.0), axis=1)  # [n]: m[i]
        pre = tl.sigmoid(scale_pre * pre + base_pre) + eps
        if not HEAD:  # the write-back weights and the comb logits (the Sinkhorn follows)
            post = tl.sum(tl.where(r[None, :] == n + i[:, None], m[None, :], 0.0), axis=1)
            post = 2 * tl.sigmoid(scale_post * post + base_post)
            m_c = tl.sum(tl.where(r[None, None, :] == 2 * n + jk[:, :, None], m[None, None, :], 0.0), axis=2)
            tl.store(POST + t * n + i, post)
            tl.store(COMB + t * n * n + jk, scale_comb * m_c + base_comb)
        u = tl.zeros([DP], dtype=tl.float32)
        if n == 4:
            u += tl.sum(tl.where(i == 0, pre, 0.0), axis=0) * x0.to(tl.float32)
            u += tl.sum(tl.where(i == 1, pre, 0.0), axis=0) * x1.to(tl.float32)
            u += tl.sum(tl.where(i == 2, pre, 0.0), axis=0) * x2.to(tl.float32)
            u += tl.sum(tl.where(i == 3, pre, 0.0), axis=0) * x3.to(tl.float32)
        else:
            for j in tl.static_range(n):  # a stream at a time: registers for two rows of d, whatever n
                x = tl.load(xrow + j * d, mask=mc, other=0.0).to(tl.float32)
                u += tl.sum(tl.where(i == j, pre, 0.0), axis=0) * x
        if NORM:  # u rounded to its dtype first, as the input of a separate RMSNorm
            u = u.to(U.dtype.element_ty).to(tl.float32)
            u = u * (1.0 / tl.sqrt_rn(tl.sum(u * u, axis=0) / d + norm_eps))
            u = nw * u
        tl.store(U + t.to(tl.int64) * d + c, u.to(U.dtype.element_ty), mask=mc)

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

    @triton.jit
    def _comb_col(COMB, t, live, k):
        """comb[t, j, k] for j = 0..3 as four [TOKENS, 1] columns."""
        return (tl.load(COMB + t * 16 + k, mask=live, other=0.0)[:, None],
                tl.load(COMB + t * 16 + 4 + k, mask=live, other=0.0)[:, None],
                tl.load(COMB + t * 16 + 8 + k, mask=live, other=0.0)[:, None],
                tl.load(COMB + t * 16 + 12 + k, mask=live, other=0.0)[:, None])

    @triton.jit
    def _post_tile(x0, x1, x2, x3, y, POST, COMB, t, live, k):
        """Stream k of the write-back, float32 [TOKENS, BLOCK]: post_k y + sum_j comb[j, k] x_j (the tiles in
        their own dtype, widened where used: half the registers of keeping them widened)."""
        k0, k1, k2, k3 = _comb_col(COMB, t, live, k)
        p = tl.load(POST + t * 4 + k, mask=live, other=0.0)[:, None]
        f = tl.float32
        return p * y.to(f) + (k0 * x0.to(f) + k1 * x1.to(f) + k2 * x2.to(f) + k3 * x3.to(f))

    @triton.jit(do_not_specialize=["LOOP"])
    def _post_mix(Y, X, POST, COMB, OUT, FN, P, N, d, LOOP, R: tl.constexpr, RP: tl.constexpr,
                  BLOCK: tl.constexpr, TOKENS: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
        """Grid (cdiv(N, TOKENS), CB = cdiv(d, BLOCK * LOOP)), 4 streams: the write-back (``_post``'s maths) of
        TOKENS tokens' channels cb * LOOP * BLOCK .. in LOOP chunks of BLOCK, every stream, and the next
        collapse's mixing partials of the values written (``_mix_partials``' work without a launch of its own,
        and with the streams read back from the L2 just after they are written, not from memory): stream s's is
        partial s * CB + cb of the token's [4 * CB, R + 1], its chunks' dots summed in order. The tiles written
        are read back after a barrier (the write-back's layout and the dots' stay apart: computed in the dots'
        operand layout, the write-back took every register)."""
        enter(PDL)
        cb = tl.program_id(1)
        CB = tl.num_programs(1)
        K = 4 * d
        t0 = tl.program_id(0) * TOKENS
        i = tl.arange(0, TOKENS)
        t = t0 + i
        live = t < N
        Xb = X + t0.to(tl.int64) * K  # the tile's rows as 32-bit offsets from here
        Yb = Y + t0.to(tl.int64) * d
        Ob = OUT + t0.to(tl.int64) * K
        r = tl.arange(0, RP)
        a0 = tl.zeros([TOKENS, RP], dtype=tl.float32)
        a1 = tl.zeros([TOKENS, RP], dtype=tl.float32)
        a2 = tl.zeros([TOKENS, RP], dtype=tl.float32)
        a3 = tl.zeros([TOKENS, RP], dtype=tl.float32)
        q0 = tl.zeros([TOKENS], dtype=tl.float32)
        q1 = tl.zeros([TOKENS], dtype=tl.float32)
        q2 = tl.zeros([TOKENS], dtype=tl.float32)
        q3 = tl.zeros([TOKENS], dtype=tl.float32)
        for j in range(LOOP):
            c = (cb * LOOP + j) * BLOCK + tl.arange(0, BLOCK)
            mc = c < d
            m2 = live[:, None] & mc[None, :]
            off = i[:, None] * K + c[None, :]
            x0 = tl.load(Xb + off, mask=m2, other=0.0)
            x1 = tl.load(Xb + d + off, mask=m2, other=0.0)
            x2 = tl.load(Xb + 2 * d + off, mask=m2, other=0.0)
            x3 = tl.load(Xb + 3 * d + off, mask=m2, other=0.0)
            y = tl.load(Yb + i[:, None] * d + c[None, :], mask=m2, other=0.0)
            dt = OUT.dtype.element_ty
            tl.store(Ob + off, _post_tile(x0, x1, x2, x3, y, POST, COMB, t, live, 0).to(dt), mask=m2)
            tl.store(Ob + d + off, _post_tile(x0, x1, x2, x3, y, POST, COMB, t, live, 1).to(dt), mask=m2)
            tl.store(Ob + 2 * d + off, _post_tile(x0, x1, x2, x3, y, POST, COMB, t, live, 2).to(dt), mask=m2)
            tl.store(Ob + 3 * d + off, _post_tile(x0, x1, x2, x3, y, POST, COMB, t, live, 3).to(dt), mask=m2)
            tl.debug_barrier()  # the block's writes visible to all its threads
            wm = (r < R)[:, None] & mc[None, :]
            w = FN + r[:, None] * K + c[None, :]
            d0, s0 = _mix_chunk(Ob, K, i, live, c, mc, tl.load(w, mask=wm, other=0.0).to(tl.float32), BF16)
            d1, s1 = _mix_chunk(Ob + d, K, i, live, c, mc, tl.load(w + d, mask=wm, other=0.0).to(tl.float32), BF16)
            d2, s2 = _mix_chunk(Ob + 2 * d, K, i, live, c, mc, tl.load(w + 2 * d, mask=wm, other=0.0).to(tl.float32),
                                BF16)
            d3, s3 = _mix_chunk(Ob + 3 * d, K, i, live, c, mc, tl.load(w + 3 * d, mask=wm, other=0.0).to(tl.float32),
                                BF16)
            a0 += d0
            a1 += d1
            a2 += d2
            a3 += d3
            q0 += s0
            q1 += s1
            q2 += s2
            q3 += s3
        pm = live[:, None] & (r <= R)[None, :]
        last = r[None, :] == R  # column R: the sum of squares
        prow = P + (t.to(tl.int64)[:, None] * 4 * CB + cb) * (R + 1) + r[None, :]  # stream s: partial s * CB + cb
        tl.store(prow, tl.where(last, q0[:, None], a0), mask=pm)
        tl.store(prow + CB * (R + 1), tl.where(last, q1[:, None], a1), mask=pm)
        tl.store(prow + 2 * CB * (R + 1), tl.where(last, q2[:, None], a2), mask=pm)
        tl.store(prow + 3 * CB * (R + 1), tl.where(last, q3[:, None], a3), mask=pm)


def usable(X: torch.Tensor) -> bool:
    n = X.shape[1]
    return on(X) and n >= 2 and (n & (n - 1)) == 0


def mix_loop(N: int, K: int, invariant: bool) -> int:
    """Chunks of BLOCK_K of the K inputs a mixing-partial program sums for N tokens: the most, up to MIX_LOOP
    (powers of two), that leave MIX_PROGRAMS programs or more; 1 (one chunk a program) under batch invariance."""
    chunks = -(-N // MIX_TOKENS) * -(-K // BLOCK_K)
    loop = 1
    while not invariant and loop < MIX_LOOP and chunks // (2 * loop) >= MIX_PROGRAMS:
        loop *= 2
    return loop


def _rp(R: int) -> int:
    """The mixing rows' tile: R rows and the sum of squares, a power of two, at least the dot's 16."""
    return max(16, triton.next_power_of_2(R + 1))


def _collapse_launch(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
                     eps: float, norm_eps: float, head: bool, side=None, norm_weight: torch.Tensor | None = None,
                     invariant: bool = False, partials: torch.Tensor | None = None):
    N, n, d = X.shape
    K, R = n * d, fn.shape[0]
    X = X.contiguous()
    fn = fn.float().contiguous()
    u = torch.empty(N, d, dtype=X.dtype, device=X.device)
    post = torch.empty(N, n, dtype=torch.float32, device=X.device)
    comb = torch.empty(N, n, n, dtype=torch.float32, device=X.device)
    RP = _rp(R)
    if partials is None:
        loop = mix_loop(N, K, invariant)
        KB = triton.cdiv(K, BLOCK_K * loop)
        P = torch.empty(N, KB, R + 1, dtype=torch.float32, device=X.device)
        if N:
            _mix_partials[(triton.cdiv(N, MIX_TOKENS), KB)](X, X.stride(0), fn, P, N, K, loop, R=R, RP=RP,
                                                            BLOCK=BLOCK_K, TOKENS=MIX_TOKENS,
                                                            BF16=MIX_BF16 and X.dtype == torch.bfloat16,
                                                            num_warps=4, **pdl.args())
    else:  # written by the write-back before (``hc_post_mix``)
        P, KB = partials, partials.shape[1]
        if partials.shape != (N, KB, R + 1):
            raise ValueError(f"mHC partials {tuple(partials.shape)} are not for {N} tokens and {R} mixing rows")
    if N:
        DP = triton.next_power_of_2(d)
        nw = norm_weight.contiguous() if norm_weight is not None else X  # X: an unused pointer without a norm
        KBP = triton.next_power_of_2(max(triton.cdiv(K, BLOCK_K), KB))  # (the write-back's layout may have more)
        _collapse[(N,)](P, KB, X, X.stride(0), scale.float().contiguous(), base.float().contiguous(), post, comb,
                        nw, u, eps, norm_eps, K, d, n=n, KBP=KBP, RP=RP, DP=DP, HEAD=head,
                        NORM=norm_weight is not None, num_warps=COLLAPSE_WARPS or (8 if DP >= 2048 else 4),
                        **pdl.args())
        if not head:  # the Sinkhorn: a chain of 2 * iters dependent normalisations, on the side stream if given
            with fork(side, X.device):
                _sinkhorn[(N,)](comb, eps, iters=iters, n=n, num_warps=1, **pdl.args())  # warp-local reductions
    return u, post, comb


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
           norm_eps: float, side=None, norm_weight: torch.Tensor | None = None, invariant: bool = False,
           partials: torch.Tensor | None = None):
    """X [N, n, d] -> (u [N, d] in X's dtype, post [N, n], comb [N, n, n] fp32), as ``model.mhc.hc_pre``
    (with ``norm_weight``: u RMS-normed, ``norm_eps``). ``side``: a stream (``side_stream``) the Sinkhorn forks
    onto; comb is then ready only after a join with it, and must stay alive until then. ``invariant``: a
    token's bits whatever N (``mix_loop``). ``partials``: X's mixing partials for ``fn`` as the write-back that
    wrote X computed them (``hc_post_mix``); the collapse's first launch is then not run."""
    return _collapse_launch(X, fn, base, scale, iters, eps, norm_eps, head=False, side=side, norm_weight=norm_weight,
                            invariant=invariant, partials=partials)


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float, norm_weight: torch.Tensor | None = None, invariant: bool = False) -> torch.Tensor:
    """X [N, n, d] -> [N, d] in X's dtype, as ``model.mhc.hc_head`` (with ``norm_weight`` RMS-normed)."""
    return _collapse_launch(X, fn, base, scale, 1, eps, norm_eps, head=True, norm_weight=norm_weight,
                            invariant=invariant)[0]


def hc_post(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """y [N, d], X [N, n, d] -> X' [N, n, d] in X's dtype, as ``model.mhc.hc_post``."""
    N, n, d = X.shape
    X, y = X.contiguous(), y.contiguous()
    out = torch.empty_like(X)
    if N:
        block = BLOCK_D if N < POST_WIDE_TOKENS else 2 * BLOCK_D
        _post[(N, triton.cdiv(d, block))](y, X, post.float().contiguous(), comb.float().contiguous(), out, d, n=n,
                                          BLOCK=block, num_warps=POST_WARPS, **pdl.args())
    return out


def fuses(X: torch.Tensor) -> bool:
    """Whether ``hc_post_mix`` takes X (its kernel is written for 4 streams)."""
    return usable(X) and X.shape[1] == 4


def hc_post_mix(y: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor,
                invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``hc_post`` (4 streams) and the next collapse's mixing partials of its output for the mixing rows ``fn``
    in one kernel (``_post_mix``): (X' [N, 4, d] in X's dtype, partials [N, 4 * CB, R + 1] float32 for
    ``hc_pre(X', fn, ..., partials=)``), chunks of ``mix_loop``'s run (``invariant`` as there)."""
    N, n, d = X.shape
    if n != 4:
        raise ValueError(f"hc_post_mix takes 4 streams, not {n}")
    R = fn.shape[0]
    X, y = X.contiguous(), y.contiguous()
    fn = fn.float().contiguous()
    loop = mix_loop(N, n * d, invariant)
    CB = triton.cdiv(d, POST_MIX_BLOCK * loop)
    out = torch.empty_like(X)
    P = torch.empty(N, n * CB, R + 1, dtype=torch.float32, device=X.device)
    if N:
        _post_mix[(triton.cdiv(N, MIX_TOKENS), CB)](y, X, post.float().contiguous(), comb.float().contiguous(), out,
                                                   fn, P, N, d, loop, R=R, RP=_rp(R), BLOCK=POST_MIX_BLOCK,
                                                   TOKENS=MIX_TOKENS, BF16=MIX_BF16 and X.dtype == torch.bfloat16,
                                                   num_warps=POST_MIX_WARPS, **pdl.args())
    return out, P
