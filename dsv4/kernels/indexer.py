"""The lightning indexer's scores and top-k, reading the index keys in the cache in place.

Two kernels per CSA layer and step, for N query tokens whose visible compressed entries are named by a row
table ``rows`` [N, E] (with ``valid`` [N, E]) into the layer's index-key storage [R, dI]:

- ``_index_scores_kernel``: I(n, e) = sum_h w[n, h] * scale * ReLU(q[n, h] . key[rows[n, e]]), one program per
  (token, run of up to 8 blocks of 64 entries), all heads in one ``tl.dot`` a block; -inf where the entry is not
  visible (a block with none visible skips its loads and product).
- ``_index_scores_shared_kernel`` (from SHARED_MIN_TOKENS tokens, outside batch invariance): the same scores in
  tiles of 64 tokens x 128 entries. A prompt's tokens name their request's entries, so a tile's keys are loaded
  once and each head is a [64, dI] x [dI, 128] GEMM whose ReLU is weighted into a running sum over the heads;
  a tile whose tokens name different rows (two requests meet in it) takes a token at a time. An 8k prompt's
  scores: 1611 -> 601 us on an H100 (bench/prefill_small_kernels_gpu.py). The heads are summed in another order
  than the per-token kernel's, so a token's bits depend on which kernel N picks.
- ``_topk_rows_kernel``: one program per token selects the k highest scores by a radix select over the
  scores' bits (four 8-bit histogram passes find the k-th largest value exactly), then writes the selected
  entries' rows in column order, ties at the threshold broken by the lowest column. Tokens with at most k
  visible entries select all of them (and skip the last three passes). The passes after the first and the
  selection stop at the token's last visible column (a prompt's token sees a prefix of its columns). The output
  is [N, k] rows + valid, which the attention kernel reads like any other row table, so it reads k entries per
  token instead of all E.

Twins: ``index_scores_torch`` (gather, then ``dsv4.model.ops.index_scores``) and ``topk_rows_torch`` (a stable
descending sort). The per-token scores kernel and the top-k compute a token's result from that token's inputs
alone (batch-invariant); under batch invariance the scores never take the tiles.
"""

from __future__ import annotations

import torch

from . import HAVE_TRITON, on, pdl


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, n_heads: int,
                 head_dim: int) -> torch.Tensor:
    """Lightning-indexer scores I(t, s) = sum_h w_h(t) * nI^-1/2 * ReLU(q_h(t) . k_s) * dI^-1/2.

    q: [G, Tq, nI, dI]; weights: [G, Tq, nI]; keys: [G, E, dI]. Returns [G, Tq, E] fp32.
    """
    dots = torch.einsum("gthd,ged->gthe", q.float(), keys.float())
    w = weights.float() * n_heads ** -0.5
    return (torch.relu(dots) * head_dim ** -0.5 * w.unsqueeze(-1)).sum(dim=2)


def index_scores_torch(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                       valid: torch.Tensor) -> torch.Tensor:
    """q [N, nI, dI], w [N, nI], keys [R, dI], rows/valid [N, E] -> scores [N, E] fp32, -inf where not valid."""
    gathered = torch.where(valid[..., None], keys[rows], torch.zeros((), dtype=keys.dtype, device=keys.device))
    s = index_scores(q.unsqueeze(1), w.unsqueeze(1), gathered, q.shape[1], q.shape[2]).squeeze(1)
    return s.masked_fill(~valid, float("-inf"))


def topk_rows_torch(scores: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [N, E] (-inf = not visible), rows [N, E] -> (rows [N, k], valid [N, k]) of the k highest scores in
    column order; ties go to the lowest column; fewer than k visible entries leave the tail invalid (row 0)."""
    E = scores.shape[1]
    k = min(k, E)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    picked = scores.gather(1, order) > float("-inf")
    cols = torch.where(picked, order, E).sort(dim=1).values  # visible picks in column order, then E for the rest
    valid = cols < E
    return torch.where(valid, rows.gather(1, cols.clamp(max=max(E - 1, 0))), 0), valid


if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter

    @triton.jit
    def _token_scores(q, w, KEYS, stride_k, row_ptrs, ok, offs_d, dmask, IEEE: tl.constexpr):
        """One token's scores over a block of entries: q [BH, BD] and w [BH] (scaled) against the keys of the rows
        at ``row_ptrs`` where ``ok``, all heads in one dot, their ReLU weighted and summed over the heads."""
        rows = tl.load(row_ptrs, mask=ok, other=0)
        k = tl.load(KEYS + rows.to(tl.int64)[:, None] * stride_k + offs_d[None, :], mask=ok[:, None] & dmask[None, :],
                    other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [BH, BLOCK_E] fp32
        return tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)

    @triton.jit
    def _index_scores_kernel(Q, stride_qn, stride_qh, W, stride_wn, KEYS, stride_k, ROWS, VALID, stride_r,
                             OUT, stride_o, E, scale, NH: tl.constexpr, DI: tl.constexpr, BH: tl.constexpr,
                             BD: tl.constexpr, BLOCK_E: tl.constexpr, BLOCKS: tl.constexpr, IEEE: tl.constexpr,
                             PDL: tl.constexpr):
        """Token n's entries [e0, e0 + BLOCKS * BLOCK_E): q and w loaded once, then a block of entries at a time;
        a block with no visible entry (a causal prefill's later columns) is stored -inf without its loads or
        product."""
        enter(PDL)
        n = tl.program_id(0)
        offs_h = tl.arange(0, BH)
        offs_d = tl.arange(0, BD)
        hmask, dmask = offs_h < NH, offs_d < DI
        q = tl.load(Q + n * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :],
                    mask=hmask[:, None] & dmask[None, :], other=0.0)
        w = tl.load(W + n * stride_wn + offs_h, mask=hmask, other=0.0).to(tl.float32) * scale
        for blk in range(BLOCKS):
            offs_e = (tl.program_id(1) * BLOCKS + blk) * BLOCK_E + tl.arange(0, BLOCK_E)
            in_range = offs_e < E
            ok = (tl.load(VALID + n * stride_r + offs_e, mask=in_range, other=0) != 0) & in_range
            if tl.max(ok.to(tl.int32), axis=0) > 0:
                score = _token_scores(q, w, KEYS, stride_k, ROWS + n * stride_r + offs_e, ok, offs_d, dmask, IEEE)
                tl.store(OUT + n * stride_o + offs_e, tl.where(ok, score, float("-inf")), mask=in_range)
            else:
                tl.store(OUT + n * stride_o + offs_e, tl.full([BLOCK_E], float("-inf"), tl.float32), mask=in_range)

    @triton.jit
    def _index_scores_shared_kernel(Q, stride_qn, stride_qh, W, stride_wn, KEYS, stride_k, ROWS, VALID, stride_r,
                                    OUT, stride_o, N, E, scale, NH: tl.constexpr, DI: tl.constexpr,
                                    BH: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, BLOCK_E: tl.constexpr,
                                    IEEE: tl.constexpr, PDL: tl.constexpr):
        """Grid (cdiv(N, BT), cdiv(E, BLOCK_E)): BT tokens x BLOCK_E entries. Where every token of the tile names
        the same rows in the columns it sees (a prompt's tokens share their request's entries), the keys are
        loaded once and the scores are a GEMM per head on the tensor cores, [BT, dI] x [dI, BLOCK_E], its ReLU
        weighted into a running sum over the heads in order; otherwise each token of the tile takes the per-token
        product (``_index_scores_kernel``'s, one block). A tile with no visible entry stores -inf only."""
        enter(PDL)
        t = tl.program_id(0) * BT + tl.arange(0, BT)
        offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        offs_d = tl.arange(0, BD)
        tmask, emask, dmask = t < N, offs_e < E, offs_d < DI
        live = tmask[:, None] & emask[None, :]
        tile = t.to(tl.int64)[:, None] * stride_r + offs_e[None, :]
        ok = (tl.load(VALID + tile, mask=live, other=0) != 0) & live
        if tl.max(tl.max(ok.to(tl.int32), axis=1), axis=0) == 0:
            tl.store(OUT + t.to(tl.int64)[:, None] * stride_o + offs_e[None, :],
                     tl.full([BT, BLOCK_E], float("-inf"), tl.float32), mask=live)
        else:
            rows = tl.load(ROWS + tile, mask=ok, other=0)
            last = tl.minimum(tl.program_id(0) * BT + BT, N) - 1  # the tile's last token sees the most entries
            ref = tl.load(ROWS + last.to(tl.int64) * stride_r + offs_e, mask=emask, other=0)
            shared = tl.min(tl.min(((rows == ref[None, :]) | ~ok).to(tl.int32), axis=1), axis=0) == 1
            if shared:
                seen = tl.max(ok.to(tl.int32), axis=0) != 0  # [BLOCK_E]: columns some token sees
                k = tl.load(KEYS + ref.to(tl.int64)[:, None] * stride_k + offs_d[None, :],
                            mask=seen[:, None] & dmask[None, :], other=0.0)
                acc = tl.zeros([BT, BLOCK_E], tl.float32)
                for h in range(NH):
                    a = tl.load(Q + t.to(tl.int64)[:, None] * stride_qn + h * stride_qh + offs_d[None, :],
                                mask=tmask[:, None] & dmask[None, :], other=0.0)
                    if IEEE:
                        s = tl.dot(a, tl.trans(k), input_precision="ieee")
                    else:
                        s = tl.dot(a, tl.trans(k))  # [BT, BLOCK_E] fp32
                    wh = tl.load(W + t * stride_wn + h, mask=tmask, other=0.0).to(tl.float32) * scale
                    acc += tl.maximum(s, 0.0) * wh[:, None]
                tl.store(OUT + t.to(tl.int64)[:, None] * stride_o + offs_e[None, :], tl.where(ok, acc, float("-inf")),
                         mask=live)
            else:
                offs_h = tl.arange(0, BH)
                hmask = offs_h < NH
                for i in range(BT):
                    n = tl.program_id(0) * BT + i
                    if n < N:
                        ok_n = (tl.load(VALID + n * stride_r + offs_e, mask=emask, other=0) != 0) & emask
                        q = tl.load(Q + n * stride_qn + offs_h[:, None] * stride_qh + offs_d[None, :],
                                    mask=hmask[:, None] & dmask[None, :], other=0.0)
                        w = tl.load(W + n * stride_wn + offs_h, mask=hmask, other=0.0).to(tl.float32) * scale
                        score = _token_scores(q, w, KEYS, stride_k, ROWS + n * stride_r + offs_e, ok_n, offs_d, dmask,
                                              IEEE)
                        tl.store(OUT + n * stride_o + offs_e, tl.where(ok_n, score, float("-inf")), mask=emask)

    @triton.jit
    def _ordered_key(x):
        """fp32 -> int64 in [0, 2^32), ascending with x (negative floats have their magnitude bits flipped)."""
        i = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)  # -0.0 ranks with +0.0, as in torch
        return (i ^ ((i >> 31) & 0x7FFFFFFF)).to(tl.int64) + 2147483648

    @triton.jit
    def _radix_digit(hist, bins, remaining, prefix, shift):
        """One radix pass's choice: the digit d (at ``shift``) of the k-th largest key among those counted in
        ``hist``, how many keys with the new prefix still belong to the top k, and the prefix with d in it."""
        at_or_above = tl.cumsum(hist, reverse=True)  # keys (with this prefix) whose digit is >= bin
        d = tl.max(tl.where(at_or_above >= remaining, bins, 0))
        remaining -= tl.sum(tl.where(bins > d, hist, 0))
        return remaining, prefix | (d.to(tl.int64) << shift)

    @triton.jit
    def _topk_rows_kernel(S, stride_s, ROWS, stride_r, OUT_R, OUT_V, stride_o, E, K, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
        enter(PDL)
        n = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        bins = tl.arange(0, 256)
        # radix select from the top byte: after pass p, `prefix` holds the top 8(p+1) bits of the k-th largest
        # key and `remaining` how many of the keys sharing those bits still belong to the top k. The first pass
        # also finds the token's last visible column (`end`, 0 when none): the later passes and the selection
        # stop there (a causal prefill's token sees a prefix of its entries' columns, and the columns after it
        # are -inf; the loads keep E's mask, which the compiler can vectorise); a token with at most K visible
        # entries takes them all and skips the later passes
        hist = tl.zeros([256], tl.int32)
        end = 0
        for e0 in range(0, E, BLOCK):
            x = tl.load(S + n * stride_s + e0 + offs, mask=e0 + offs < E, other=float("-inf"))
            ok = x > float("-inf")
            hist += tl.histogram(((_ordered_key(x) >> 24) & 255).to(tl.int32), 256, mask=ok)
            end = tl.maximum(end, tl.max(tl.where(ok, e0 + offs + 1, 0)))
        total = tl.sum(hist)
        remaining, prefix = _radix_digit(hist, bins, K, tl.zeros([], tl.int64), 24)
        if total > K:
            for p in tl.static_range(1, 4):
                shift = 24 - 8 * p
                hist = tl.zeros([256], tl.int32)
                for e0 in range(0, end, BLOCK):
                    x = tl.load(S + n * stride_s + e0 + offs, mask=e0 + offs < E, other=float("-inf"))
                    key = _ordered_key(x)
                    ok = (x > float("-inf")) & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
                    hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=ok)
                remaining, prefix = _radix_digit(hist, bins, remaining, prefix, shift)
        # select keys above the threshold, and the first `remaining` keys equal to it, in column order; a token
        # with at most K visible entries takes them all
        take_all = total <= K
        thr = tl.where(take_all, -1, prefix)
        need = tl.where(take_all, 0, remaining)
        count = 0
        ties = 0
        for e0 in range(0, end, BLOCK):
            x = tl.load(S + n * stride_s + e0 + offs, mask=e0 + offs < E, other=float("-inf"))
            key = _ordered_key(x)
            ok = x > float("-inf")
            eq = (ok & (key == thr)).to(tl.int32)
            sel = ok & ((key > thr) | ((eq != 0) & (ties + tl.cumsum(eq) - eq < need)))
            s32 = sel.to(tl.int32)
            pos = count + tl.cumsum(s32) - s32
            r = tl.load(ROWS + n * stride_r + e0 + offs, mask=sel, other=0)
            tl.store(OUT_R + n * stride_o + pos, r, mask=sel)
            count += tl.sum(s32)
            ties += tl.sum(eq)
        for k0 in range(0, K, BLOCK):
            ko = k0 + offs
            tl.store(OUT_V + n * stride_o + ko, (ko < count).to(tl.int8), mask=ko < K)
            tl.store(OUT_R + n * stride_o + ko, tl.zeros([BLOCK], OUT_R.dtype.element_ty),
                     mask=(ko >= count) & (ko < K))


SCORE_BLOCKS = 8  # blocks of 64 entries a prefill's scores program takes one after another (q loaded once)
SHARED_MIN_TOKENS = 256  # tokens from which the scores take the tiles of tokens x entries (outside batch invariance)
SHARED_TILE = (64, 128, 8, 3)  # tokens, entries, warps, stages of ``_index_scores_shared_kernel``


def usable(q: torch.Tensor) -> bool:
    return on(q)


def index_scores_cuda(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                      valid: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """The scores kernels: same contract as ``index_scores_torch``. From SHARED_MIN_TOKENS tokens on, unless
    ``invariant``, tiles of tokens x entries (a GEMM a head where the tile's tokens share their rows); otherwise,
    and always under batch invariance, a token at a time (its bits independent of the batch)."""
    N, nI, dI = q.shape
    E = rows.shape[1]
    q = q if q.stride(-1) == 1 else q.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    rows, valid = rows.contiguous(), valid.contiguous()
    out = torch.empty(N, E, dtype=torch.float32, device=q.device)
    if N == 0 or E == 0:
        return out
    BH, BD = max(16, triton.next_power_of_2(nI)), max(16, triton.next_power_of_2(dI))
    scale = (nI * dI) ** -0.5
    if N >= SHARED_MIN_TOKENS and not invariant:
        bt, be, warps, stages = SHARED_TILE
        _index_scores_shared_kernel[(triton.cdiv(N, bt), triton.cdiv(E, be))](
            q, q.stride(0), q.stride(1), w, w.stride(0), keys, keys.stride(0), rows, valid, rows.stride(0),
            out, out.stride(0), N, E, scale, NH=nI, DI=dI, BH=BH, BD=BD, BT=bt, BLOCK_E=be,
            IEEE=q.dtype == torch.float32, num_warps=warps, num_stages=stages, **pdl.args())
        return out
    block_e = 64
    # a run of blocks a program where the grid stays large (prefill), one block where it would get small (decode);
    # a block's scores are the same bits either way
    blocks = SCORE_BLOCKS if N * triton.cdiv(E, block_e) >= 8192 else 1
    _index_scores_kernel[(N, triton.cdiv(E, block_e * blocks))](
        q, q.stride(0), q.stride(1), w, w.stride(0), keys, keys.stride(0), rows, valid, rows.stride(0),
        out, out.stride(0), E, scale, NH=nI, DI=dI, BH=BH, BD=BD, BLOCK_E=block_e, BLOCKS=blocks,
        IEEE=q.dtype == torch.float32, num_warps=4, **pdl.args())
    return out


def topk_rows_cuda(scores: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k kernel: same contract as ``topk_rows_torch``."""
    N, E = scores.shape
    k = min(k, E)
    out_r = torch.empty(N, k, dtype=rows.dtype, device=rows.device)
    out_v = torch.empty(N, k, dtype=torch.bool, device=rows.device)
    if N and k:
        scores, rows = scores.contiguous(), rows.contiguous()
        _topk_rows_kernel[(N,)](scores, scores.stride(0), rows, rows.stride(0), out_r, out_v.view(torch.int8),
                                out_r.stride(0), E, k, BLOCK=1024, num_warps=8, **pdl.args())
    return out_r, out_v


def select_top_rows(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                    valid: torch.Tensor, k: int, invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The indexer's selection for tokens that each gather their own entries: (rows [N, k], valid [N, k]).
    ``invariant``: batch invariance (the scores a token at a time whatever N)."""
    if usable(q):
        return topk_rows_cuda(index_scores_cuda(q, w, keys, rows, valid, invariant), rows, k)
    return topk_rows_torch(index_scores_torch(q, w, keys, rows, valid), rows, k)
