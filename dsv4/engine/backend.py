"""The cached attention backend: the model's layers read and write the KV cache through a step plan.

For every sliding-window layer the plan's ``swa_read`` / ``swa_valid`` say which cache rows (or rows of this
step) each query sees; ``swa_write`` where this step's rows go. Compressed layers additionally write their
compressor-state rows, pool the windows that close in this step into entries, write those, and gather
every entry visible to each query. Reads happen before the writes of the same layer. This is the plain-torch
path (prefill chunks everywhere, every step on the CPU); ``cuda_backend.py`` implements the same contract with
the Triton kernels for decode-like steps, and is tested against it.
"""

from __future__ import annotations

import torch

from ..cache.ops import gather_combined
from ..cache.storage import CacheStorage
from ..kernels import pool as pool_kernel
from ..model.attention import Compressor, attend_gathered, select_top_gathered


class MissingTableError(RuntimeError):
    """The forward needs a table the backend was not given; the message names it."""


class CachedBackend:
    """One query per key group (G = N, Tq = 1): every token gathers its own keys."""

    def __init__(self, storage: CacheStorage, positions: torch.Tensor, swa_read: torch.Tensor,
                 swa_valid: torch.Tensor, swa_write: torch.Tensor, ratio_tables: dict | None = None):
        self.storage = storage
        self.positions = positions
        self.rope_memo = {}
        self.swa_read, self.swa_valid, self.swa_write = swa_read, swa_valid, swa_write
        self.ratio_tables = ratio_tables or {}

    @classmethod
    def for_step(cls, plan, storage: CacheStorage) -> "CachedBackend":
        return cls(storage, plan.positions, plan.swa_read, plan.swa_valid, plan.swa_write, plan.ratio_tables)

    @classmethod
    def for_draft(cls, tables, storage: CacheStorage) -> "CachedBackend":
        """From window tables alone (positions, swa_read/valid/write): a draft step's, or the rows an MTP pass
        keeps (``mtp_rows.MtpRows``)."""
        return cls(storage, tables.positions, tables.swa_read, tables.swa_valid, tables.swa_write)

    attend = staticmethod(attend_gathered)
    select_top = staticmethod(select_top_gathered)

    def group(self, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(1)

    def ungroup(self, x: torch.Tensor) -> torch.Tensor:
        return x.squeeze(1)

    def kv_destination(self, layer_id: int) -> None:
        """None: the window's gather reads this step's kv before the ring is written."""

    def window(self, layer_id: int, kv: torch.Tensor):
        st = self.storage
        keys = st.gather_swa(layer_id, kv, self.swa_read, self.swa_valid)  # [N, W, D]; reads before writes
        st.write_swa(layer_id, self.swa_write, kv)
        return keys, self.swa_valid.unsqueeze(1)

    def write_window(self, layer_id: int, kv: torch.Tensor) -> None:
        self.storage.write_swa(layer_id, self.swa_write, kv)

    def compressed(self, layer_id: int, name: str, comp: Compressor, rows: torch.Tensor):
        t = self.write_compressed(layer_id, name, comp, rows)
        st = self.storage
        if name == "main":
            visible = st.gather_entries(layer_id, t.entry_rows, t.entry_valid)  # [N, E, D]
        else:
            visible = st.gather_index_keys(layer_id, t.entry_rows, t.entry_valid)
        return visible, t.entry_valid.unsqueeze(1)

    def state_destination(self, layer_id: int, name: str, ratio: int) -> None:
        """None: the windows are pooled from the ring as it was before this step, then the step's rows written."""

    def write_compressed(self, layer_id: int, name: str, comp: Compressor, step_rows: torch.Tensor):
        """Write this step's compressor-state rows and the entries of the windows closing in this step;
        returns the ratio's tables."""
        st, t = self.storage, self.ratio_tables.get(comp.ratio)
        if t is None:
            raise MissingTableError(f"layer {layer_id} ({name} compressor) needs the step plan's ratio-{comp.ratio}"
                                    f" tables, which this backend was not given (it has ratios"
                                    f" {sorted(self.ratio_tables)}); build it with CachedBackend.for_step(plan,"
                                    " storage) from a plan of the same cache layout")
        state = st.state[layer_id] if name == "main" else st.index_state[layer_id]  # [rows, 2*coff*D'] fp32
        data, scale = st.entry_rows(layer_id, name)
        if pool_kernel.usable(state):  # one kernel reads the window rows in place; the lines below are its twin
            pooled = pool_kernel.pool_rows(state, step_rows, t.win_rows, t.win_valid, comp.ratio, comp.coff,
                                           comp.head_dim)
            comp.finish(pooled, t.win_pos, data, t.win_write, scale)  # the norm-rope kernel stores the entries
        else:
            rows = gather_combined(state, step_rows, t.win_rows, t.win_valid)
            kv_rows, score_rows = rows.chunk(2, dim=-1)  # [M, coff*r, coff*D'] each
            st.store(data, scale, t.win_write, comp.pool(kv_rows, score_rows, t.win_valid, t.win_pos))
        if self.state_destination(layer_id, name, comp.ratio) is None:  # else the projection stored them
            st.store(state, None, t.state_write, step_rows)  # (a prefill chunk's rows but its last state_cap: row 0)
        return t
