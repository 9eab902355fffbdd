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
from functools import cached_property
from types import MappingProxyType
from typing import Mapping, Sequence

import numpy as np
import torch

from dsv4.cache.layout import CacheLayout
from dsv4.kernels import expand as expand_kernel
from dsv4.transfer import to_device

_I64 = torch.int64


@dataclass(frozen=True, eq=False)
class RatioTables:
    """Compressor tables for all layers with one compress ratio ``r`` (and, for r = 4, their indexers)."""

    ratio: int
    coff: int
    state_cap: int
    state_step_base: int        # rows of state[l] / index_state[l]: combined indices >= this are step rows
    state_write: torch.Tensor   # [N] state row of each token (only the last state_cap of a request), else 0
    num_windows: int | None     # real M (windows closed in this step); None in a graph's tables
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


@dataclass(frozen=True)
class PlanShape:
    """The static shapes of a plan's tables: a CUDA graph bucket owns one, and a plan built with the
    bucket's padding has exactly it (``GraphRunner.matches`` compares them)."""

    batch: int                  # B: batch rows (padding included)
    tokens: int                 # N: step tokens (padding included)
    max_blocks: int             # columns of block_table
    windows: tuple              # ((ratio, M), ...): closed-window rows per ratio
    entries: tuple              # ((ratio, E), ...): entry-table columns per ratio

    @property
    def row_vector_size(self) -> int:
        """Length of the flat per-row vector: C, n, slot, draft_len ([B] each), then block_table [B * max_blocks]."""
        return self.batch * (4 + self.max_blocks)


def padded_shape(layout: CacheLayout, batch: int, tokens: int, max_blocks: int, max_entries: int) -> PlanShape:
    """The shape of a plan built with pad_batch_to=batch, pad_tokens_to=tokens, max_blocks, max_entries: a step
    closes at most tokens // r + batch windows of ratio r."""
    return PlanShape(batch, tokens, max_blocks, tuple((r, tokens // r + batch) for r in layout.ratios),
                     tuple((r, entries_for(layout, r, max_entries)) for r in layout.ratios))


@dataclass(frozen=True, eq=False)
class PlanTables:
    """Every device table of a step, expanded from its per-row vector by ``expand_rows``."""

    positions: torch.Tensor     # [N] (pad 0)
    token_seq: torch.Tensor     # [N] batch row of each token (pad 0)
    query_start: torch.Tensor   # [B+1] cumsum of num_new, padded rows have no tokens
    computed_lens: torch.Tensor  # [B] C per row (pad 0)
    num_new: torch.Tensor       # [B] (pad 0)
    slots: torch.Tensor         # [B] (pad 0 = null slot)
    draft_lens: torch.Tensor    # [B] (pad 0)
    block_table: torch.Tensor   # [B, max_blocks] (pad 0 = null block)
    last_token_index: torch.Tensor  # [B] step index of each row's last new token (pad 0)
    swa_read: torch.Tensor      # [N, W]
    swa_valid: torch.Tensor     # [N, W] bool
    swa_write: torch.Tensor     # [N]
    ratio_tables: Mapping[int, RatioTables]


def _table(name: str) -> property:
    return property(lambda self: getattr(self.tables, name), doc=f"PlanTables.{name} (expanded on first use)")


@dataclass(frozen=True, eq=False)
class StepPlan:
    """Everything one step's forward reads; built only by ``KVCacheManager.begin_step`` (see module doc).

    Shapes: B = batch rows (padded to pad_batch_to), N = step tokens (padded to pad_tokens_to), W = window.
    Host tuples describe the real (unpadded) requests; where ``unsettled[b] > 0`` request b's committed length
    is known only on the device (``num_computed[b]`` is its lower bound, see ``build_plan``). The device tables (``positions``, ``swa_read``,
    ``ratio_tables``, ...) are expanded from ``rows`` on first use: a step that replays a CUDA graph never
    asks for them (the graph expands its own copy of ``rows``), so its host work is one vector and one copy.
    """

    owner: int                  # id of the manager that built it (commit_step refuses others' plans)
    step_id: int
    req_ids: tuple
    num_computed: tuple
    num_new: tuple
    draft_lens: tuple
    slot_ids: tuple             # per request
    block_ids: tuple            # per request: its block table
    num_tokens: int             # real N
    num_seqs: int               # real B
    shape: PlanShape
    num_windows: Mapping[int, int] | None  # real windows closed in this step, per ratio (None: shifted)
    layout: CacheLayout
    num_slots: int
    rows: torch.Tensor          # the flat per-row vector (PlanShape.row_vector_size) on the plan's device
    # per request: the most committed rows its C may lack on the host (an overlapped MTP step's acceptance,
    # still on the device): ``num_computed`` is then a lower bound and ``rows`` holds C + the device's shift
    unsettled: tuple = ()
    # whether this step's MTP pass writes the MTP layer's window rows of its rows (False: a paused step far from
    # the next probe leaves them, ``KVCacheManager.mtp_current`` says when a request's ring can be read again)
    mtp_keep_up: bool = True
    # where it writes them, at most each request's last this many rows (None: every row the pass keeps, its last
    # swa_cap): a paused step within the ring's span of the next probe writes only the rows still in the ring's
    # span then (``DraftPause.keep_rows``); the rest are stale (``mtp_current``)
    mtp_keep_last: int | None = None

    @property
    def swa_step_base(self) -> int:
        """Combined SWA indices at or above this are step rows."""
        return self.layout.step_base(self.layout.swa_cap, self.num_slots)

    @cached_property
    def tables(self) -> PlanTables:
        return expand_rows(self.layout, self.shape, self.rows, self.num_slots, self.num_windows)

    positions = _table("positions")
    token_seq = _table("token_seq")
    query_start = _table("query_start")
    computed_lens = _table("computed_lens")
    slots = _table("slots")
    block_table = _table("block_table")
    last_token_index = _table("last_token_index")
    swa_read = _table("swa_read")
    swa_valid = _table("swa_valid")
    swa_write = _table("swa_write")
    ratio_tables = _table("ratio_tables")

    @property
    def draft(self) -> DraftTables:
        t = self.tables
        return DraftTables(slots=t.slots, draft_lens=t.draft_lens, max_draft_len=max(self.draft_lens + (0,)),
                           window=self.layout.window, swa_cap=self.layout.swa_cap, swa_step_base=self.swa_step_base)

    def check_current(self, manager) -> None:
        """Raise StalePlanError unless this is ``manager``'s active plan."""
        manager.check_plan(self)


def entries_for(layout: CacheLayout, ratio: int, max_entries: int) -> int:
    """Columns E of ratio ``ratio``'s entry tables when the smallest ratio has ``max_entries``: a position whose
    smallest-ratio count (p+1)//r0 is at most max_entries has (p+1)//r at most max_entries*r0//r when r is a
    multiple of r0 (4 and 128 are). A ratio-128 layer needs 32x fewer columns than a ratio-4 one."""
    r0 = min(layout.ratios)
    return max(1, max_entries * r0 // ratio) if ratio != r0 else max_entries


def row_vector(shape: PlanShape, num_computed: Sequence[int], num_new: Sequence[int], slots: Sequence[int],
               draft_lens: Sequence[int], block_tables: Sequence[Sequence[int]]) -> np.ndarray:
    """The flat per-row vector of a step: [C | n | slot | draft_len | block_table], padded rows all 0."""
    B, nb = shape.batch, shape.max_blocks
    out = np.zeros(shape.row_vector_size, dtype=np.int64)
    k = len(num_computed)
    for i, col in enumerate((num_computed, num_new, slots, draft_lens)):
        out[i * B:i * B + k] = col
    bt = out[4 * B:].reshape(B, nb)
    for b, blocks in enumerate(block_tables):
        bt[b, :len(blocks)] = blocks
    return out


def expand_rows(layout: CacheLayout, shape: PlanShape, rows: torch.Tensor, num_slots: int,
                num_windows: Mapping[int, int] | None = None) -> PlanTables:
    """Every table of the step from its per-row vector, on the vector's device, with no host sync: the
    shapes come from ``shape`` and every data-dependent quantity stays on the device, so a CUDA graph can
    capture this. ``num_windows``: the real window counts, when the caller knows them (None in a graph).

    Padded tokens, windows and rows are all-zero and invalid: they point at the null slot/block. On CUDA
    a few Triton kernels do it (``dsv4.kernels.expand``); ``expand_rows_torch`` is their twin.
    """
    if shape.batch < 1:
        raise ValueError("a step plan needs at least one batch row (padding included)")
    if expand_kernel.usable(rows):
        return _assemble(layout, shape, rows, expand_kernel.expand(layout, shape, rows, num_slots), num_slots,
                         num_windows)
    return _assemble(layout, shape, rows, expand_rows_torch(layout, shape, rows, num_slots), num_slots, num_windows)


def _assemble(layout: CacheLayout, shape: PlanShape, rows: torch.Tensor, t: dict, num_slots: int,
              num_windows: Mapping[int, int] | None) -> PlanTables:
    """PlanTables from the tables of ``expand_rows_torch`` (or its kernels) and the views of ``rows``."""
    B = shape.batch
    ratio = {}
    for r in layout.ratios:
        ratio[r] = RatioTables(
            ratio=r, coff=layout.coff(r), state_cap=layout.state_cap(r),
            state_step_base=layout.step_base(layout.state_cap(r), num_slots),
            num_windows=None if num_windows is None else num_windows[r],
            **{k: t[r, k] for k in ("state_write", "win_token", "win_seq", "win_index", "win_pos", "win_write",
                                    "win_active", "win_rows", "win_valid", "entry_count", "entry_rows",
                                    "entry_valid")})
    return PlanTables(positions=t["positions"], token_seq=t["token_seq"], query_start=t["query_start"],
                      computed_lens=rows[:B], num_new=rows[B:2 * B], slots=rows[2 * B:3 * B],
                      draft_lens=rows[3 * B:4 * B], block_table=rows[4 * B:].view(B, shape.max_blocks),
                      last_token_index=t["last_token_index"], swa_read=t["swa_read"], swa_valid=t["swa_valid"],
                      swa_write=t["swa_write"], ratio_tables=MappingProxyType(ratio))


def expand_rows_torch(layout: CacheLayout, shape: PlanShape, rows: torch.Tensor, num_slots: int) -> dict:
    """The plain-torch twin of ``dsv4.kernels.expand.expand``: token fields by name, ``(r, name)`` per ratio."""
    B, N, nb = shape.batch, shape.tokens, shape.max_blocks
    dev, W, S = rows.device, layout.window, layout.swa_cap
    C, n, slot = (rows[i * B:(i + 1) * B] for i in range(3))
    bt = rows[4 * B:].view(B, nb)
    ends = n.cumsum(0)
    qs = torch.cat((ends.new_zeros(1), ends))
    t = torch.arange(N, dtype=_I64, device=dev)
    real = t < ends[-1]
    # token t belongs to the first row whose end exceeds t (rows of zero tokens are skipped)
    seq = torch.where(real, torch.searchsorted(ends, t, right=True).clamp(max=B - 1), 0)
    off = t - qs[seq]                                                      # offset inside its request
    pos = torch.where(real, C[seq] + off, 0)
    n_tok, slot_t, C_t, qs_t = n[seq], slot[seq], C[seq], qs[seq]

    def ring_write(cap):
        # Only the last `cap` tokens of a request write: earlier ones would be overwritten in this very step,
        # and skipping them keeps each scatter free of duplicate targets.
        return torch.where(real & (off >= n_tok - cap), slot_t * cap + pos % cap, 0)

    # SWA: key i of the query at t is position t - W + 1 + i; combined index: ring rows, then step rows
    swa_base = layout.step_base(S, num_slots)
    kp = pos[:, None] - (W - 1) + torch.arange(W, dtype=_I64, device=dev)[None, :]       # [N, W]
    swa_valid = (kp >= 0) & real[:, None]
    ring = slot_t[:, None] * S + kp.clamp(min=0) % S
    swa_read = torch.where(kp >= C_t[:, None], swa_base + qs_t[:, None] + kp - C_t[:, None], ring)
    swa_read = torch.where(swa_valid, swa_read, 0)

    out = dict(positions=pos, token_seq=seq, query_start=qs, last_token_index=torch.where(n > 0, ends - 1, 0),
               swa_read=swa_read, swa_valid=swa_valid, swa_write=ring_write(S))
    windows, entries = dict(shape.windows), dict(shape.entries)
    for r in layout.ratios:
        coff, cap, epb = layout.coff(r), layout.state_cap(r), layout.entries_per_block(r)
        M, E = windows[r], entries[r]
        # windows closed in this step: w with (w+1)*r - 1 in [C, C+n-1]  <=>  C//r <= w < (C+n)//r, laid out
        # request after request, then padding
        first_w = C // r
        counts = (C + n) // r - first_w
        wend = counts.cumsum(0)
        m = torch.arange(M, dtype=_I64, device=dev)
        active = m < wend[-1]
        ws = torch.where(active, torch.searchsorted(wend, m, right=True).clamp(max=B - 1), 0)
        w = torch.where(active, first_w[ws] + m - (wend - counts)[ws], 0)
        Cw, qsw = C[ws], qs[ws]
        # columns: positions (w - coff + 1)*r .. (w+1)*r - 1; for CSA the first r are the previous window
        # (the model takes their A-halves) and the last r this window (B-halves)
        state_base = layout.step_base(cap, num_slots)
        q = (w - coff + 1)[:, None] * r + torch.arange(coff * r, dtype=_I64, device=dev)[None, :]  # [M, coff*r]
        win_valid = (q >= 0) & active[:, None]
        win_rows = torch.where(q >= Cw[:, None], state_base + qsw[:, None] + q - Cw[:, None],
                               slot[ws][:, None] * cap + q.clamp(min=0) % cap)
        count = torch.where(real, (pos + 1) // r, 0)                          # [N] visible entries
        we = torch.arange(E, dtype=_I64, device=dev)
        entry_valid = we[None, :] < count[:, None]
        blk = bt[seq[:, None], (we // epb).clamp(max=nb - 1)[None, :]]
        out.update({(r, "state_write"): ring_write(cap), (r, "entry_count"): count,
                    (r, "win_token"): torch.where(active, qsw + (w + 1) * r - 1 - Cw, 0), (r, "win_seq"): ws,
                    (r, "win_index"): w, (r, "win_pos"): w * r,
                    (r, "win_write"): torch.where(active, bt[ws, w // epb] * epb + w % epb, 0),
                    (r, "win_active"): active, (r, "win_rows"): torch.where(win_valid, win_rows, 0),
                    (r, "win_valid"): win_valid,
                    (r, "entry_rows"): torch.where(entry_valid, blk * epb + (we % epb)[None, :], 0),
                    (r, "entry_valid"): entry_valid})
    return out


def build_plan(layout: CacheLayout, *, num_slots: int, owner: int, step_id: int, req_ids: Sequence,
               num_computed: Sequence[int], num_new: Sequence[int], draft_lens: Sequence[int],
               slots: Sequence[int], block_tables: Sequence[Sequence[int]], pad_tokens_to: int | None = None,
               pad_batch_to: int | None = None, max_entries: int | None = None, max_blocks: int | None = None,
               device="cpu", unsettled: Sequence[int] | None = None,
               shift: torch.Tensor | None = None, mtp_keep_up: bool = True,
               mtp_keep_last: int | None = None) -> StepPlan:
    """Turn a validated batch (host ints) into a StepPlan. Pure: reads only its arguments.

    The manager validates requests; this checks only the padding arguments, which it alone interprets.
    The host work is the shapes and one flat per-row vector, moved in one copy; ``expand_rows`` turns it
    into the tables on ``device`` when they are first read, so a decode step's host work does not grow with
    the context length, and a graphed step's does not depend on the tables at all.

    ``shift`` (a device tensor [len(req_ids)], with ``unsettled``): the committed rows each request has beyond
    ``num_computed`` that only the device knows yet (an overlapped MTP step's accepted drafts), between 0 and
    ``unsettled[b]``. It is added to the C column on the device (no host read), and the shapes are sized for the
    largest C it allows, so the plan is the one ``num_computed + shift`` would give, on the device.
    """
    unsettled = tuple(int(u) for u in unsettled) if unsettled is not None else (0,) * len(req_ids)
    if len(unsettled) != len(req_ids) or any(u < 0 for u in unsettled):
        raise ValueError(f"unsettled must give a count >= 0 for each of the {len(req_ids)} requests")
    if any(unsettled) and shift is None:
        raise ValueError("a plan with unsettled rows needs the device's shift of each request's C")
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

    C = np.asarray(num_computed, dtype=np.int64)
    n = np.asarray(num_new, dtype=np.int64)
    U = np.asarray(unsettled, dtype=np.int64)
    end = int((C + U + n).max()) if B else 0                               # one past the last position
    windows, entries, real_windows = [], [], {}
    for r in layout.ratios:
        # (a shifted row closes at most n // r + 1 windows, wherever its C lands)
        M = int(np.where(U > 0, n // r + 1, (C + n) // r - C // r).sum())
        real_windows[r] = M
        Mp = Np // r + Bp if padded else M
        assert M <= Mp, (M, Mp)
        windows.append((r, Mp))
        max_count = end // r                                               # (p+1)//r of the last position
        if max_entries is None:
            E = max_count
        else:
            E = entries_for(layout, r, int(max_entries))
            if E < max_count:
                raise ValueError(f"max_entries={max_entries} gives ratio-{r} tables {E} entries but a token of"
                                 f" this step sees {max_count}; size max_entries for max_seq_len // min(ratio)")
        entries.append((r, E))
    shape = PlanShape(Bp, Np, nb, tuple(windows), tuple(entries))
    rows = to_device(row_vector(shape, num_computed, num_new, slots, draft_lens, block_tables), device)
    if shift is not None:
        if tuple(shift.shape) != (B,):
            raise ValueError(f"shift must have shape [{B}] (one per request), got {tuple(shift.shape)}")
        rows[:B] += shift.to(device=rows.device, dtype=rows.dtype)
    return StepPlan(
        owner=owner, step_id=step_id, req_ids=tuple(req_ids), num_computed=tuple(num_computed),
        num_new=tuple(num_new), draft_lens=tuple(draft_lens), slot_ids=tuple(slots),
        block_ids=tuple(tuple(b) for b in block_tables), num_tokens=N, num_seqs=B, shape=shape,
        num_windows=None if any(unsettled) else MappingProxyType(real_windows), layout=layout,
        num_slots=num_slots, rows=rows, unsettled=unsettled, mtp_keep_up=mtp_keep_up,
        mtp_keep_last=mtp_keep_last,
    )
