"""Split a byte budget between per-request state (slots) and per-token state (blocks), and report it.

Per request (a slot): the SWA rings of every layer and the MTP layer, plus the compressor-state rings;
fixed size whatever the sequence length. Per token (blocks of tokens_per_block): compressed entries and
indexer keys. For DeepSeek-V4 the fixed state dominates until sequences are thousands of tokens long, so
slots are sized first (up to max_batch_size) and the rest of the budget becomes blocks, capped at what the
admitted sequences can ever use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from dsv4.cache.layout import CacheConfigError, CacheLayout
from dsv4.cache.storage import CacheStorage

_MiB = 1 << 20


def _size(n: int) -> str:
    """Bytes in the unit that shows them (never "0.0 MiB" for a small cache)."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", _MiB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class CacheSizing:
    num_slots: int
    num_blocks: int
    bytes_per_slot: int
    bytes_per_block: int
    tokens_per_block: int
    total_bytes: int            # including the null slot and block
    budget_bytes: int
    capped: bool                # blocks were capped below what the budget allows

    def describe(self) -> str:
        per_tok = self.bytes_per_block / self.tokens_per_block / 1024
        s = (f"KV cache: {self.num_slots} slots x {_size(self.bytes_per_slot)} per request "
             f"(SWA rings + compressor states) + {self.num_blocks} blocks x {_size(self.bytes_per_block)} "
             f"per {self.tokens_per_block} tokens ({per_tok:.2f} KiB/token, "
             f"{self.num_blocks * self.tokens_per_block} tokens) = {_size(self.total_bytes)} "
             f"of a {_size(self.budget_bytes)} budget")
        if self.capped:
            s += "; blocks capped at what max_batch_size x max_seq_len can use"
        return s


def size_cache(layout: CacheLayout, dtype: torch.dtype, kv_dtype: str, budget_bytes: int,
               max_batch_size: int, max_seq_len: int) -> CacheSizing:
    """Slots for min(max_batch_size, what fits beside one full sequence's blocks), the rest as blocks.

    Raises CacheConfigError if not even one sequence of max_seq_len tokens (+ draft lookahead) fits.
    """
    if max_batch_size < 1 or max_seq_len < 1:
        raise CacheConfigError(f"max_batch_size ({max_batch_size}) and max_seq_len ({max_seq_len}) must be >= 1")
    bps = CacheStorage.bytes_per_slot(layout, dtype, kv_dtype)
    bpb = CacheStorage.bytes_per_block(layout, dtype, kv_dtype)
    tpb = layout.tokens_per_block
    blocks_per_seq = layout.num_blocks_for(max_seq_len + layout.max_draft_len)
    null = bps + bpb                                    # slot 0 and block 0
    one_seq = bps + blocks_per_seq * bpb
    budget = int(budget_bytes)
    if null + one_seq > budget:
        raise CacheConfigError(
            f"the KV cache budget of {budget / _MiB:.1f} MiB cannot hold one sequence of max_seq_len="
            f"{max_seq_len} tokens (+{layout.max_draft_len} draft lookahead): that needs "
            f"{(null + one_seq) / _MiB:.1f} MiB ({bps / _MiB:.2f} MiB per request + {blocks_per_seq} blocks x "
            f"{bpb / 1024:.1f} KiB, plus the null slot and block); lower max_seq_len or give the cache more "
            "memory (free_gpu_memory_fraction / an explicit size)")
    num_slots = max(1, min(max_batch_size, (budget - null - blocks_per_seq * bpb) // bps))
    cap = num_slots * blocks_per_seq
    fit = (budget - null - num_slots * bps) // bpb if bpb else cap
    num_blocks = min(fit, cap)
    return CacheSizing(num_slots=num_slots, num_blocks=num_blocks, bytes_per_slot=bps, bytes_per_block=bpb,
                       tokens_per_block=tpb, total_bytes=(num_slots + 1) * bps + (num_blocks + 1) * bpb,
                       budget_bytes=budget, capped=fit > cap)


def budget_from_fraction(fraction: float, device) -> int:
    """``fraction`` of the free memory of ``device``: CUDA free memory, or available system memory on CPU."""
    if not 0.0 < fraction <= 1.0:
        raise CacheConfigError(f"the memory fraction must be in (0, 1], got {fraction}")
    dev = torch.device(device)
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return int(free * fraction)
    return int(_available_system_memory() * fraction)


def _available_system_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
