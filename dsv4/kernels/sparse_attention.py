"""Sparse sink attention reading the KV cache in place.

Each query token n attends to keys named by row indices into cache tensors (the sliding-window ring
rows, then the compressed entries it sees), all heads sharing the one K=V vector per key, with a per-head
sink logit in the softmax denominator:

    o[n, h] = sum_j exp(q[n,h].k_j * scale) k_j / (sum_j exp(q[n,h].k_j * scale) + exp(sink[h]))

``sparse_sink_attention_ref`` is the plain-torch twin (gather, then ``sink_attention``).

Two Triton paths, each with programs of ``BLOCK_H`` heads of one token (q rows share every key read):

* single pass (``_sparse_sink_attn_kernel``, grid (N, head blocks)): one program runs over all K1 + K2 keys
  of its token (one loop over both sources' blocks, up to the token's last valid column of each) with an
  online softmax that starts from the sink. Taken when N x head blocks fills the GPU
  well enough (``split_for``); from ``WIDE_TOKENS`` tokens on (prefill chunks) with the wide tile of
  ``wide_tile``: 64 heads a program, so each key is read once per token.
* split KV, flash decoding (``_split_partial_kernel`` then ``_split_merge_kernel``), taken for small batches:
  each source's key columns are cut into chunks of SPLIT keys (32 or 64; source 1's chunks, then source 2's;
  no chunk spans both), C = cdiv(K1, SPLIT) + cdiv(K2, SPLIT). The first kernel, grid (head blocks, C, N), computes a
  chunk's running max m, denominator l and unnormalised sum acc in fp32 into scratch (acc [N, C, H, D], m
  and l [N, C, H]; N*C*H*(D + 2) floats); a chunk with no valid key stores only m = -inf, l = 0. The
  second kernel, grid (head blocks, D / ``MERGE_D``, N), merges a token's chunks in order, ``MERGE_C`` at a
  time, starting from the sink (m = sink, l = exp(sink - m) = 1, acc = 0; the sink has no value):
  m' = max(m, m_c), l = l exp(m - m') + sum_c l_c exp(m_c - m'), likewise acc; an empty chunk has weight
  exp(-inf - m') = 0 and its acc is never read, so it merges to exactly nothing (m' stays finite, no
  -inf - -inf). Then acc / l in q's dtype; a token with no valid key gets 0.

Batch invariance: within a path, a token's result depends on its own rows and on the tables' column counts
K1, K2 alone (the split path's chunking follows from K1, K2; every tile size from H, D and the dtype; the single
pass depends on the token's own rows alone). The path and the tile
follow from N (``split_for``, ``WIDE_TOKENS``), so across their thresholds a token's rounding depends on the
batch size; ``split=0`` keeps one path and tile for every N. Within
a path, extra trailing columns of the last source that are invalid for the token (the compressed entries'
table padded wider for other requests) change nothing either: they add exact zeros, in empty chunks
appended after all others. No host syncs and shapes fixed by the tables: both paths can be captured in a
CUDA graph.
"""

from __future__ import annotations

import torch

from . import HAVE_TRITON, on, pdl
from . import norm as norm_kernel
from .fp8 import FP8_BLOCK, dequantize_fp8
from . import rope as rope_kernel
from .rope import angles_fit


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


BLOCK_H = 16   # heads per program (the dots' M)
MERGE_C = 16   # chunks merged per step of the merge kernel
MERGE_D = 32   # slice of D per merge program


def sparse_sink_attention_ref(q: torch.Tensor, sources, sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, H, D]; sources: [(rows [R, D], index [N, K], valid [N, K]) or (..., row scales [R, D/64]) for
    an FP8 cache, ...] -> [N, H, D]."""
    keys, masks = [], []
    for rows, index, valid, *fp8_scale in sources:
        idx = index.clamp(min=0)
        if fp8_scale:  # dequantised as the cache reads it: value * its 64-block's scale, rounded to q's dtype
            flat = idx.reshape(-1)
            got = dequantize_fp8(rows[flat], fp8_scale[0][flat], q.dtype).view(*idx.shape, rows.shape[1])
        else:
            got = rows[idx]
        keys.append(torch.where(valid[..., None], got, 0).to(q.dtype))
        masks.append(valid)
    k, m = torch.cat(keys, dim=1), torch.cat(masks, dim=1)
    return sink_attention(q.unsqueeze(1), k, m.unsqueeze(1), sink, scale).squeeze(1)


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .norm import norm_rope_halves
    from .pdl import enter
    from .rope import angle_inputs, angles, rotate_pairs

    @triton.jit
    def _exp(x, EXP: tl.constexpr):
        """EXP 0: e**x (``tl.exp``, which the compiler takes as 2**(x log2 e) with a guard against a subnormal
        result: four instructions an element); 1: 2**x (``tl.exp2``, the Triton interpreter's); 2: 2**x by one
        ``ex2.approx.ftz`` (a subnormal result flushed to 0), as ``tl.exp2`` computes it otherwise."""
        if EXP == 2:
            return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        elif EXP == 1:
            return tl.exp2(x)
        else:
            return tl.exp(x)

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        """a @ b in float32 (IEEE: exact float32 products, not TF32)."""
        if IEEE:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    @triton.jit
    def _rescaled(l, alpha, SPLIT_S: tl.constexpr):
        """The denominator l times each row's alpha (SPLIT_S: l [BH, BK], partial sums by column)."""
        if SPLIT_S:
            return l * alpha[:, None]
        else:
            return l * alpha

    @triton.jit
    def _plus_weights(l, p, SPLIT_S: tl.constexpr):
        """The denominator l plus the block's weights p [BH, BK] (SPLIT_S: by column, else their row sums)."""
        if SPLIT_S:
            return l + p
        else:
            return l + tl.sum(p, axis=1)

    @triton.jit
    def _attend_block(q, m, l, acc, kv, ok, scale, IEEE: tl.constexpr, TAU: tl.constexpr = 0.0,
                      EXP: tl.constexpr = 0, SPLIT_S: tl.constexpr = False, side=0):
        """One block of keys into the online softmax (m, l, acc); kv [BK, D] is 0 where not ok. EXP (``_exp``) > 0:
        the scores, m and ``scale`` in units of log2 (the caller's scale times log2 e), the weights 2**(s - m).
        TAU > 0 (m finite: the single pass starts it at the sink): the running max moves, and l and acc are
        rescaled, only when some row's max would grow by more than TAU; otherwise the block's weights are taken
        against the old max (at most e**TAU, or 2**TAU, exact in float32 and in range for the value dot), and the
        result is the same up to rounding. SPLIT_S: the scores' product written on both sides of a branch on
        ``side`` (a runtime value; the same product either way): its result then reaches the value dot only
        through the branch's yield, so Triton does not lay it out as the head of a chain of dots (every warp along
        its rows: with 64 rows and 8 warps both warpgroups compute all of it) but splits its columns between the
        warpgroups, which then share the weights through shared memory; the compiled code keeps one product. l
        is then [BH, BK], each row's partial sums by column, which the caller sums once after its loop (a row sum
        a block would cross the warpgroups: 9 barriers a block against 6, sm_90)."""
        if SPLIT_S:
            if side:
                s = _dot(q, tl.trans(kv), IEEE)
            else:
                s = _dot(q, tl.trans(kv), IEEE)
        else:
            s = _dot(q, tl.trans(kv), IEEE)
        s = tl.where(ok[None, :], s * scale, float("-inf"))  # [BH, BK]
        if TAU > 0:
            m_new = tl.maximum(m, tl.max(s, axis=1))
            if tl.max(m_new - m, axis=0) > TAU:  # one branch for the program: rescale every row or none
                alpha = _exp(m - m_new, EXP)
                l = _rescaled(l, alpha, SPLIT_S)
                acc = acc * alpha[:, None]
                m = m_new
            p = _exp(s - m[:, None], EXP)
            l = _plus_weights(l, p, SPLIT_S)
            acc = acc + _dot(p.to(kv.dtype), kv, IEEE)
            m_out = m
        else:
            m_new = tl.maximum(m, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no -inf - -inf
            alpha = _exp(m - m_use, EXP)
            p = _exp(s - m_use[:, None], EXP)
            l = _plus_weights(_rescaled(l, alpha, SPLIT_S), p, SPLIT_S)
            acc = acc * alpha[:, None] + _dot(p.to(kv.dtype), kv, IEEE)
            m_out = m_new
        return m_out, l, acc

    @triton.jit
    def _fp8_e4m3_to_f32(b):
        """float8_e4m3fn bytes (as int32 0..255) -> fp32, exactly: normals rebuilt as fp32 bits, subnormals
        m * 2^-9 (no NaN: the cache clamps to +-448 before it stores)."""
        sign = (b >> 7) & 1
        e = (b >> 3) & 15
        m = b & 7
        normal = ((sign << 31) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        sub = m.to(tl.float32) * 0.001953125
        return tl.where(e == 0, tl.where(sign == 1, -sub, sub), normal)

    @triton.jit
    def _load_block(n, KV, stride_kv, SC, stride_sc, IDX, VAL, stride_i, K, offs_k, D: tl.constexpr,
                    FP8: tl.constexpr, FP8_BLOCK: tl.constexpr):
        """Key columns offs_k (those < K) of token n: kv [BK, D] (0 where not valid) and the valid mask. FP8:
        KV holds the e4m3 bytes and SC a float32 scale per row and FP8_BLOCK values; kv is then their
        product in fp32 (the caller rounds it to q's dtype, as the cache's reads do)."""
        in_range = offs_k < K
        idx = tl.load(IDX + n * stride_i + offs_k, mask=in_range, other=0)
        ok = (tl.load(VAL + n * stride_i + offs_k, mask=in_range, other=0) != 0) & in_range
        offs_d = tl.arange(0, D)
        rows = idx.to(tl.int64)[:, None]
        kv = tl.load(KV + rows * stride_kv + offs_d[None, :], mask=ok[:, None], other=0)
        if FP8:
            sc = tl.load(SC + rows * stride_sc + (offs_d // FP8_BLOCK)[None, :], mask=ok[:, None], other=0.0)
            kv = _fp8_e4m3_to_f32(kv.to(tl.int32)) * sc
        return kv, ok

    @triton.jit
    def _valid_end(VAL, n, stride_i, K, BLOCK: tl.constexpr):
        """1 + the last of token n's K columns that is valid (0 when none is): key blocks past it add nothing."""
        end = 0
        for k0 in range(0, K, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            v = tl.load(VAL + n * stride_i + offs, mask=offs < K, other=0) != 0
            end = tl.maximum(end, tl.max(tl.where(v, offs + 1, 0), axis=0))
        return end

    @triton.jit
    def _norm_rope_q(q, POS, FREQ, n, eps, D: tl.constexpr, R: tl.constexpr, BLOCK_H: tl.constexpr):
        """q [BLOCK_H, D] (one token's heads) RMS-normed per head and its pairs (2i, 2i+1) from D - R on rotated by
        position POS[n] times FREQ[i - (D - R)/2], in q's dtype: ``kernels.norm.rms_norm_rope``'s steps (no
        weight), ``norm_rope_halves``."""
        i = tl.arange(0, D // 2)
        in_rope = i >= (D - R) // 2
        j = tl.where(in_rope, i - (D - R) // 2, 0)
        pos, freq = angle_inputs(POS, FREQ, n, j, in_rope)
        ra, rb = norm_rope_halves(q, pos, pos, pos, freq, in_rope, eps, D, False, BLOCK_H)
        return tl.reshape(tl.join(ra, rb), (BLOCK_H, D)).to(q.dtype)

    @triton.jit
    def _sparse_sink_attn_kernel(Q, stride_qn, stride_qh, SINK, OUT, stride_on, stride_oh, H, scale,
                                 KV1, stride_kv1, SC1, stride_sc1, IDX1, VAL1, stride_i1, K1,
                                 KV2, stride_kv2, SC2, stride_sc2, IDX2, VAL2, stride_i2, K2,
                                 POS, FREQ, q_eps,
                                 D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                                 IEEE: tl.constexpr, FP8: tl.constexpr, FP8_BLOCK: tl.constexpr,
                                 SKIP: tl.constexpr, QNORM: tl.constexpr, R: tl.constexpr, ROPE_OUT: tl.constexpr,
                                 TAU: tl.constexpr, EXP: tl.constexpr, SPLIT_S: tl.constexpr, PDL: tl.constexpr):
        """Single pass, grid (N, head blocks): all K1 + K2 keys of token n in one program, one loop over both
        sources' key blocks (source 1's, then source 2's), so the loads stay pipelined across the switch (a loop
        a source: an 8k-token chunk's CSA layer 3.69 -> 3.36 ms, the window layer 1.34 -> 1.08 on an H100,
        bench/prefill_attention_gpu.py). SKIP (bits 1 and 2: source 1, source 2): that source's blocks end at the
        token's last valid column (the blocks after it add exact zeros: scores -inf, so m, l and acc are
        unchanged). QNORM: q as the projection left it, each head RMS-normed (no weight, q_eps) and its last R
        channels roped by position POS[n] and the table FREQ [R/2] here, as ``kernels.norm.rms_norm_rope`` does
        (rounded to q's dtype after the norm and after the rope), instead of a kernel of its own that writes q and
        this one that reads it back. ROPE_OUT: the output's last R channels of each head then rotated back by the
        same angles (the inverse rope ``Attention.forward`` applies), from the rounded output, as
        ``kernels.rope``'s kernel does after this one. TAU: ``_attend_block``'s lazy rescale (0: every block). EXP:
        its exponential (> 0: ``scale`` given in units of log2, the caller's times log2 e). SPLIT_S: its scores'
        product split between the warpgroups (branching on the block's source)."""
        enter(PDL)
        n = tl.program_id(0)
        offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_d = tl.arange(0, D)
        E1 = K1
        E2 = K2
        if SKIP & 1:
            E1 = _valid_end(VAL1, n, stride_i1, K1, 256)
        if SKIP & 2:
            E2 = _valid_end(VAL2, n, stride_i2, K2, 256)
        q = tl.load(Q + n * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :], mask=hmask[:, None], other=0.0)
        if QNORM:  # normed q parked in the program's own output rows (in L2; the output overwrites them) and read
            # back as a plain load: the dots then take it as they take a loaded q (from registers, the wide
            # tile's loop compiled to 1808 SASS instructions a key block with 92 spill loads, against 1397 and 11)
            dst = OUT + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :]
            tl.store(dst, _norm_rope_q(q, POS, FREQ, n, q_eps, D, R, BLOCK_H).to(OUT.dtype.element_ty),
                     mask=hmask[:, None])
            tl.debug_barrier()  # the program's stores before its loads (bar.sync: visible to the whole CTA)
            q = tl.load(dst, mask=hmask[:, None], other=0.0, cache_modifier=".cg")
        # the sink starts the running max and contributes exp(sink - m) to the denominator, no value
        m = tl.load(SINK + offs_h, mask=hmask, other=0.0).to(tl.float32)
        if EXP:
            m = m * 1.4426950408889634  # log2 e: the max in the scores' units
        if SPLIT_S:  # the denominator's partial sums by column (the sink's 1 in column 0), summed after the loop
            l = tl.where(tl.arange(0, BLOCK_K)[None, :] == 0, 1.0, tl.zeros([BLOCK_H, BLOCK_K], tl.float32))
        else:
            l = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)
        nb1 = tl.cdiv(E1, BLOCK_K)
        for b in range(0, nb1 + tl.cdiv(E2, BLOCK_K)):  # source 1's blocks, then source 2's
            two = b >= nb1
            kv, ok = _load_block(n, tl.where(two, KV2, KV1), tl.where(two, stride_kv2, stride_kv1),
                                 tl.where(two, SC2, SC1), tl.where(two, stride_sc2, stride_sc1),
                                 tl.where(two, IDX2, IDX1), tl.where(two, VAL2, VAL1),
                                 tl.where(two, stride_i2, stride_i1), tl.where(two, K2, K1),
                                 (b - tl.where(two, nb1, 0)) * BLOCK_K + tl.arange(0, BLOCK_K), D, FP8, FP8_BLOCK)
            m, l, acc = _attend_block(q, m, l, acc, kv.to(q.dtype), ok, scale, IEEE, TAU, EXP, SPLIT_S, two)
        if SPLIT_S:
            out = acc / tl.sum(l, axis=1)[:, None]
        else:
            out = acc / l[:, None]
        tl.store(OUT + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=hmask[:, None])
        if ROPE_OUT:  # the rope channels read back rounded (the program's own stores, after a barrier), rotated
            RP: tl.constexpr = R // 2
            tl.debug_barrier()
            c = tl.arange(0, R)
            rot = OUT + n * stride_on + offs_h[:, None] * stride_oh + (D - R) + c[None, :]
            x = tl.load(rot, mask=hmask[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
            i = tl.arange(0, RP)
            cs, sn = angles(POS, FREQ, n, i, i < RP)
            tl.store(rot, rotate_pairs(x, cs, -sn, BLOCK_H, RP).to(OUT.dtype.element_ty), mask=hmask[:, None])

    @triton.jit
    def _chunk_partial(Q, stride_qn, stride_qh, n, row, offs_h, hmask, WS, KV, stride_kv, SC, stride_sc, IDX, VAL,
                       stride_i, K, start, scale, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, FP8_BLOCK: tl.constexpr):
        """Key columns start .. start + SPLIT - 1 (those < K) of one source -> (m, l); acc stored at WS rows
        ``row`` unless no key of the chunk is valid (then m = -inf, l = 0 and nothing else is done)."""
        offs_s = start + tl.arange(0, SPLIT)
        valid = tl.load(VAL + n * stride_i + offs_s, mask=offs_s < K, other=0) != 0
        offs_d = tl.arange(0, D)  # q is loaded with the emptiness test, not after it (wasted if the chunk is empty)
        q = tl.load(Q + n * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :], mask=hmask[:, None], other=0.0)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        if tl.max(valid.to(tl.int32), axis=0) > 0:
            acc = tl.zeros([BLOCK_H, D], tl.float32)
            for k0 in range(0, SPLIT, BLOCK_K):  # constexpr bounds
                kv, ok = _load_block(n, KV, stride_kv, SC, stride_sc, IDX, VAL, stride_i, K,
                                     start + k0 + tl.arange(0, BLOCK_K), D, FP8, FP8_BLOCK)
                m, l, acc = _attend_block(q, m, l, acc, kv.to(q.dtype), ok, scale, IEEE)
            tl.store(WS + row[:, None] * D + offs_d[None, :], acc, mask=hmask[:, None])
        return m, l

    @triton.jit
    def _split_partial_kernel(Q, stride_qn, stride_qh, H, scale, WS, WM, WL, C,
                              KV1, stride_kv1, SC1, stride_sc1, IDX1, VAL1, stride_i1, K1, C1,
                              KV2, stride_kv2, SC2, stride_sc2, IDX2, VAL2, stride_i2, K2,
                              D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
                              SPLIT: tl.constexpr, IEEE: tl.constexpr, FP8: tl.constexpr, FP8_BLOCK: tl.constexpr,
                              PDL: tl.constexpr):
        """Split path, first kernel, grid (head blocks, C, N): chunk c < C1 holds source 1's key columns
        c*SPLIT.., a later one source 2's (c - C1)*SPLIT.. Scratch (fp32): WS acc [N, C, H, D], WM m and
        WL l [N, C, H]."""
        enter(PDL)
        c = tl.program_id(1)
        n = tl.program_id(2)
        offs_h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        row = (n.to(tl.int64) * C + c) * H + offs_h  # [BH] rows of the [N, C, H] scratch
        if c < C1:
            m, l = _chunk_partial(Q, stride_qn, stride_qh, n, row, offs_h, hmask, WS, KV1, stride_kv1, SC1, stride_sc1,
                                  IDX1, VAL1, stride_i1, K1, c * SPLIT, scale, D, BLOCK_H, BLOCK_K, SPLIT, IEEE, FP8,
                                  FP8_BLOCK)
        else:
            m, l = _chunk_partial(Q, stride_qn, stride_qh, n, row, offs_h, hmask, WS, KV2, stride_kv2, SC2, stride_sc2,
                                  IDX2, VAL2, stride_i2, K2, (c - C1) * SPLIT, scale, D, BLOCK_H, BLOCK_K, SPLIT, IEEE,
                                  FP8, FP8_BLOCK)
        tl.store(WM + row, m, mask=hmask)
        tl.store(WL + row, l, mask=hmask)

    @triton.jit
    def _split_merge_kernel(SINK, OUT, stride_on, stride_oh, H, WS, WM, WL, C,
                            D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_D: tl.constexpr,
                            PDL: tl.constexpr):
        """Split path, second kernel, grid (head blocks, D / BLOCK_D, N): token n's C chunks, in order,
        merged from the sink -> OUT[n, head block, slice of D] in OUT's dtype."""
        enter(PDL)
        n = tl.program_id(2)
        offs_h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        hmask = offs_h < H
        # the sink starts the max and adds exp(sink - m) to the denominator, no value
        m = tl.load(SINK + offs_h, mask=hmask, other=0.0).to(tl.float32)
        l = tl.full([BLOCK_H], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for c0 in range(0, C, BLOCK_C):
            offs_c = c0 + tl.arange(0, BLOCK_C)
            row = (n.to(tl.int64) * C + offs_c[:, None]) * H + offs_h[None, :]  # [BC, BH]
            live = (offs_c[:, None] < C) & hmask[None, :]
            mc = tl.load(WM + row, mask=live, other=float("-inf"))
            lc = tl.load(WL + row, mask=live, other=0.0)
            m_new = tl.maximum(m, tl.max(mc, axis=0))  # finite: m starts at the sink
            alpha = tl.exp(m - m_new)
            w = tl.exp(mc - m_new[None, :])  # 0 for an empty chunk (m_c = -inf)
            ac = tl.load(WS + row[:, :, None] * D + offs_d[None, None, :],
                         mask=(live & (mc != float("-inf")))[:, :, None], other=0.0)  # empty chunks: never written
            l = l * alpha + tl.sum(w * lc, axis=0)
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * ac, axis=0)
            m = m_new
        out = acc / l[:, None]
        tl.store(OUT + n * stride_on + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(OUT.dtype.element_ty), mask=hmask[:, None])


SKIP = 2  # the single pass stops a source at the token's last valid column (bits 1, 2: sources 1, 2), the
# compressed entries' only: on an H100 (bench/prefill_attention_gpu.py, one call) an 8k chunk's CSA layer 3.28 ms
# with both, 3.20 with 2; a 1k chunk's CSA 0.515 / 0.328 / 0.299 (none / both / 2), HCA 0.282 / 0.262 / 0.258,
# window 0.202 / 0.198 / 0.196. The window's own skip made an 8k chunk's window layer 1.08 -> 1.13 ms (37th session)


SPLIT_PROGRAMS = 64  # single-pass programs (tokens x head blocks) from which the single pass is faster


def split_for(n: int, hb: int, k1: int, k2: int) -> int:
    """Keys per chunk of the path taken for n tokens of hb head blocks over tables of k1 and k2 columns (0: the
    single-pass kernel). Measured on an H200 (bench/attention_split.py, H=64, D=512, bf16): with 4 programs
    (batch 1) chunks of 32 keys are 1.8x (161 keys) to 4.8x (641 keys) faster than the single pass; with 32
    (batch 8) chunks of 64 are 1.04-1.9x faster; with 128 (batch 32) every split is 2-4x slower. The path
    depends on n, so a token's result (its rounding) depends on the batch size across these thresholds."""
    programs = n * hb
    if programs >= SPLIT_PROGRAMS or k1 + k2 <= 32:
        return 0
    return 32 if programs <= 16 else 64


WIDE_TOKENS = 64  # tokens from which the single pass takes the wide tile (16-bit q only)


def wide_tile(H: int, fp8: bool = False) -> tuple:
    """The single pass's tile for many tokens (prefill chunks, large verify steps): one program holds up to 64
    heads of its token, so it reads each key once for all of them and the dots are 64 rows tall (Hopper's
    warpgroup MMA), keys 64 at a time, two pipeline stages. Measured on an H200 (bench/prefill_attention_gpu.py,
    H=64, D=512, bf16): an 8k-token chunk's CSA layer 3.6 ms against 14.8 with 16 heads a program, the window
    layer 1.26 against 3.5; from 64 tokens on it is faster (CSA at 64 tokens 0.10 against 0.16 ms); at 32 and
    fewer, launch-bound, no difference is measurable, so decode keeps its tiles. An FP8 cache's rows take keys
    32 at a time (their float32 decode does not fit the shared memory with 64; 32 measured 4.2 ms on the bf16
    CSA layer)."""
    return (max(16, min(64, triton.next_power_of_2(H))), 32 if fp8 else 64, 8, 2)


FUSE_Q_NORM = False  # the single pass norms and ropes a raw q itself (``q_norm``); not yet measured on a GPU
FUSE_ROPE_OUT = True  # ... and with it rotates its output back (the inverse rope) in its epilogue
RESCALE_TAU = 0.0  # the single pass's lazy rescale (``_attend_block``'s TAU; 0: every block); not yet measured
# EXP2: the single pass's weights as 2**x, one ex2.approx.ftz each (``_exp``). SPLIT_SCORES: the wide tile's scores
# computed once, their columns split between the warpgroups, rather than by both (``_attend_block``'s SPLIT_S; sm_90
# SASS a key block 36 HGMMA against 68, 1045 instructions against 1397, 6 barriers against 2). Measured together on
# an H100 (bench/prefill_attention_gpu.py --tokens 8192, the path taken, ms, off -> both): the window layer 1.235 ->
# 0.974, HCA 1.385 -> 1.239, CSA 3.242 -> 2.581; alone, EXP2 1.053 / 1.315 / 3.039, SPLIT_SCORES 1.078 / 1.246 /
# 2.677. 8k TTFT (prefill.py, flash-L4-E32, two turns in one call) 51.7 / 50.9 -> 50.6 / 50.1 ms (BENCHMARKS.md,
# forty-first session)
EXP2 = True
SPLIT_SCORES = True


def fuses_q_norm(q: torch.Tensor, sources, split: int | None, rope) -> bool:
    """Whether ``sparse_sink_attention(q, sources, .., split, q_norm=(eps, rope))`` norms and ropes a raw q
    itself: FUSE_Q_NORM on, the kernels on q's device, the single pass taken (``split_for``), and a rope the
    kernel takes (``rope.table`` [R/2] float32, ``rope.positions`` [N] integers); the output then comes back
    rotated back by the same angles. Otherwise the caller norms q first (``model.ops.rms_norm_rope``), passes no
    ``q_norm`` and rotates the output back itself."""
    if not (FUSE_Q_NORM and on(q) and angles_fit(q, rope.table, rope.positions)):
        return False
    N, H, D = q.shape
    K = [src[1].shape[1] for src in sources] + [0]
    return not (split_for(N, triton.cdiv(H, BLOCK_H), K[0], K[1]) if split is None else split)


def _sparse_sink_attention(q: torch.Tensor, sources, sink: torch.Tensor, scale: float,
                           split: int | None = None, tile: tuple | None = None, q_norm=None,
                           fuse: bool | None = None) -> torch.Tensor:
    """The Triton launch on any device Triton runs on (the interpreter's CPU tensors too). ``split``: None =
    ``split_for(K1, K2)``, 0 = single pass, else the split path with chunks of ``split`` keys (a power of two,
    at least 32; tests and bench/attention_split.py). ``tile``: the single pass's (BLOCK_H, BLOCK_K, num_warps,
    num_stages) instead of the default (tests, benches). ``q_norm`` (eps, rope): q is raw, to be RMS-normed per
    head and roped first, and the output rotated back by the same angles (the inverse rope): the single pass does
    both itself when ``fuse`` (default FUSE_Q_NORM; the output's with FUSE_ROPE_OUT and a rope width a power of
    two), any other launch (tests) with the norm's own kernel first and the rope's after (``kernels.norm``,
    ``kernels.rope``; the rope must fit them)."""
    N, H, D = q.shape
    if len(sources) == 1:
        sources = list(sources) + [(sources[0][0], sources[0][1][:, :0], sources[0][2][:, :0], *sources[0][3:])]
    (kv1, i1, v1, *s1), (kv2, i2, v2, *s2) = sources
    fp8 = bool(s1)
    if fp8 != bool(s2):
        raise ValueError("sparse_sink_attention: both key sources are FP8 (with row scales) or neither is")
    if fp8:  # the e4m3 bytes as uint8 (the kernel decodes them); a scale row per cache row
        kv1, kv2, sc1, sc2 = kv1.view(torch.uint8), kv2.view(torch.uint8), s1[0], s2[0]
    else:
        sc1, sc2 = kv1, kv2  # unused pointers
    out = torch.empty_like(q)
    if N == 0:
        return out
    i1, v1, i2, v2 = i1.contiguous(), v1.contiguous(), i2.contiguous(), v2.contiguous()
    K1, K2 = i1.shape[1], i2.shape[1]
    hb = triton.cdiv(H, BLOCK_H)
    ieee = q.dtype == torch.float32
    if split is None:
        split = split_for(N, hb, K1, K2)
        if not split and tile is None and not ieee and N >= WIDE_TOKENS:
            tile = wide_tile(H, fp8)
    block_k = 16 if D >= 512 and ieee else 32
    num_warps = 4 if D <= 128 else 8
    fused = (q_norm is not None and not split and (FUSE_Q_NORM if fuse is None else fuse)
             and angles_fit(q, q_norm[1].table, q_norm[1].positions))
    if q_norm is not None and not fused:
        q = norm_kernel.rms_norm_rope(q, None, q_norm[0], q_norm[1].table, q_norm[1].positions)
    if not split:
        block_h, block_k, num_warps, stages = tile or (BLOCK_H, block_k, num_warps, None)
        extra = {} if stages is None else {"num_stages": stages}
        rope = q_norm[1] if fused else None
        R = 2 * rope.table.shape[-1] if fused else 0
        rope_out = fused and FUSE_ROPE_OUT and R & (R - 1) == 0
        exp = 0 if not EXP2 else 2 if q.is_cuda else 1  # (the interpreter's tensors are on the CPU: no inline PTX)
        _sparse_sink_attn_kernel[(N, triton.cdiv(H, block_h))](
            q, q.stride(0), q.stride(1), sink, out, out.stride(0), out.stride(1), H,
            scale * 1.4426950408889634 if exp else scale,  # (log2 e: the scores in units of log2)
            kv1, kv1.stride(0), sc1, sc1.stride(0), i1, v1, i1.stride(0), K1,
            kv2, kv2.stride(0), sc2, sc2.stride(0), i2, v2, i2.stride(0), K2,
            rope.positions.contiguous() if fused else i1, rope.table.contiguous() if fused else sink,
            q_norm[0] if fused else 0.0,  # (unused pointers and eps without the fused norm)
            D=D, BLOCK_H=block_h, BLOCK_K=block_k, IEEE=ieee, FP8=fp8, FP8_BLOCK=FP8_BLOCK,
            SKIP=SKIP, QNORM=fused, R=R, ROPE_OUT=rope_out, TAU=RESCALE_TAU, EXP=exp,
            SPLIT_S=SPLIT_SCORES and block_h >= 64, num_warps=num_warps, **extra, **pdl.args())
        return _rope_back(out, q_norm) if q_norm is not None and not rope_out else out
    assert split >= 32 and split & (split - 1) == 0, "split: a power of two of at least 32 keys"
    C1 = triton.cdiv(K1, split)
    C = C1 + triton.cdiv(K2, split)
    rows = N * C * H
    ws = torch.empty(rows * (D + 2), device=q.device, dtype=torch.float32)  # one scratch: acc, m, l
    wm, wl = ws[rows * D: rows * (D + 1)], ws[rows * (D + 1):]
    # head blocks fastest: the blocks of one (chunk, token) read the same key rows close together in time
    _split_partial_kernel[(hb, C, N)](  # N, C <= 65535 (decode-like steps only)
        q, q.stride(0), q.stride(1), H, scale, ws, wm, wl, C,
        kv1, kv1.stride(0), sc1, sc1.stride(0), i1, v1, i1.stride(0), K1, C1,
        kv2, kv2.stride(0), sc2, sc2.stride(0), i2, v2, i2.stride(0), K2,
        D=D, BLOCK_H=BLOCK_H, BLOCK_K=block_k, SPLIT=split, IEEE=ieee, FP8=fp8, FP8_BLOCK=FP8_BLOCK,
        num_warps=num_warps, **pdl.args())
    block_d = min(D, MERGE_D)
    _split_merge_kernel[(hb, D // block_d, N)](
        sink, out, out.stride(0), out.stride(1), H, ws, wm, wl, C,
        D=D, BLOCK_H=BLOCK_H, BLOCK_C=MERGE_C, BLOCK_D=block_d, num_warps=4, **pdl.args())
    return _rope_back(out, q_norm) if q_norm is not None else out


def _rope_back(out: torch.Tensor, q_norm) -> torch.Tensor:
    """The output's inverse rope by ``q_norm``'s angles (the rope's kernel, in place), where the attention's
    epilogue did not do it."""
    return rope_kernel.apply_rope(out, q_norm[1].table, q_norm[1].positions, inverse=True, in_place=True)


def sparse_sink_attention(q: torch.Tensor, sources, sink: torch.Tensor, scale: float,
                          split: int | None = None, q_norm=None) -> torch.Tensor:
    """The Triton kernels (one or two key sources). q [N, H, D] (D a power of two) -> [N, H, D]. ``split``:
    None = the path ``split_for`` picks for N tokens (and the wide tile from ``WIDE_TOKENS`` tokens); 0 = always
    the single pass with its default tile (batch-invariant). ``q_norm`` (eps, rope): q is raw, normed and roped
    in the single pass's prologue, and the output is returned rotated back (the inverse rope); only where
    ``fuses_q_norm`` says it is."""
    if q_norm is not None and not fuses_q_norm(q, sources, split, q_norm[1]):
        raise ValueError("sparse_sink_attention: q_norm only where fuses_q_norm holds; norm q first otherwise")
    if not on(q):
        return sparse_sink_attention_ref(q, sources, sink, scale)
    return _sparse_sink_attention(q, sources, sink, scale, split, q_norm=q_norm, fuse=q_norm is not None)
