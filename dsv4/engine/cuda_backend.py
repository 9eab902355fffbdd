"""The CUDA backends: the attention and indexer kernels read the cache in place.

In a step where every request adds at most 1 + max_draft_len tokens (decode, verify, MTP draft steps),
a token's new window row can be written to the ring BEFORE the attention reads it: a write at position p
only overwrites position p - swa_cap, which no query of the same step needs (queries of the step are at
most max_draft_len positions apart, and swa_cap = window + max_draft_len). So the window is plain ring
rows and the kernel reads the ring and the compressed entries where they lie. The K=V head's norm-rope kernel
stores the rows there itself (``kv_destination``), and the compressor projection stores its rows in the
compressor-state ring before the closing windows are pooled (``state_destination``, by the same argument).

Longer prefill chunks (``PrefillCudaBackend``) would overwrite ring rows their own earlier queries still read,
so their window is read from the plan's combined index space (ring rows, then the step's rows) made one tensor:
a copy of the ring with the step's rows appended as the ring stores them, taken before the step writes the
ring. The compressed entries, the indexer and the attention are the decode kernels' (one program per query
token). The plain-torch CachedBackend is the twin of both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import torch

from .. import env, kernels
from ..kernels.indexer import select_top_rows
from ..kernels.sparse_attention import fuses_q_norm, sparse_sink_attention
from ..model.attention import Compressor
from ..model.ops import apply_rope, rms_norm_rope
from ..model.rows import active as rows_fixed
from .backend import CachedBackend

# Test switch, read in every process (multi-rank workers too, which a test's monkeypatch cannot reach):
# "1" takes the decode-like kernel path (its torch twins) and so the CUDA-graph static-buffer path
# (capture=False) on the CPU. Never needed in production: on CUDA the path is on anyway.
STATIC_GRAPHS_ON_CPU_ENV = env.STATIC_GRAPHS_ON_CPU


@dataclass(frozen=True)
class CacheRows:
    """Keys that stay in the cache: ``storage[index]`` where ``valid`` (times ``scale`` for an FP8 cache)."""

    storage: torch.Tensor  # [R, D]
    index: torch.Tensor  # [N, K]
    valid: torch.Tensor  # [N, K] bool
    scale: torch.Tensor | None = None  # [R, D/64] fp32: an FP8 cache's row scales

    def source(self) -> tuple:
        """What the attention kernel takes: (rows, index, valid[, scale])."""
        return (self.storage, self.index, self.valid) + (() if self.scale is None else (self.scale,))


class CudaBackend(CachedBackend):
    def __init__(self, *args, swa_step_base: int, **kw):
        super().__init__(*args, **kw)
        self.swa_step_base = swa_step_base

    @cached_property
    def ring_rows(self) -> torch.Tensor:
        """The window's combined indices as ring rows: this step's own rows are in the ring once written (the
        first window of the step computes it; the prefill backend never reads the ring in place)."""
        own = self.swa_read >= self.swa_step_base
        step_idx = (self.swa_read - self.swa_step_base).clamp(0, self.swa_write.shape[0] - 1)
        return torch.where(own, self.swa_write[step_idx], self.swa_read)

    @classmethod
    def for_step(cls, plan, storage, swa_step_base: int | None = None) -> "CudaBackend":
        """``plan``: a StepPlan, or a PlanTables with ``swa_step_base`` given (a CUDA graph's own expansion)."""
        base = plan.swa_step_base if swa_step_base is None else swa_step_base
        return cls(storage, plan.positions, plan.swa_read, plan.swa_valid, plan.swa_write, plan.ratio_tables,
                   swa_step_base=base)

    @classmethod
    def for_draft(cls, tables, storage, swa_step_base: int) -> "CudaBackend":
        return cls(storage, tables.positions, tables.swa_read, tables.swa_valid, tables.swa_write,
                   swa_step_base=swa_step_base)

    @staticmethod
    def supports(storage) -> bool:
        if env.flag(STATIC_GRAPHS_ON_CPU_ENV):  # test switch: the kernel path's torch twins on CPU
            return True
        # bf16, fp32 and FP8 caches (the kernel dequantises FP8 rows), unless the kernels are switched off
        return storage.device.type == "cuda" and kernels.enabled()

    def kv_destination(self, layer_id: int):
        """The ring, this step's rows and the ring's FP8 scales (or None): the kv norm-rope kernel stores the
        rows there, quantised as the cache stores them (write first: safe in decode-like steps)."""
        st = self.storage
        return st.swa[layer_id], self.swa_write, st.swa_scale[layer_id]

    def state_destination(self, layer_id: int, name: str, ratio: int):
        """The compressor-state ring and this step's rows: written first, as the window ring. In a decode-like
        step a token at position p overwrites the row of p - state_cap = p - coff*ratio - max_draft_len, older
        than every row a window closing in this step pools (from p0 - coff*ratio + 1 on, p0 the request's first
        position in the step, p <= p0 + max_draft_len)."""
        t = self.ratio_tables.get(ratio)
        if t is None:
            return None  # compressed() names the missing tables
        st = self.storage
        return (st.state[layer_id] if name == "main" else st.index_state[layer_id]), t.state_write

    def window(self, layer_id: int, kv: torch.Tensor | None):
        if kv is not None:  # a caller that did not take kv_destination (Attention.forward does)
            self.storage.write_swa(layer_id, self.swa_write, kv)  # write first: safe in decode-like steps
        return CacheRows(self.storage.swa[layer_id], self.ring_rows, self.swa_valid, self.storage.swa_scale[layer_id])

    def compressed(self, layer_id: int, name: str, comp: Compressor, rows: torch.Tensor):
        t = self.write_compressed(layer_id, name, comp, rows)
        st = self.storage
        if name == "main":
            keys = CacheRows(st.entries[layer_id], t.entry_rows, t.entry_valid, st.entry_scale[layer_id])
        else:
            keys = CacheRows(st.index_keys[layer_id], t.entry_rows, t.entry_valid)
        return keys, t.entry_valid.unsqueeze(1)

    def select_top(self, compressed, q: torch.Tensor, w: torch.Tensor, keys: CacheRows, k: int):
        """Score the index keys where they lie and keep k entry rows per token (``dsv4.kernels.indexer``): the
        attention kernel then reads k entries instead of all visible ones."""
        entries, _ = compressed
        rows, valid = select_top_rows(q[:, 0], w[:, 0], keys.storage, keys.index, keys.valid, k,
                                      invariant=rows_fixed())
        return CacheRows(entries.storage, rows, valid, entries.scale), valid.unsqueeze(1)

    takes_raw_q = True  # attend takes the raw q and its norm (``q_norm``) and rotates the output back: the
    # attention's path decides who norms and who rotates

    def attend(self, q: torch.Tensor, window: CacheRows, compressed, sink: torch.Tensor, scale: float,
               q_norm=None):
        sources = [window.source()]
        if compressed is not None:
            rows, visible = compressed
            sources.append(replace(rows, valid=visible[:, 0]).source())
        split = 0 if rows_fixed() else None  # batch invariance: one path whatever the batch size
        q = q[:, 0].contiguous()
        if q_norm is None or fuses_q_norm(q, sources, split, q_norm[1]):
            return sparse_sink_attention(q, sources, sink, scale, split, q_norm).unsqueeze(1)
        eps, rope = q_norm  # the norm's own kernel (or twin) first, the rope's after
        o = sparse_sink_attention(rms_norm_rope(q, None, eps, rope), sources, sink, scale, split)
        return apply_rope(o, rope, inverse=True, in_place=True).unsqueeze(1)


class PrefillCudaBackend(CudaBackend):
    """Any step on the kernels, prefill chunks of any length included: the window keys are read from a copy of
    the ring with the step's rows appended (``CacheStorage.swa_with_step_rows``), so reads precede writes."""

    def kv_destination(self, layer_id: int) -> None:
        """None: the window copy appends this step's kv before the ring is written."""

    def state_destination(self, layer_id: int, name: str, ratio: int) -> None:
        """None: a long chunk's writes may reuse state rows its own earlier windows pool."""

    def window(self, layer_id: int, kv: torch.Tensor):
        st = self.storage
        if st.swa[layer_id].shape[0] != self.swa_step_base:
            raise RuntimeError(f"layer {layer_id}: the plan's step rows start at {self.swa_step_base}, the ring "
                               f"has {st.swa[layer_id].shape[0]} rows; plan and cache come from different layouts")
        rows, scale = st.swa_with_step_rows(layer_id, kv)
        st.write_swa(layer_id, self.swa_write, kv)
        return CacheRows(rows, self.swa_read, self.swa_valid, scale)
