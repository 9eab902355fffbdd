"""CUDA graphs for decode and verify steps: one graph per padded batch size, rows per request fixed
(1 without MTP, 1 + k with it).

A graph replays fixed addresses, so each bucket owns static copies of every plan table the forward
reads (sized for the bucket: N = B * rows tokens, M = N // r + B windows, E = max entries) and the
forward is captured once on inert inputs (every row points at the cache's null slot/block, R3). A step
whose plan was built with the bucket's padding copies its tables into the static ones and replays. Padded
rows are inert: they write the null rows and read nothing valid. The captured forward must not
synchronise with the host (MoE runs the device-side grouped path for this reason).

With ``capture=False`` (CPU, or tests) the same static buffers run eagerly: bucketing, padding and the
static copies are exercised without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from .cuda_backend import CudaBackend

_RATIO_FIELDS = ("state_write", "win_rows", "win_valid", "win_pos", "win_write", "entry_rows", "entry_valid")
_PLAN_FIELDS = ("positions", "swa_read", "swa_valid", "swa_write")


def default_buckets(max_batch_size: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b <= max_batch_size]
    out += list(range(16, max_batch_size + 1, 16))
    if max_batch_size not in out:
        out.append(max_batch_size)
    return sorted(set(out))


@dataclass
class _Bucket:
    batch: int
    ids: torch.Tensor
    next_ids: torch.Tensor
    tables: SimpleNamespace  # static plan tables (same shapes as a padded plan's)
    target_out: torch.Tensor | None = None
    mtp_out: torch.Tensor | None = None
    graphs: dict = field(default_factory=dict)


class GraphRunner:
    def __init__(self, model, storage, rows_per_seq: int, buckets: list[int], enable_padding: bool,
                 max_entries: int, max_blocks: int, with_mtp: bool, capture: bool):
        self.model, self.storage = model, storage
        self.rows, self.enable_padding = rows_per_seq, enable_padding
        self.buckets = sorted(buckets)
        self.max_entries, self.max_blocks = max_entries, max_blocks
        self.with_mtp, self.capture = with_mtp, capture
        self._b: dict[int, _Bucket] = {}
        self.pool = None
        self.num_replays = 0

    # ---- which steps -------------------------------------------------------------------------------
    def bucket_for(self, num_seqs: int, num_new: list[int]) -> int | None:
        """Steps where every request adds exactly ``rows`` tokens (decode / verify; a prefill chunk of that
        size is fine too: the decode-like attention path is valid for up to 1 + max_draft_len rows)."""
        if any(n != self.rows for n in num_new):
            return None
        fits = [b for b in self.buckets if b >= num_seqs]
        if not fits:
            return None
        b = fits[0]
        return b if (b == num_seqs or self.enable_padding) else None

    def matches(self, plan) -> bool:
        """Was this plan built with one of the buckets' padding?"""
        B = plan.slots.shape[0]
        return (B in self._b and plan.positions.shape[0] == B * self.rows
                and all(n == self.rows for n in plan.num_new))

    def padding(self, bucket: int) -> dict:
        return {"pad_batch_to": bucket, "pad_tokens_to": bucket * self.rows, "max_entries": self.max_entries,
                "max_blocks": self.max_blocks}

    # ---- static buffers ------------------------------------------------------------------------------
    def _static_tables(self, B: int) -> SimpleNamespace:
        dev, lay = self.storage.device, self.storage.layout
        N, W, E = B * self.rows, lay.window, self.max_entries
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=dev)  # noqa: E731 - null rows everywhere
        f = lambda *s: torch.zeros(*s, dtype=torch.bool, device=dev)  # noqa: E731 - nothing valid
        ratio = {}
        for r in lay.ratios:
            M, cr = N // r + B, lay.coff(r) * r
            ratio[r] = SimpleNamespace(state_write=z(N), win_rows=z(M, cr), win_valid=f(M, cr), win_pos=z(M),
                                       win_write=z(M), entry_rows=z(N, E), entry_valid=f(N, E))
        swa_base = (self.storage.num_slots + 1) * lay.swa_cap
        return SimpleNamespace(positions=z(N), swa_read=z(N, W), swa_valid=f(N, W), swa_write=z(N),
                               swa_step_base=swa_base, ratio_tables=ratio)

    def _backend(self, t: SimpleNamespace) -> CudaBackend:
        return CudaBackend(self.storage, t.positions, t.swa_read, t.swa_valid, t.swa_write, t.ratio_tables,
                           swa_step_base=t.swa_step_base)

    def _load(self, bk: _Bucket, plan):
        t = bk.tables
        for name in _PLAN_FIELDS:
            getattr(t, name).copy_(getattr(plan, name))
        for r, rt in t.ratio_tables.items():
            src = plan.ratio_tables[r]
            for name in _RATIO_FIELDS:
                getattr(rt, name).copy_(getattr(src, name))

    def _target(self, bk: _Bucket):
        return self.model.streams(bk.ids, self._backend(bk.tables))

    def _mtp(self, bk: _Bucket):
        return self.model.mtp_streams(bk.target_out, bk.next_ids, self._backend(bk.tables))

    # ---- capture (largest bucket first, one shared memory pool) --------------------------------------
    @torch.no_grad()
    def prepare(self):
        for B in sorted(self.buckets, reverse=True):
            N = B * self.rows
            dev = self.storage.device
            bk = _Bucket(B, torch.zeros(N, dtype=torch.long, device=dev), torch.zeros(N, dtype=torch.long, device=dev),
                         self._static_tables(B))
            self._b[B] = bk
            if not self.capture:
                continue
            # one eager run on the inert inputs (loads kernels, allocator warm), then capture
            bk.target_out = self._target(bk)
            if self.with_mtp:
                self._mtp(bk)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                bk.target_out = self._target(bk)
            self.pool = g.pool()
            bk.graphs["target"] = g
            if self.with_mtp:
                g2 = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g2, pool=self.pool):
                    bk.mtp_out = self._mtp(bk)
                bk.graphs["mtp"] = g2
            torch.cuda.synchronize()

    # ---- replay ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def target(self, plan, ids: torch.Tensor) -> torch.Tensor:
        bk = self._b[plan.slots.shape[0]]
        self._load(bk, plan)
        bk.ids.copy_(ids)
        self.num_replays += 1
        if self.capture:
            bk.graphs["target"].replay()
        else:
            bk.target_out = self._target(bk)
        return bk.target_out

    @torch.no_grad()
    def mtp(self, plan, next_ids: torch.Tensor) -> torch.Tensor:
        """The MTP catch-up pass of the same step (tables already loaded by ``target``)."""
        bk = self._b[plan.slots.shape[0]]
        bk.next_ids.copy_(next_ids)
        if self.capture:
            bk.graphs["mtp"].replay()
        else:
            bk.mtp_out = self._mtp(bk)
        return bk.mtp_out
