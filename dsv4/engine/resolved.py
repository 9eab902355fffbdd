"""The resolved configuration: every decision an engine is built from, made once from the user's settings
(``EngineConfig``), the model's config and the device, then sent whole to every rank.

``EngineConfig`` says what the user asked for ("auto", None, a memory fraction); ``ResolvedConfig`` says what
the engine does: the torch dtype, the KV cache's dtype, max_seq_len, the draft length, the cache layout and its
sizing (slots and blocks), and the CUDA-graph buckets. Nothing downstream re-derives any of these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache.layout import CacheLayout
from ..cache.sizing import CacheSizing, budget_from_fraction, size_cache
from ..cache.storage import CacheStorage
from ..config import ModelConfig
from .config import DEFAULT_PREFILL_TOKEN_SIZES, CudaGraphConfig, EngineConfig, EngineConfigError

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
          "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}
_KV_NAMES = {"bfloat16": "bf16", "float32": "fp32"}


def dtype_name(dtype) -> str:
    """A torch dtype or a dtype name -> the name ``EngineConfig.dtype`` takes."""
    if isinstance(dtype, torch.dtype):
        names = {v: k for k, v in DTYPES.items() if "float" not in k}
        if dtype not in names:
            raise EngineConfigError(f"dtype {dtype}: use fp32, bf16, fp16 or fp64")
        return names[dtype]
    return "auto" if dtype is None else dtype


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in DTYPES:
        raise EngineConfigError(f"dtype {dtype!r}: use auto, fp32, bf16 (or fp16, fp64)")
    return DTYPES[dtype]


def default_buckets(max_batch_size: int) -> list[int]:
    out = [b for b in (1, 2, 4, 8) if b <= max_batch_size]
    out += list(range(16, max_batch_size + 1, 16))
    if max_batch_size not in out:
        out.append(max_batch_size)
    return sorted(set(out))


@dataclass(frozen=True)
class GraphSpec:
    """The CUDA-graph buckets (the same on every rank; under attention DP per lane)."""

    buckets: tuple[int, ...]
    rows_per_seq: int  # 1 + draft length
    enable_padding: bool
    max_entries: int  # compressed entries a request can see at max_seq_len (the static tables' width)
    max_blocks: int
    draft_len: int
    # token counts of the one-request prefill graphs (each > rows_per_seq; () on several devices)
    prefill_tokens: tuple[int, ...] = ()
    # with MTP: buckets of one row per request too (per lane under attention DP), for the steps whose drafting
    # is paused (engine/spec_pause.py: the target pass and the MTP layer's keep-up pass, its window rows) and the
    # probes
    keep_up: bool = False

    @property
    def with_mtp(self) -> bool:
        return self.draft_len > 0


@dataclass(frozen=True)
class ResolvedConfig:
    engine: EngineConfig  # the settings as given (validated)
    device: str
    dtype: torch.dtype  # weights and activations
    kv_dtype: str  # the KV cache's rows: "bf16", "fp32", "fp16", "fp64" or "fp8"
    max_seq_len: int
    layout: CacheLayout  # its max_draft_len is the draft length
    sizing: CacheSizing
    graphs: GraphSpec | None  # None: every step eager

    @property
    def draft_len(self) -> int:
        return self.layout.max_draft_len

    @property
    def num_slots(self) -> int:
        return self.sizing.num_slots

    @property
    def num_blocks(self) -> int:
        return self.sizing.num_blocks

    def summary(self) -> dict:
        """What was decided, as plain values (the bench report prints it)."""
        g = self.graphs
        return {"device": self.device, "dtype": str(self.dtype).replace("torch.", ""), "kv_dtype": self.kv_dtype,
                "max_seq_len": self.max_seq_len, "draft_len": self.draft_len,
                "tokens_per_block": self.layout.tokens_per_block, "num_slots": self.num_slots,
                "num_blocks": self.num_blocks,
                "cuda_graphs": None if g is None else {"buckets": list(g.buckets), "rows_per_request": g.rows_per_seq,
                                                       "padding": g.enable_padding,
                                                       "prefill_tokens": list(g.prefill_tokens)}}


def resolve(cfg: EngineConfig, model_cfg: ModelConfig, budget_bytes: int | None = None) -> ResolvedConfig:
    """Decide everything ``cfg`` leaves open for ``model_cfg`` on ``cfg.device``. ``budget_bytes``: the KV
    cache's byte budget when the caller measured it (free device memory after loading the weights); by default
    from kv_cache_config (max_gpu_memory_bytes, max_tokens, else the free-memory fraction, measured now)."""
    device = cfg.device
    dtype = resolve_dtype(cfg.dtype, device)
    max_seq_len = cfg.max_seq_len or min(model_cfg.max_position_embeddings, 8192)
    if max_seq_len > model_cfg.max_position_embeddings:
        raise EngineConfigError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings"
                                f" {model_cfg.max_position_embeddings}")
    if cfg.max_num_tokens < 1 + cfg.draft_len:
        raise EngineConfigError(f"max_num_tokens ({cfg.max_num_tokens}) must hold a verify step of"
                                f" 1 + {cfg.draft_len} draft tokens")
    kvc = cfg.kv_cache_config
    kv_dtype = _KV_NAMES.get(kvc.dtype, kvc.dtype)
    if kv_dtype == "auto":
        kv_dtype = dtype_name(dtype)
    layout = CacheLayout(model_cfg, cfg.draft_len, kvc.tokens_per_block)
    if budget_bytes is None:
        budget_bytes = kv_budget(cfg, layout, dtype, kv_dtype)
    sizing = size_cache(layout, dtype, kv_dtype, budget_bytes, cfg.max_batch_size, max_seq_len)
    return ResolvedConfig(cfg, device, dtype, kv_dtype, max_seq_len, layout, sizing,
                          _graph_spec(cfg, model_cfg, layout, sizing, max_seq_len))


def kv_budget(cfg: EngineConfig, layout: CacheLayout, dtype: torch.dtype, kv_dtype: str) -> int:
    kvc = cfg.kv_cache_config
    if kvc.max_gpu_memory_bytes:
        return kvc.max_gpu_memory_bytes
    if kvc.max_tokens:  # max_batch_size slots and max_tokens of blocks, plus the null slot and block
        return ((max(cfg.max_batch_size, 1) + 1) * CacheStorage.bytes_per_slot(layout, dtype, kv_dtype)
                + (-(-kvc.max_tokens // kvc.tokens_per_block) + 1)
                * CacheStorage.bytes_per_block(layout, dtype, kv_dtype))
    return budget_from_fraction(kvc.free_gpu_memory_fraction, cfg.device)


def _graph_spec(cfg: EngineConfig, model_cfg: ModelConfig, layout: CacheLayout, sizing: CacheSizing,
                max_seq_len: int) -> GraphSpec | None:
    """None with enforce_eager or no bucket. Under attention DP the buckets are per lane (max_batch_size is
    per rank)."""
    if cfg.enforce_eager:
        return None
    gcfg = cfg.cuda_graph_config or CudaGraphConfig()
    limit = min(gcfg.max_batch_size or cfg.max_batch_size, cfg.max_batch_size, sizing.num_slots)
    buckets = tuple(sorted({b for b in (gcfg.batch_sizes or default_buckets(limit)) if 1 <= b <= limit}))
    if not buckets:
        return None
    k = cfg.draft_len
    ratios = model_cfg.ratios
    max_entries = (max_seq_len + k) // min(ratios) + 1 if ratios else 1
    spec = cfg.speculative_config
    pauses = k > 0 and spec.pause_below_acceptance > 0  # (the drafting pause's keep-up buckets)
    return GraphSpec(buckets, 1 + k, gcfg.enable_padding, max_entries, layout.num_blocks_for(max_seq_len + k), k,
                     _prefill_tokens(cfg, gcfg, 1 + k), keep_up=pauses)


def _single_device(cfg: EngineConfig) -> bool:
    return (cfg.tensor_parallel_size, cfg.moe_expert_parallel_size, cfg.pipeline_parallel_size) == (1, 1, 1) \
        and not cfg.enable_attention_dp


def _prefill_tokens(cfg: EngineConfig, gcfg: CudaGraphConfig, rows_per_seq: int) -> tuple[int, ...]:
    """The prefill graphs' token counts: those given (or the defaults) above a decode step's rows and at most
    max_num_tokens. None on several devices (the ranks' graphs are the decode buckets only)."""
    if not _single_device(cfg):
        return ()
    sizes = DEFAULT_PREFILL_TOKEN_SIZES if gcfg.prefill_token_sizes is None else gcfg.prefill_token_sizes
    return tuple(sorted({n for n in sizes if rows_per_seq < n <= cfg.max_num_tokens}))
