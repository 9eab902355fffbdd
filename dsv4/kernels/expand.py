"""A step plan's tables from its per-row vector in 1 + 2 * (number of ratios) kernels instead of about 175
small torch ops (which a CUDA graph of a decode step would replay every step). The plain-torch twin is
``dsv4.cache.plan.expand_rows_torch``; the combined index space and every table are described in plan.py.

Runtime sizes are not specialised on (``do_not_specialize``): a new batch or chunk size reuses the compiled
kernel unless it crosses a power of two. Each program recomputes the few per-row sums it needs (rows are at most a few hundred): the token of
index t belongs to the row whose cumulative token count first exceeds t, window m to the row whose
cumulative window count first exceeds m.
"""

from __future__ import annotations

import torch

from . import HAVE_TRITON, on, pdl

BLOCK_T = 16   # tokens per program
BLOCK_E = 128  # entry columns per program
BLOCK_W = 16   # windows per program

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from .pdl import enter

    @triton.jit
    def _token_rows(ROWS, B, N, t, BP: tl.constexpr):
        """Per token: real, batch row, first token of its row, offset in its row, position, and its row's
        C, n and slot."""
        b = tl.arange(0, BP)
        mb = b < B
        n = tl.load(ROWS + B + b, mask=mb, other=0)
        ends = tl.cumsum(n, axis=0)
        real = (t < tl.sum(n, axis=0)) & (t < N)
        seq = tl.sum(((ends[None, :] <= t[:, None]) & mb[None, :]).to(tl.int64), axis=1)
        seq = tl.where(real, tl.minimum(seq, B - 1), 0)
        qs = tl.sum(tl.where(b[None, :] < seq[:, None], n[None, :], 0), axis=1)
        C = tl.load(ROWS + seq)
        off = t - qs
        pos = tl.where(real, C + off, 0)
        return real, seq, qs, off, pos, C, tl.load(ROWS + B + seq), tl.load(ROWS + 2 * B + seq)

    @triton.jit(do_not_specialize=["B", "N"])
    def _expand_tokens(ROWS, B, N, S, swa_base, POS, SEQ, QS, LAST, SWA_READ, SWA_VALID, SWA_WRITE,
                       W: tl.constexpr, WP: tl.constexpr, BP: tl.constexpr, BT: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        pid = tl.program_id(0)
        t = pid * BT + tl.arange(0, BT)
        mt = t < N
        real, seq, qs, off, pos, C, n_t, slot = _token_rows(ROWS, B, N, t, BP)
        tl.store(POS + t, pos, mask=mt)
        tl.store(SEQ + t, seq, mask=mt)
        i = tl.arange(0, WP)
        kp = pos[:, None] - (W - 1) + i[None, :]
        valid = (kp >= 0) & real[:, None]
        ring = slot[:, None] * S + tl.maximum(kp, 0) % S
        read = tl.where(kp >= C[:, None], swa_base + qs[:, None] + kp - C[:, None], ring)
        m2 = mt[:, None] & (i < W)[None, :]
        tl.store(SWA_READ + t[:, None] * W + i[None, :], tl.where(valid, read, 0), mask=m2)
        tl.store(SWA_VALID + t[:, None] * W + i[None, :], valid, mask=m2)
        tl.store(SWA_WRITE + t, tl.where(real & (off >= n_t - S), slot * S + pos % S, 0), mask=mt)
        if pid == 0:  # the per-row vectors
            b = tl.arange(0, BP)
            mb = b < B
            n = tl.load(ROWS + B + b, mask=mb, other=0)
            ends = tl.cumsum(n, axis=0)
            tl.store(QS + 1 + b, ends, mask=mb)
            tl.store(QS + b, tl.zeros([BP], dtype=tl.int64), mask=b == 0)
            tl.store(LAST + b, tl.where(n > 0, ends - 1, 0), mask=mb)

    @triton.jit(do_not_specialize=["B", "N", "nb", "E"])
    def _expand_entries(ROWS, B, N, nb, E, r, cap, epb, STATE_WRITE, COUNT, ENTRY_ROWS, ENTRY_VALID,
                        BP: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        pid, eb = tl.program_id(0), tl.program_id(1)
        t = pid * BT + tl.arange(0, BT)
        mt = t < N
        real, seq, qs, off, pos, C, n_t, slot = _token_rows(ROWS, B, N, t, BP)
        count = tl.where(real, (pos + 1) // r, 0)
        if eb == 0:
            tl.store(STATE_WRITE + t, tl.where(real & (off >= n_t - cap), slot * cap + pos % cap, 0), mask=mt)
            tl.store(COUNT + t, count, mask=mt)
        e = eb * BE + tl.arange(0, BE)
        me = e < E
        valid = e[None, :] < count[:, None]
        blk = tl.load(ROWS + 4 * B + seq[:, None] * nb + tl.minimum(e // epb, nb - 1)[None, :])
        m2 = mt[:, None] & me[None, :]
        tl.store(ENTRY_ROWS + t[:, None] * E + e[None, :], tl.where(valid, blk * epb + (e % epb)[None, :], 0),
                 mask=m2)
        tl.store(ENTRY_VALID + t[:, None] * E + e[None, :], valid, mask=m2)

    @triton.jit(do_not_specialize=["B", "M", "nb"])
    def _expand_windows(ROWS, B, M, nb, r, cap, epb, state_base, TOKEN, WSEQ, INDEX, WPOS, WRITE, ACTIVE,
                        WROWS, WVALID, COFF: tl.constexpr, JP: tl.constexpr, BP: tl.constexpr,
                        BW: tl.constexpr, PDL: tl.constexpr):
        enter(PDL)
        m = tl.program_id(0) * BW + tl.arange(0, BW)
        mm = m < M
        b = tl.arange(0, BP)
        mb = b < B
        C = tl.load(ROWS + b, mask=mb, other=0)
        n = tl.load(ROWS + B + b, mask=mb, other=0)
        counts = (C + n) // r - C // r
        wend = tl.cumsum(counts, axis=0)
        active = (m < tl.sum(counts, axis=0)) & mm
        ws = tl.sum(((wend[None, :] <= m[:, None]) & mb[None, :]).to(tl.int64), axis=1)
        ws = tl.where(active, tl.minimum(ws, B - 1), 0)
        before = b[None, :] < ws[:, None]
        wstart = tl.sum(tl.where(before, counts[None, :], 0), axis=1)
        qsw = tl.sum(tl.where(before, n[None, :], 0), axis=1)
        Cw = tl.load(ROWS + ws)
        slot = tl.load(ROWS + 2 * B + ws)
        w = tl.where(active, Cw // r + m - wstart, 0)
        blk = tl.load(ROWS + 4 * B + ws * nb + w // epb, mask=active & (w // epb < nb), other=0)
        tl.store(TOKEN + m, tl.where(active, qsw + (w + 1) * r - 1 - Cw, 0), mask=mm)
        tl.store(WSEQ + m, ws, mask=mm)
        tl.store(INDEX + m, w, mask=mm)
        tl.store(WPOS + m, w * r, mask=mm)
        tl.store(WRITE + m, tl.where(active, blk * epb + w % epb, 0), mask=mm)
        tl.store(ACTIVE + m, active, mask=mm)
        j = tl.arange(0, JP)
        q = (w - COFF + 1)[:, None] * r + j[None, :]
        valid = (q >= 0) & active[:, None]
        rows = tl.where(q >= Cw[:, None], state_base + qsw[:, None] + q - Cw[:, None],
                        slot[:, None] * cap + tl.maximum(q, 0) % cap)
        m2 = mm[:, None] & (j < COFF * r)[None, :]
        tl.store(WROWS + m[:, None] * (COFF * r) + j[None, :], tl.where(valid, rows, 0), mask=m2)
        tl.store(WVALID + m[:, None] * (COFF * r) + j[None, :], valid, mask=m2)


def usable(rows: torch.Tensor) -> bool:
    return on(rows)


def expand(layout, shape, rows: torch.Tensor, num_slots: int) -> dict:
    """The tables of ``plan.expand_rows`` as a dict: token fields, then ``(r, name)`` per ratio."""
    B, N, nb = shape.batch, shape.tokens, shape.max_blocks
    dev, W, S = rows.device, layout.window, layout.swa_cap
    i64 = dict(dtype=torch.int64, device=dev)
    BP = triton.next_power_of_2(B)
    out = dict(positions=torch.empty(N, **i64), token_seq=torch.empty(N, **i64),
               query_start=torch.empty(B + 1, **i64), last_token_index=torch.empty(B, **i64),
               swa_read=torch.empty(N, W, **i64), swa_valid=torch.empty(N, W, dtype=torch.bool, device=dev),
               swa_write=torch.empty(N, **i64))
    _expand_tokens[(max(1, triton.cdiv(N, BLOCK_T)),)](
        rows, B, N, S, layout.step_base(S, num_slots), out["positions"], out["token_seq"], out["query_start"],
        out["last_token_index"], out["swa_read"], out["swa_valid"], out["swa_write"], W=W,
        WP=triton.next_power_of_2(W), BP=BP, BT=BLOCK_T, num_warps=4, **pdl.args())
    windows, entries = dict(shape.windows), dict(shape.entries)
    for r in layout.ratios:
        coff, cap, epb = layout.coff(r), layout.state_cap(r), layout.entries_per_block(r)
        M, E = windows[r], entries[r]
        t = {k: torch.empty(N, **i64) for k in ("state_write", "entry_count")}
        t["entry_rows"] = torch.empty(N, E, **i64)
        t["entry_valid"] = torch.empty(N, E, dtype=torch.bool, device=dev)
        if N:
            _expand_entries[(triton.cdiv(N, BLOCK_T), max(1, triton.cdiv(E, BLOCK_E)))](
                rows, B, N, nb, E, r, cap, epb, t["state_write"], t["entry_count"], t["entry_rows"],
                t["entry_valid"], BP=BP, BT=BLOCK_T, BE=BLOCK_E, num_warps=4, **pdl.args())
        for k in ("win_token", "win_seq", "win_index", "win_pos", "win_write"):
            t[k] = torch.empty(M, **i64)
        t["win_active"] = torch.empty(M, dtype=torch.bool, device=dev)
        t["win_rows"] = torch.empty(M, coff * r, **i64)
        t["win_valid"] = torch.empty(M, coff * r, dtype=torch.bool, device=dev)
        if M:
            _expand_windows[(triton.cdiv(M, BLOCK_W),)](
                rows, B, M, nb, r, cap, epb, layout.step_base(cap, num_slots), t["win_token"], t["win_seq"], t["win_index"],
                t["win_pos"], t["win_write"], t["win_active"], t["win_rows"], t["win_valid"], COFF=coff,
                JP=triton.next_power_of_2(coff * r), BP=BP, BW=BLOCK_W, num_warps=4, **pdl.args())
        out.update({(r, k): v for k, v in t.items()})
    return out
