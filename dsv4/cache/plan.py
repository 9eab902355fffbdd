"""The step plan: one immutable value with every index the forward needs for one step (R2, R3).

A request's token regions, in positions (C = num_computed, n = num_new, R = reserved tokens)::

    position   0                        C-1 | C              C+n-1 | C+n            R-1
               [ committed: rows final      | new in this step      | lookahead reserved  ]
               [ read from the cache        | rows come from this   | for draft tokens of ]
               [ (ring / compressed blocks) | step's own tensors    | later steps (R5)    ]
                                              \\_ verify: 1 + k   _/
                                              accepted a -> C' = C + a; rows of C'..C+n-1 are garbage

SWA ring of one request (S = swa_cap = window + max_draft_len rows; position p lives in row p % S)::

    slot s:   rows s*S .. s*S+S-1
              | p%S=0 | 1 | 2 | ... | S-1 |        a query at t reads positions t-W+1 .. t
              the W-1 committed positions a later query may need are C-W+1 .. C-1

Why S = W + max_draft_len makes rollback free: after a commit to C', the rejected tokens of the step
(k <= max_draft_len of them; commit_step refuses more) and the MTP draft tokens (positions < C' +
max_draft_len - 1) left garbage rows at positions q <= C'+max_draft_len-1. Such a write landed in row
q % S; the row it replaced held position q - S <= C'-W-1 < C'-W+1, a position no query at or after C'
reads any more. So lowering the committed length is the whole rollback: nothing needed was overwritten,
and a garbage position (>= C') is only ever read from a step's own rows (or, in draft step j, from the
ring rows the earlier draft steps of the same series just wrote) until an accepted step overwrites it.
The compressor-state rings use the same argument with capacity coff*r + max_draft_len; compressed
entries are indexed by window number, so a rejected token that closed window w wrote entry w, which is
invisible (w >= C'//r) and rewritten when w closes again.

Combined index space. Every read table indexes "storage rows first, then this step's rows": an index
i < R (R = rows of the storage tensor, ``*_step_base``) reads storage row i, an index i >= R reads row
i - R of the tensor this step computed (one row per step token, or per batch row in a draft step).
Entries with valid=False index 0 (the null slot/block) and must be masked; padded tokens, windows and
batch rows point at the null slot/block and have valid=False, so they read nothing that can fault and
write only the null rows, which nothing reads as valid.

Order inside a layer (what the tables assume): compute the step's rows; gather the SWA windows and the
compressor windows (``win_rows``) BEFORE writing (a long chunk's writes may reuse ring rows its own
early queries still read); scatter ``swa_write`` / ``state_write``; compute the closed windows' entries
and write them at ``win_write``; then gather ``entry_rows`` (entries closed in this step are visible to
the tokens at and after their closing token).

MTP (R1): the MTP layer is SWA layer ``cfg.num_layers`` of the same cache. Its catch-up pass (draft step
1) runs over the step's positions with the target's SWA tables. Draft step j >= 2 of request b has one
token at position new_lens[b] + j - 2; ``plan.draft.step_tables(j, new_lens)`` builds its tables on the
device from the accepted lengths, with nothing remembered between calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

import torch

from dsv4.cache.layout import CacheLayout

_I64 = torch.int64


@dataclass(frozen=True, eq=False)
class RatioTables:
    """Compressor tables for all layers with one compress ratio ``r`` (and, for r = 4, their indexers)."""

    ratio: int
    coff: int
    state_cap: int
    state_step_base: int        # rows of state[l] / index_state[l]: combined indices >= this are step rows
    state_write: torch.Tensor   # [N] state row of each token (only the last state_cap of a request), else 0
    num_windows: int            # real M (windows closed in this step)
    win_token: torch.Tensor     # [M] step token index of the closing token
    win_seq: torch.Tensor       # [M] batch row
    win_index: torch.Tensor     # [M] window number w
    win_pos: torch.Tensor       # [M] w * r, the entry's RoPE position
    win_write: torch.Tensor     # [M] flat row in entries[l] / index_keys[l]; pad 0
    win_active: torch.Tensor    # [M] bool, False for padding
    win_rows: torch.Tensor      # [M, coff*r] combined index over state rows then step rows
    win_valid: torch.Tensor     # [M, coff*r] bool
    entry_count: torch.Tensor   # [N] (t + 1) // r visible entries of the token at position t
    entry_rows: torch.Tensor    # [N, E] flat rows of entries 0..count-1 in entries[l]; pad 0
    entry_valid: torch.Tensor   # [N, E] bool


@dataclass(frozen=True, eq=False)
class SwaStepTables:
    """SWA tables of one MTP draft step (one token per batch row)."""

    positions: torch.Tensor     # [B]
    swa_read: torch.Tensor      # [B, W] combined index: ring rows, then (step_base + b) for the query itself
    swa_valid: torch.Tensor     # [B, W] bool
    swa_write: torch.Tensor     # [B] ring row of the draft token; null row 0 when inactive
    active: torch.Tensor        # [B] bool


@dataclass(frozen=True, eq=False)
class DraftTables:
    """What the MTP draft steps of a plan need; ``step_tables`` is pure (R2) and syncs nothing."""

    slots: torch.Tensor         # [B] (pad 0)
    draft_lens: torch.Tensor    # [B] drafts requested per row (pad 0)
    max_draft_len: int          # max over the batch (host int, known when the plan was built)
    window: int
    swa_cap: int
    swa_step_base: int          # (num_slots + 1) * swa_cap

    def step_tables(self, j: int, new_lens: torch.Tensor) -> SwaStepTables:
        """Tables of draft step ``j`` (>= 2); ``new_lens`` [B] = committed length after acceptance (C + a).

        Row b is active iff draft_lens[b] >= j; its token sits at position new_lens[b] + j - 2. Keys at
        positions < p come from the MTP ring (written by the catch-up pass and the earlier draft steps),
        the query's own key is step row b.
        """
        if not isinstance(j, int) or j < 2:
            raise ValueError(f"draft step j={j!r}: step 1 is the MTP catch-up pass over the step's own "
                             "positions, which uses plan.swa_read/swa_valid/swa_write; step_tables takes j >= 2")
        B = self.slots.shape[0]
        if tuple(new_lens.shape) != (B,):
            raise ValueError(f"new_lens must have shape [{B}] (one committed length per plan batch row, padding "
                             f"included), got {tuple(new_lens.shape)}")
        dev = self.slots.device
        W, S = self.window, self.swa_cap
        active = self.draft_lens >= j
        pos = torch.where(active, new_lens.to(device=dev, dtype=_I64) + (j - 2), 0)
        kp = pos[:, None] - (W - 1) + torch.arange(W, device=dev, dtype=_I64)[None, :]  # [B, W]
        valid = (kp >= 0) & active[:, None]
        own = (self.swa_step_base + torch.arange(B, device=dev, dtype=_I64))[:, None]
        ring = self.slots[:, None] * S + kp.clamp(min=0) % S
        read = torch.where(kp == pos[:, None], own, ring)
        read = torch.where(valid, read, 0)
        write = torch.where(active, self.slots * S + pos % S, 0)
        return SwaStepTables(positions=pos, swa_read=read, swa_valid=valid, swa_write=write, active=active)


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Everything one step's forward reads; built only by ``KVCacheManager.begin_step`` (see module doc).

    Shapes: B = batch rows (padded to pad_batch_to), N = step tokens (padded to pad_tokens_to), W = window.
    Host tuples describe the real (unpadded) requests.
    """

    owner: int                  # id of the manager that built it (commit_step refuses others' plans)
    step_id: int
    req_ids: tuple
    num_computed: tuple
    num_new: tuple
    draft_lens: tuple
    num_tokens: int             # real N
    num_seqs: int               # real B
    positions: torch.Tensor     # [N] (pad 0)
    token_seq: torch.Tensor     # [N] batch row of each token (pad 0)
    query_start: torch.Tensor   # [B+1] cumsum of num_new, padded rows have no tokens
    computed_lens: torch.Tensor  # [B] C per row (pad 0)
    slots: torch.Tensor         # [B] (pad 0 = null slot)
    block_table: torch.Tensor   # [B, max_blocks] (pad 0 = null block)
    last_token_index: torch.Tensor  # [B] step index of each row's last new token (pad 0)
    swa_step_base: int          # (num_slots + 1) * swa_cap: combined SWA indices >= this are step rows
    swa_read: torch.Tensor      # [N, W]
    swa_valid: torch.Tensor     # [N, W] bool
    swa_write: torch.Tensor     # [N]
    ratio_tables: Mapping[int, RatioTables]
    draft: DraftTables

    def check_current(self, manager) -> None:
        """Raise StalePlanError unless this is ``manager``'s active plan."""
        manager.check_plan(self)


def build_plan(layout: CacheLayout, *, num_slots: int, owner: int, step_id: int, req_ids: Sequence,
               num_computed: Sequence[int], num_new: Sequence[int], draft_lens: Sequence[int],
               slots: Sequence[int], block_tables: Sequence[Sequence[int]], pad_tokens_to: int | None = None,
               pad_batch_to: int | None = None, max_entries: int | None = None, max_blocks: int | None = None,
               device="cpu") -> StepPlan:
    """Turn a validated batch (host ints) into a StepPlan. Pure: reads only its arguments.

    The manager validates requests; this checks only the padding arguments, which it alone interprets.
    """
    B, N = len(req_ids), int(sum(num_new))
    Bp = B if pad_batch_to is None else int(pad_batch_to)
    Np = N if pad_tokens_to is None else int(pad_tokens_to)
    if Bp < B:
        raise ValueError(f"pad_batch_to={pad_batch_to} < {B} requests in the step")
    if Np < N:
        raise ValueError(f"pad_tokens_to={pad_tokens_to} < {N} tokens in the step")
    need_blocks = max([len(bt) for bt in block_tables] + [1])
    nb = need_blocks if max_blocks is None else int(max_blocks)
    if nb < need_blocks:
        raise ValueError(f"max_blocks={max_blocks} < {need_blocks} blocks reserved by a request of the step")
    padded = pad_batch_to is not None or pad_tokens_to is not None

    W, S = layout.window, layout.swa_cap
    C = torch.tensor(list(num_computed) + [0] * (Bp - B), dtype=_I64)
    n = torch.tensor(list(num_new) + [0] * (Bp - B), dtype=_I64)
    slot_t = torch.tensor(list(slots) + [0] * (Bp - B), dtype=_I64)
    dl = torch.tensor(list(draft_lens) + [0] * (Bp - B), dtype=_I64)
    bt = torch.zeros(Bp, nb, dtype=_I64)
    for b, blocks in enumerate(block_tables):
        if blocks:
            bt[b, :len(blocks)] = torch.tensor(blocks, dtype=_I64)
    qs = torch.zeros(Bp + 1, dtype=_I64)
    qs[1:] = torch.cumsum(n, 0)

    seq = torch.repeat_interleave(torch.arange(Bp, dtype=_I64), n)   # [N] batch row per token
    off = torch.arange(N, dtype=_I64) - qs[seq]                      # [N] offset inside its request
    pos = C[seq] + off                                               # [N] absolute position
    C_t, qs_t, slot_tok, n_tok = C[seq], qs[seq], slot_t[seq], n[seq]

    def to_step(q, C_of, qs_of):
        """Combined-space step index of position q (>= C) of a request: base + its step token index."""
        return qs_of + (q - C_of)

    def pad_rows(x, rows, fill=0):
        """Pad dim 0 to `rows` with `fill` and move to the plan's device."""
        if x.shape[0] != rows:
            out = torch.full((rows,) + tuple(x.shape[1:]), fill, dtype=x.dtype)
            out[:x.shape[0]] = x
            x = out
        return x.to(device)

    # ---- SWA: key i of the query at t is position t - W + 1 + i ----------------------------------------
    swa_base = (num_slots + 1) * S
    kp = pos[:, None] - (W - 1) + torch.arange(W, dtype=_I64)[None, :]          # [N, W]
    swa_valid = kp >= 0
    in_step = kp >= C_t[:, None]
    ring = slot_tok[:, None] * S + kp.clamp(min=0) % S
    swa_read = torch.where(in_step, swa_base + to_step(kp, C_t[:, None], qs_t[:, None]), ring)
    swa_read = torch.where(swa_valid, swa_read, 0)

    def ring_write(cap):
        # Only the last `cap` tokens of a request write: earlier ones would be overwritten in this very step,
        # and skipping them keeps each scatter free of duplicate targets.
        last = off >= n_tok - cap
        return torch.where(last, slot_tok * cap + pos % cap, 0)

    swa_write = ring_write(S)

    # ---- per compress ratio ------------------------------------------------------------------------------
    tables = {}
    for r in layout.ratios:
        coff, cap, epb = layout.coff(r), layout.state_cap(r), layout.entries_per_block(r)
        state_base = (num_slots + 1) * cap
        # windows closed in this step: w with (w+1)*r - 1 in [C, C+n-1]  <=>  C//r <= w < (C+n)//r
        first_w = C // r
        counts = (C + n) // r - first_w                                       # [B]
        M = int(counts.sum())
        win_seq = torch.repeat_interleave(torch.arange(Bp, dtype=_I64), counts)
        start = torch.cumsum(counts, 0) - counts
        w = first_w[win_seq] + torch.arange(M, dtype=_I64) - start[win_seq]    # [M]
        Cw, qsw = C[win_seq], qs[win_seq]
        win_token = to_step((w + 1) * r - 1, Cw, qsw)
        win_write = bt[win_seq, w // epb] * epb + w % epb
        # columns: positions (w - coff + 1)*r .. (w+1)*r - 1; for CSA the first r are the previous window
        # (the model takes their A-halves) and the last r this window (B-halves)
        q = (w - coff + 1)[:, None] * r + torch.arange(coff * r, dtype=_I64)[None, :]   # [M, coff*r]
        win_valid = q >= 0
        rows = torch.where(q >= Cw[:, None], state_base + to_step(q, Cw[:, None], qsw[:, None]),
                           slot_t[win_seq][:, None] * cap + q.clamp(min=0) % cap)
        win_rows = torch.where(win_valid, rows, 0)
        Mp = Np // r + Bp if padded else M
        assert M <= Mp, (M, Mp)

        count = (pos + 1) // r                                                 # [N]
        max_count = int(count.max()) if N else 0
        E = max_count if max_entries is None else int(max_entries)
        if E < max_count:
            raise ValueError(f"max_entries={max_entries} but a token of this step sees {max_count} ratio-{r} "
                             "entries; size max_entries for max_seq_len // min(ratio)")
        we = torch.arange(E, dtype=_I64)
        entry_valid = we[None, :] < count[:, None]
        blk = bt[seq[:, None], (we // epb).clamp(max=nb - 1)[None, :]]
        entry_rows = torch.where(entry_valid, blk * epb + (we % epb)[None, :], 0)

        tables[r] = RatioTables(
            ratio=r, coff=coff, state_cap=cap, state_step_base=state_base,
            state_write=pad_rows(ring_write(cap), Np), num_windows=M,
            win_token=pad_rows(win_token, Mp), win_seq=pad_rows(win_seq, Mp), win_index=pad_rows(w, Mp),
            win_pos=pad_rows(w * r, Mp), win_write=pad_rows(win_write, Mp),
            win_active=pad_rows(torch.ones(M, dtype=torch.bool), Mp, False),
            win_rows=pad_rows(win_rows, Mp), win_valid=pad_rows(win_valid, Mp, False),
            entry_count=pad_rows(count, Np), entry_rows=pad_rows(entry_rows, Np),
            entry_valid=pad_rows(entry_valid, Np, False),
        )

    last_tok = torch.zeros(Bp, dtype=_I64)
    last_tok[:B] = qs[1:B + 1] - 1

    def dev(x):
        return x.to(device)

    draft = DraftTables(slots=dev(slot_t), draft_lens=dev(dl), max_draft_len=max(list(draft_lens) + [0]),
                        window=W, swa_cap=S, swa_step_base=swa_base)
    return StepPlan(
        owner=owner, step_id=step_id, req_ids=tuple(req_ids), num_computed=tuple(num_computed),
        num_new=tuple(num_new), draft_lens=tuple(draft_lens), num_tokens=N, num_seqs=B,
        positions=dev(pad_rows(pos, Np)), token_seq=dev(pad_rows(seq, Np)), query_start=dev(qs),
        computed_lens=dev(C), slots=dev(slot_t), block_table=dev(bt), last_token_index=dev(last_tok),
        swa_step_base=swa_base, swa_read=dev(pad_rows(swa_read, Np)),
        swa_valid=dev(pad_rows(swa_valid, Np, False)), swa_write=dev(pad_rows(swa_write, Np)),
        ratio_tables=MappingProxyType(tables), draft=draft,
    )
