"""The rows an MTP catch-up pass runs over: at most the last ``swa_cap`` rows of each request in the step.

DeepSeek-V4's MTP layer attends over a sliding window only (no compressor), so all a later pass reads of the
catch-up pass is what its window ring keeps: the last ``swa_cap`` positions of each request (the plan sends a
long chunk's earlier rows to the null row: the same step would overwrite them). The draft comes from a
request's newest committed row, its last row in a prefill chunk, whose window (``window <= swa_cap`` rows)
lies among the kept ones. So a prefill chunk of n > swa_cap rows needs its MTP pass (whole, or a paused step's
keep-up pass) over its last swa_cap rows only: for a 1k-token chunk an eighth of the rows.

``MtpRows`` re-indexes the step's window tables for such a subset: step rows in the combined index space become
the subset's rows, a key before a request's kept rows is masked (only rows whose output nobody reads have
such keys: their windows reach back past the kept rows), and ``inv`` maps a step row (a draft's pick) to its
subset row. Inert subset rows (``live`` False: a one-request graph bucket padded past a short chunk) read
nothing and write the null row, as padded rows of a plan do. The subset's GEMMs have other row counts than the
whole step's, so their rows round differently (not under ``EngineConfig.batch_invariant``); the MTP layer's
rows feed only drafts, which never change the output tokens. The kept rows are padded with inert rows to a
power of two (``padded``), whose passes warmup runs once each: the first pass at a row count warmup had not run
held the step's launch for about 100 ms (measured on the H100: the seed's command's first prompt step,
BENCHMARKS.md, thirty-second session).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..transfer import to_device

_I64 = torch.int64


@dataclass(frozen=True, eq=False)
class MtpRows:
    keep: torch.Tensor          # [M] the step row of each subset row (0 for an inert row)
    live: torch.Tensor          # [M] bool: False for an inert row
    inv: torch.Tensor           # [N] the subset row of each step row (-1: not kept)
    positions: torch.Tensor     # [M]
    swa_read: torch.Tensor      # [M, W] combined index: ring rows, then the subset's rows
    swa_valid: torch.Tensor     # [M, W] bool
    swa_write: torch.Tensor     # [M] ring row (0, the null row, for an inert row)

    def rows(self, X: torch.Tensor) -> torch.Tensor:
        """The subset's rows of a per-step-row tensor (streams, next ids)."""
        return X[self.keep]

    def ids(self, next_ids: torch.Tensor) -> torch.Tensor:
        """The subset's MTP input ids (0 for an inert row)."""
        return torch.where(self.live, next_ids[self.keep], 0)


def host_keep(num_new: Sequence[int], cap: int) -> list[int] | None:
    """The step rows to keep (the last ``cap`` of each request), or None when no request adds more than ``cap``
    rows (the subset would be the whole step)."""
    if max(num_new, default=0) <= cap:
        return None
    keep, start = [], 0
    for n in num_new:
        keep.extend(range(start + max(0, n - cap), start + n))
        start += n
    return keep


MIN_ROWS = 64  # the smallest row count a kept-rows pass runs at (``padded``)


def max_kept_rows(max_num_tokens: int, max_batch_size: int, cap: int) -> int:
    """The most rows a step's kept-rows pass can have: its tokens, and ``cap`` (swa_cap) a request."""
    return min(max_num_tokens, max_batch_size * cap)


def padded(keep: list[int], largest: int | None = None) -> list[int]:
    """``keep`` padded with inert rows (-1) to the next power of two from ``MIN_ROWS``, or to ``largest`` (the most
    kept rows a step can have, ``max_kept_rows``) where that is less: a kept-rows pass then runs at one of a few
    row counts, which warmup runs each once (``row_counts``, ``inert``), so that serving never runs it first at a
    new row count (which held a step's launch about 100 ms, see the module doc)."""
    M = max(MIN_ROWS, 1 << (len(keep) - 1).bit_length())
    if largest is not None and len(keep) <= largest:
        M = min(M, largest)
    return keep + [-1] * (M - len(keep))


def row_counts(max_rows: int) -> list[int]:
    """Every row count ``padded(.., max_rows)`` gives: powers of two from ``MIN_ROWS`` below ``max_rows``, then
    ``max_rows``."""
    out, M = [], MIN_ROWS
    while M < max_rows:
        out.append(M)
        M *= 2
    return out + [max_rows]


def inert(M: int, W: int, device) -> MtpRows:
    """A subset of ``M`` inert rows (read nothing, write the null row): warmup's pass at a row count."""
    z = torch.zeros(M, dtype=_I64, device=device)
    return MtpRows(keep=z, live=torch.zeros(M, dtype=torch.bool, device=device), inv=z[:0], positions=z,
                   swa_read=torch.zeros(M, W, dtype=_I64, device=device),
                   swa_valid=torch.zeros(M, W, dtype=torch.bool, device=device), swa_write=z)


def one_request_keep(num_new: torch.Tensor, cap: int) -> torch.Tensor:
    """``host_keep`` on the device, for a step of one request padded to more than ``cap`` tokens (a prefill graph
    bucket): ``cap`` entries, the request's last ``cap`` rows, or all its n < cap rows then -1 (inert)."""
    j = torch.arange(cap, dtype=_I64, device=num_new.device)
    n = num_new[:1].to(_I64)
    return torch.where(n >= cap, n - cap + j, torch.where(j < n, j, -1))


def select(tables, keep: torch.Tensor | Sequence[int], swa_step_base: int) -> MtpRows:
    """The window tables of a step (``tables``: a StepPlan or its PlanTables) for the step rows ``keep`` (-1: an
    inert row), on the device, without a host sync (a CUDA graph may capture it). The result has the window
    columns a backend is built from (``CachedBackend.for_draft``)."""
    positions, swa_read, swa_valid, swa_write = tables.positions, tables.swa_read, tables.swa_valid, tables.swa_write
    dev = positions.device
    if not isinstance(keep, torch.Tensor):
        keep = to_device(list(keep), dev)
    N, M = positions.shape[0], keep.shape[0]
    live = keep >= 0
    src = keep.clamp(min=0)
    inv = torch.full((N + 1,), -1, dtype=_I64, device=dev)
    inv.scatter_(0, torch.where(live, src, N), torch.arange(M, dtype=_I64, device=dev))  # inert rows: entry N
    inv = inv[:N]
    read = swa_read[src]
    own = read >= swa_step_base  # a key of this step: the subset row holding it, if kept
    sub = inv[(read - swa_step_base).clamp(0, N - 1)]
    valid = swa_valid[src] & live[:, None] & (~own | (sub >= 0))
    read = torch.where(valid, torch.where(own, swa_step_base + sub, read), 0)
    return MtpRows(keep=src, live=live, inv=inv, positions=torch.where(live, positions[src], 0), swa_read=read,
                   swa_valid=valid, swa_write=torch.where(live, swa_write[src], 0))
