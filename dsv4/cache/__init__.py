"""The hybrid KV cache: every layer kind and the MTP layer in one cache, with exact rollback.

* ``layout``  — CacheLayout: ring capacities and block geometry derived from the model config (R7).
* ``manager`` — KVCacheManager: slots, blocks, committed lengths, begin_step / commit_step (plain Python).
* ``plan``    — StepPlan: the immutable per-step tables (R2, R3); the token-region diagram is there.
* ``storage`` — CacheStorage: the zero-initialised device tensors, bf16/fp32/fp8 kv rows.
* ``ops``     — plain-torch gather/scatter over the combined "storage rows, then step rows" index space.
* ``sizing``  — split a byte budget into slots and blocks, and describe the split.
"""

from dsv4.cache.layout import CacheConfigError, CacheLayout
from dsv4.cache.manager import (CHECK_ENV, Alloc, CacheIntegrityError, KVCacheManager, SeqStep, StalePlanError,
                                StepOrderError)
from dsv4.cache.ops import gather_combined, gather_with, scatter_rows
from dsv4.cache.plan import DraftTables, RatioTables, StepPlan, SwaStepTables, build_plan
from dsv4.cache.sizing import CacheSizing, budget_from_fraction, size_cache
from dsv4.cache.storage import CacheStorage, dequantize_fp8, quantize_fp8

__all__ = [
    "Alloc", "CHECK_ENV", "CacheConfigError", "CacheIntegrityError", "CacheLayout", "CacheSizing", "CacheStorage",
    "DraftTables", "KVCacheManager", "RatioTables", "SeqStep", "StalePlanError", "StepOrderError", "StepPlan",
    "SwaStepTables", "budget_from_fraction", "build_plan", "dequantize_fp8", "gather_combined", "gather_with",
    "quantize_fp8", "scatter_rows", "size_cache",
]
