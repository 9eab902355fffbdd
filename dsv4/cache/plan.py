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

import numpy as np
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


def entries_for(layout: CacheLayout, ratio: int, max_entries: int) -> int:
    """Columns E of ratio ``ratio``'s entry tables when the smallest ratio has ``max_entries``: a position whose
    smallest-ratio count (p+1)//r0 is at most max_entries has (p+1)//r at most max_entries*r0//r when r is a
    multiple of r0 (4 and 128 are). A ratio-128 layer needs 32x fewer columns than a ratio-4 one."""
    r0 = min(layout.ratios)
    return max(1, max_entries * r0 // ratio) if ratio != r0 else max_entries


def _to_device(parts: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    """Named host int64 vectors, moved to ``device`` as one buffer in one copy, returned as views by name."""
    flat = torch.from_numpy(np.concatenate([p.reshape(-1) for p in parts.values()]))
    if torch.device(device).type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return dict(zip(parts, torch.split(flat, [p.size for p in parts.values()])))


def _pad(x: np.ndarray, rows: int) -> np.ndarray:
    out = np.zeros(rows, dtype=np.int64)
    out[:x.shape[0]] = x
    return out


def build_plan(layout: CacheLayout, *, num_slots: int, owner: int, step_id: int, req_ids: Sequence,
               num_computed: Sequence[int], num_new: Sequence[int], draft_lens: Sequence[int],
               slots: Sequence[int], block_tables: Sequence[Sequence[int]], pad_tokens_to: int | None = None,
               pad_batch_to: int | None = None, max_entries: int | None = None, max_blocks: int | None = None,
               device="cpu") -> StepPlan:
    """Turn a validated batch (host ints) into a StepPlan. Pure: reads only its arguments.

    The manager validates requests; this checks only the padding arguments, which it alone interprets.
    The per-token, per-window and per-request vectors are computed on the host (numpy), moved in one
    copy, and the large 2-D tables (SWA reads [N, W], compressor windows [M, coff*r], entries [N, E]) are
    built from them on ``device``: a decode step's host work does not grow with the context length.
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

    # ---- host: per request, per token, per closed window (1-D, small) ---------------------------------------
    W, S = layout.window, layout.swa_cap
    C = _pad(np.asarray(num_computed, dtype=np.int64), Bp)
    n = _pad(np.asarray(num_new, dtype=np.int64), Bp)
    slot_b = _pad(np.asarray(slots, dtype=np.int64), Bp)
    dl = _pad(np.asarray(draft_lens, dtype=np.int64), Bp)
    bt = np.zeros((Bp, nb), dtype=np.int64)
    for b, blocks in enumerate(block_tables):
        bt[b, :len(blocks)] = blocks
    qs = np.zeros(Bp + 1, dtype=np.int64)
    qs[1:] = np.cumsum(n)
    seq = np.repeat(np.arange(Bp, dtype=np.int64), n)                     # [N] batch row per token
    off = np.arange(N, dtype=np.int64) - qs[seq]                           # [N] offset inside its request
    pos = C[seq] + off                                                     # [N] absolute position
    n_tok = n[seq]
    last_tok = np.zeros(Bp, dtype=np.int64)
    last_tok[:B] = qs[1:B + 1] - 1

    def ring_write(cap):
        # Only the last `cap` tokens of a request write: earlier ones would be overwritten in this very step,
        # and skipping them keeps each scatter free of duplicate targets.
        return np.where(off >= n_tok - cap, slot_b[seq] * cap + pos % cap, 0)

    host = dict(C=C, qs=qs, slot=slot_b, draft_lens=dl, bt=bt, last=last_tok, pos=_pad(pos, Np), seq=_pad(seq, Np),
                real=(np.arange(Np) < N).astype(np.int64), swa_write=_pad(ring_write(S), Np))
    sizes = {}  # ratio -> (M, E)
    for r in layout.ratios:
        cap, epb = layout.state_cap(r), layout.entries_per_block(r)
        # windows closed in this step: w with (w+1)*r - 1 in [C, C+n-1]  <=>  C//r <= w < (C+n)//r
        first_w = C // r
        counts = (C + n) // r - first_w                                    # [Bp]
        M = int(counts.sum())
        Mp = Np // r + Bp if padded else M
        assert M <= Mp, (M, Mp)
        win_seq = np.repeat(np.arange(Bp, dtype=np.int64), counts)
        start = np.cumsum(counts) - counts
        w = first_w[win_seq] + np.arange(M, dtype=np.int64) - start[win_seq]  # [M]
        count = (pos + 1) // r                                             # [N]
        max_count = int(count.max()) if N else 0
        if max_entries is None:
            E = max_count
        else:
            E = entries_for(layout, r, int(max_entries))
            if E < max_count:
                raise ValueError(f"max_entries={max_entries} gives ratio-{r} tables {E} entries but a token of"
                                 f" this step sees {max_count}; size max_entries for max_seq_len // min(ratio)")
        sizes[r] = M, E
        per_window = dict(win_seq=win_seq, win_index=w, win_token=qs[win_seq] + (w + 1) * r - 1 - C[win_seq],
                          win_pos=w * r, win_write=bt[win_seq, w // epb] * epb + w % epb,
                          win_active=np.ones(M, np.int64), win_C=C[win_seq], win_qs=qs[win_seq],
                          win_slot=slot_b[win_seq])
        host.update({(r, k): _pad(x, Mp) for k, x in per_window.items()})
        host[r, "state_write"] = _pad(ring_write(cap), Np)
        host[r, "entry_count"] = _pad(count, Np)
    v = _to_device(host, device)

    # ---- device: the 2-D tables ------------------------------------------------------------------------------
    dev = v["C"].device
    C_d, qs_d, slot_d, bt_d = v["C"], v["qs"], v["slot"], v["bt"].view(Bp, nb)
    pos_d, seq_d, real_d = v["pos"], v["seq"], v["real"].bool()
    C_t, qs_t = C_d[seq_d], qs_d[seq_d]  # padded tokens: row 0's values, masked by real_d below

    # SWA: key i of the query at t is position t - W + 1 + i; combined index: ring rows, then step rows
    swa_base = (num_slots + 1) * S
    kp = pos_d[:, None] - (W - 1) + torch.arange(W, dtype=_I64, device=dev)[None, :]      # [Np, W]
    swa_valid = (kp >= 0) & real_d[:, None]
    ring = slot_d[seq_d][:, None] * S + kp.clamp(min=0) % S
    swa_read = torch.where(kp >= C_t[:, None], swa_base + qs_t[:, None] + kp - C_t[:, None], ring)
    swa_read = torch.where(swa_valid, swa_read, 0)

    tables = {}
    for r in layout.ratios:
        coff, cap, epb = layout.coff(r), layout.state_cap(r), layout.entries_per_block(r)
        M, E = sizes[r]
        w, Cw, qsw, count = v[r, "win_index"], v[r, "win_C"], v[r, "win_qs"], v[r, "entry_count"]
        active = v[r, "win_active"].bool()
        state_base = (num_slots + 1) * cap
        # columns: positions (w - coff + 1)*r .. (w+1)*r - 1; for CSA the first r are the previous window
        # (the model takes their A-halves) and the last r this window (B-halves)
        q = (w - coff + 1)[:, None] * r + torch.arange(coff * r, dtype=_I64, device=dev)[None, :]  # [Mp, coff*r]
        win_valid = (q >= 0) & active[:, None]
        rows = torch.where(q >= Cw[:, None], state_base + qsw[:, None] + q - Cw[:, None],
                           v[r, "win_slot"][:, None] * cap + q.clamp(min=0) % cap)
        we = torch.arange(E, dtype=_I64, device=dev)
        entry_valid = we[None, :] < count[:, None]
        blk = bt_d[seq_d[:, None], (we // epb).clamp(max=nb - 1)[None, :]]
        tables[r] = RatioTables(
            ratio=r, coff=coff, state_cap=cap, state_step_base=state_base, state_write=v[r, "state_write"],
            num_windows=M, win_token=v[r, "win_token"], win_seq=v[r, "win_seq"], win_index=w,
            win_pos=v[r, "win_pos"], win_write=v[r, "win_write"], win_active=active,
            win_rows=torch.where(win_valid, rows, 0), win_valid=win_valid,
            entry_count=count, entry_rows=torch.where(entry_valid, blk * epb + (we % epb)[None, :], 0),
            entry_valid=entry_valid,
        )

    draft = DraftTables(slots=slot_d, draft_lens=v["draft_lens"], max_draft_len=max(list(draft_lens) + [0]),
                        window=W, swa_cap=S, swa_step_base=swa_base)
    return StepPlan(
        owner=owner, step_id=step_id, req_ids=tuple(req_ids), num_computed=tuple(num_computed),
        num_new=tuple(num_new), draft_lens=tuple(draft_lens), num_tokens=N, num_seqs=B,
        positions=pos_d, token_seq=seq_d, query_start=qs_d, computed_lens=C_d, slots=slot_d, block_table=bt_d,
        last_token_index=v["last"], swa_step_base=swa_base, swa_read=swa_read, swa_valid=swa_valid,
        swa_write=v["swa_write"], ratio_tables=MappingProxyType(tables), draft=draft,
    )
