"""Building an engine from the resolved configuration: the cache's bookkeeping and device storage sized by it,
the runner with its CUDA graphs captured for its graph spec, the scheduler and the proposer. The single-device
LLM calls ``build_engine``; the multi-rank driver builds its ``DistributedEngine`` and every other rank its
runner from the same ``ResolvedConfig`` with the same ``make_storage`` and ``build_graphs``."""

from __future__ import annotations

import logging

from ..cache.manager import KVCacheManager
from ..cache.storage import CacheStorage
from .engine import LLMEngine
from .graphs import build_graphs
from .resolved import ResolvedConfig
from .runner import ModelRunner

log = logging.getLogger("dsv4")


def make_storage(r: ResolvedConfig, device) -> CacheStorage:
    """The KV cache's device buffers, as ``r`` sized them."""
    return CacheStorage(r.layout, r.num_slots, r.num_blocks, device=device, dtype=r.dtype, kv_dtype=r.kv_dtype)


def build_engine(model, r: ResolvedConfig, tokenizer=None) -> LLMEngine:
    """The engine of one device for ``model`` (loaded with ``r.dtype``), its graphs captured."""
    cache = KVCacheManager(r.layout, r.num_slots, r.num_blocks)
    storage = make_storage(r, r.device)
    runner = ModelRunner(model, storage, r.device, r.engine.attention_backend, r.engine.batch_invariant)
    engine = LLMEngine(model, model.cfg, cache, storage, r.engine, r.max_seq_len, tokenizer=tokenizer,
                       runner=runner)
    if build_graphs(engine.runner, r.graphs) is not None:
        log.info("CUDA graphs: batch sizes %s x %d rows per request, padding %s", list(r.graphs.buckets),
                 r.graphs.rows_per_seq, "on" if r.graphs.enable_padding else "off")
    return engine
