"""Plain-torch reference primitives over the plan's combined index space.

An index ``i`` of a read table addresses "storage rows first, then this step's rows": ``i < R`` (R =
rows of the storage tensor) reads storage row ``i``, ``i >= R`` reads ``step_rows[i - R]``. Entries with
``valid`` False read as zeros. The CUDA backend's kernels (``engine/cuda_backend.py``, ``kernels/``) read the
same tables.
"""

from __future__ import annotations

from typing import Callable

import torch


def gather_with(read_rows: Callable[[torch.Tensor], torch.Tensor], num_storage_rows: int,
                step_rows: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``gather_combined`` with storage read through ``read_rows(rows [K]) -> [K, *X]`` (e.g. dequantising)."""
    R = num_storage_rows
    flat, ok = index.reshape(-1), valid.reshape(-1)
    in_store = flat < R
    stored = read_rows(torch.where(in_store, flat, 0))                       # [K, *X]
    if step_rows.shape[0] > 0:
        step_idx = (flat - R).clamp(0, step_rows.shape[0] - 1)
        fresh = step_rows[step_idx].to(stored.dtype)                         # [K, *X]
        expand = (-1,) + (1,) * (stored.dim() - 1)
        stored = torch.where(in_store.view(expand), stored, fresh)
    else:
        expand = (-1,) + (1,) * (stored.dim() - 1)
    out = torch.where(ok.view(expand), stored, torch.zeros((), dtype=stored.dtype, device=stored.device))
    return out.reshape(tuple(index.shape) + tuple(stored.shape[1:]))


def gather_combined(storage: torch.Tensor, step_rows: torch.Tensor, index: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
    """storage [R, *X], step_rows [N, *X], index/valid [...] -> [..., *X] (invalid -> zeros)."""
    return gather_with(lambda rows: storage[rows], storage.shape[0], step_rows, index, valid)


def scatter_rows(storage: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """storage[rows[i]] = values[i]. Rows of the null slot/block (padding) may repeat; nothing reads them."""
    storage.index_copy_(0, rows.reshape(-1), values.reshape((-1,) + tuple(storage.shape[1:])).to(storage.dtype))
