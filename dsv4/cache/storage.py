"""Device tensors of the cache, one per layer and kind, all created with torch.zeros (R3).

Row addressing (slot s, block b, S = swa_cap, cap = state_cap(r), epb = entries_per_block(r)):

    swa[l]          [(num_slots+1) * S, D]                  position p of slot s: row s*S + p % S
    state[l]        [(num_slots+1) * cap, 2*coff*D] fp32    [kv | score(+ape)] of one token, row s*cap + p % cap
    index_state[l]  [(num_slots+1) * cap4, 2*2*dI] fp32     same for the CSA layers' indexer compressor
    entries[l]      [(num_blocks+1) * epb, D]               entry w: row block_table[w // epb]*epb + w % epb
    index_keys[l]   [(num_blocks+1) * epb4, dI]             same rows as entries[l] (CSA layers)

Slot 0 / block 0 are the null slot/block. ``swa`` holds every main layer and, at index cfg.num_layers,
the MTP layer (R1). With kv_dtype "fp8", ``swa`` and ``entries`` hold float8_e4m3fn values plus a float32
scale per row and 64-value block (``swa_scale``/``entry_scale``), quantised on write and dequantised on
read; index keys and compressor states stay in the model dtype / fp32. Use the read/write accessors for
``swa`` and ``entries``; states and index keys are plain tensors.
"""

from __future__ import annotations

import torch

from dsv4.cache import ops
from dsv4.cache.layout import CacheConfigError, CacheLayout
from dsv4.config import CSA_RATIO
from dsv4.kernels import store as store_kernel
from dsv4.kernels.fp8 import FP8, dequantize_fp8, num_scale_blocks, quantize_fp8, store_rows

KV_DTYPES = ("auto", "bf16", "fp32", "fp16", "fp64", "fp8")


def resolve_kv_dtype(kv_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the swa/entries tensors are stored in."""
    table = {"auto": dtype, "bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16,
             "fp64": torch.float64, "fp8": FP8}
    if kv_dtype not in table:
        raise CacheConfigError(f"kv_dtype {kv_dtype!r} is not one of {KV_DTYPES}")
    return table[kv_dtype]


def kv_row_bytes(width: int, dtype: torch.dtype, kv_dtype: str) -> int:
    kdt = resolve_kv_dtype(kv_dtype, dtype)
    if kdt == FP8:
        return width + 4 * num_scale_blocks(width)
    return width * kdt.itemsize


class _LayoutMethod:
    """Callable on the class with (layout, dtype, kv_dtype) or on an instance with no arguments."""

    def __init__(self, fn):
        self.fn = fn
        self.__doc__ = fn.__doc__

    def __get__(self, obj, cls):
        if obj is None:
            return self.fn
        return lambda: self.fn(obj.layout, obj.dtype, obj.kv_dtype)


def _slot_bytes(layout: CacheLayout, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    """Bytes of one request's fixed state: SWA rings of every layer (MTP too) + compressor-state rings."""
    D, dI = layout.head_dim, layout.index_head_dim
    total = layout.num_swa_layers * layout.swa_cap * kv_row_bytes(D, dtype, kv_dtype)
    for l in layout.all_compressed_layers:
        r = layout.ratio_of(l)
        total += layout.state_cap(r) * 2 * layout.coff(r) * D * 4
    for _ in layout.csa_layers:
        total += layout.state_cap(CSA_RATIO) * 2 * layout.coff(CSA_RATIO) * dI * 4
    return total


def _block_bytes(layout: CacheLayout, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
    """Bytes of one block of tokens_per_block tokens: compressed entries (+ indexer keys for CSA)."""
    D, dI = layout.head_dim, layout.index_head_dim
    total = 0
    for l in layout.all_compressed_layers:
        total += layout.entries_per_block(layout.ratio_of(l)) * kv_row_bytes(D, dtype, kv_dtype)
    for _ in layout.csa_layers:
        total += layout.entries_per_block(CSA_RATIO) * dI * dtype.itemsize
    return total


class CacheStorage:
    bytes_per_slot = _LayoutMethod(_slot_bytes)
    bytes_per_block = _LayoutMethod(_block_bytes)

    def __init__(self, layout: CacheLayout, num_slots: int, num_blocks: int, device="cpu",
                 dtype: torch.dtype = torch.bfloat16, kv_dtype: str = "auto"):
        self.layout, self.num_slots, self.num_blocks = layout, num_slots, num_blocks
        self.device, self.dtype, self.kv_dtype = torch.device(device), dtype, kv_dtype
        kdt = resolve_kv_dtype(kv_dtype, dtype)
        self.fp8 = kdt == FP8
        D, dI, S = layout.head_dim, layout.index_head_dim, layout.swa_cap
        slots, blocks = num_slots + 1, num_blocks + 1

        def zeros(rows, width, dt):
            return torch.zeros(rows, width, dtype=dt, device=self.device)

        def scales(rows):
            return zeros(rows, num_scale_blocks(D), torch.float32) if self.fp8 else None

        self.swa = [zeros(slots * S, D, kdt) for _ in range(layout.num_swa_layers)]
        self.swa_scale = [scales(slots * S) for _ in range(layout.num_swa_layers)]
        self.state, self.entries, self.entry_scale = {}, {}, {}
        for l in layout.all_compressed_layers:
            r = layout.ratio_of(l)
            self.state[l] = zeros(slots * layout.state_cap(r), 2 * layout.coff(r) * D, torch.float32)
            self.entries[l] = zeros(blocks * layout.entries_per_block(r), D, kdt)
            self.entry_scale[l] = scales(blocks * layout.entries_per_block(r))
        self.index_state, self.index_keys = {}, {}
        for l in layout.csa_layers:
            # the indexer's own compressor pools like the main one of its (CSA) layer
            self.index_state[l] = zeros(slots * layout.state_cap(CSA_RATIO), 2 * layout.coff(CSA_RATIO) * dI,
                                        torch.float32)
            self.index_keys[l] = zeros(blocks * layout.entries_per_block(CSA_RATIO), dI, dtype)

    def tensors(self):
        """Every tensor of the cache (for tests and memory accounting)."""
        out = list(self.swa) + [s for s in self.swa_scale if s is not None]
        for d in (self.state, self.entries, self.entry_scale, self.index_state, self.index_keys):
            out += [t for t in d.values() if t is not None]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    # ---- kv rows (possibly fp8) ----------------------------------------------------------------------
    def _read(self, data, scale, rows):
        if scale is None:
            return data[rows].to(self.dtype)
        flat = rows.reshape(-1)
        q = data.view(torch.uint8)[flat].view(FP8)
        return dequantize_fp8(q, scale[flat], self.dtype).reshape(tuple(rows.shape) + (data.shape[1],))

    def store(self, data, scale, rows, values):
        """Rows [N, D] to the rows ``rows`` of one of this storage's tensors (its FP8 row scales or None). Rows sent
        to row 0 (the null slot's or block's: a prefill chunk's rows before its last window or its last state_cap,
        padding) may be left unwritten: nothing reads it. On the kernels a 16/32-bit tensor takes
        ``kernels.store``, which skips them; ``store_rows`` (index_copy_) writes every row."""
        rows, values = rows.reshape(-1), values.reshape(-1, data.shape[1])
        if scale is None and store_kernel.usable(data, rows, values):
            store_kernel.store_kept_rows(data, rows, values, null=0)
        else:
            store_rows(data, scale, rows, values)

    def read_swa(self, l: int, rows: torch.Tensor) -> torch.Tensor:
        return self._read(self.swa[l], self.swa_scale[l], rows)

    def write_swa(self, l: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.store(self.swa[l], self.swa_scale[l], rows, values)

    def read_entries(self, l: int, rows: torch.Tensor) -> torch.Tensor:
        return self._read(self.entries[l], self.entry_scale[l], rows)

    def write_entries(self, l: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.store(self.entries[l], self.entry_scale[l], rows, values)

    def entry_rows(self, l: int, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer l's entries (name "main", with their FP8 scales or None) or index keys ("indexer", never FP8):
        where a kernel may store this step's rows (``kernels.fp8.store_rows``' format)."""
        if name == "main":
            return self.entries[l], self.entry_scale[l]
        return self.index_keys[l], None

    def read_index_keys(self, l: int, rows: torch.Tensor) -> torch.Tensor:
        return self.index_keys[l][rows]

    def write_index_keys(self, l: int, rows: torch.Tensor, values: torch.Tensor) -> None:
        self.store(self.index_keys[l], None, rows, values)

    # ---- gathers over the combined index space ---------------------------------------------------------
    def gather_swa(self, l: int, step_rows: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Window keys [..., D] for SWA layer l from the ring and this step's rows (see plan.py). This step's rows
        are read as the ring will hold them (``as_stored``): a key reads the same in the step that made it as
        in every later one, and the same as the CUDA backend, which writes its rows first and reads the ring."""
        return ops.gather_with(lambda rows: self.read_swa(l, rows), self.swa[l].shape[0],
                               self.as_stored(l, step_rows), index, valid)

    def swa_with_step_rows(self, l: int, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer l's ring with this step's window rows [N, D] appended as the ring will store them: the plan's
        combined index space (ring rows, then the step's) as one tensor, (rows [R + N, D], row scales or None).
        A copy of the ring (taken before the step writes it), which the prefill kernel path reads."""
        data, scale = self.swa[l], self.swa_scale[l]
        if scale is None:
            return torch.cat([data, values.to(data.dtype)]), None
        q, s = quantize_fp8(values.reshape(-1, values.shape[-1]))
        return torch.cat([data, q.view(data.dtype)]), torch.cat([scale, s])

    def as_stored(self, l: int, values: torch.Tensor) -> torch.Tensor:
        """Window rows [N, D] as ``read_swa`` returns them once written: FP8 quantised and back, else rounded
        to the storage dtype and back (no change when that is the model dtype)."""
        if self.swa_scale[l] is not None:
            q, s = quantize_fp8(values.reshape(-1, values.shape[-1]))
            return dequantize_fp8(q, s, self.dtype).view(values.shape)
        return values.to(self.swa[l].dtype).to(self.dtype)

    def gather_entries(self, l: int, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Visible compressed entries [..., D] (invalid -> zeros)."""
        out = self.read_entries(l, rows)
        return torch.where(valid[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))

    def gather_index_keys(self, l: int, rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        out = self.read_index_keys(l, rows)
        return torch.where(valid[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
