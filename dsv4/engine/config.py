"""Engine settings, named as TensorRT-LLM's LLM API names them, as frozen typed dataclasses.

``from_dict`` is the one way in from user input (LLM keyword arguments, a YAML file): it refuses an unknown
key naming the valid ones, and checks each value's type, so nothing is silently ignored.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field


class EngineConfigError(ValueError):
    """A setting this engine cannot honour; the message says which and what to change."""


@dataclass(frozen=True)
class KvCacheConfig:
    tokens_per_block: int = 128  # page size of the growing caches (compressed entries, indexer keys)
    dtype: str = "auto"  # "auto" (the model dtype), "bf16", "fp32", "fp8" (e4m3 with per-64 scales)
    free_gpu_memory_fraction: float = 0.9  # share of free device memory for the cache
    max_tokens: int | None = None  # an explicit budget in tokens (overrides the fraction)
    max_gpu_memory_bytes: int | None = None  # an explicit budget in bytes

    def __post_init__(self):
        if self.dtype not in ("auto", "bf16", "bfloat16", "fp32", "float32", "fp8"):
            raise EngineConfigError(f"kv_cache_config.dtype {self.dtype!r}: use auto, bf16, fp32 or fp8")
        if not 0 < self.free_gpu_memory_fraction <= 1:
            raise EngineConfigError("kv_cache_config.free_gpu_memory_fraction must be in (0, 1]")
        if self.tokens_per_block <= 0:
            raise EngineConfigError("kv_cache_config.tokens_per_block must be > 0")
        for name in ("max_tokens", "max_gpu_memory_bytes"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise EngineConfigError(f"kv_cache_config.{name} must be >= 1 (or left out), got {v}")


MAX_DRAFT_LEN = 16
# bounds that no device reaches (they refuse 1e23 before anything is sized or allocated)
MAX_BATCH_SIZE = 1 << 16
MAX_NUM_TOKENS = 1 << 24


@dataclass(frozen=True)
class SpeculativeConfig:
    decoding_type: str = "MTP"
    num_nextn_predict_layers: int = 1  # draft tokens per step (DeepSeek-V4's one MTP layer is reused)
    max_draft_len: int | None = None  # alias used by newer TensorRT-LLM releases
    # drafting paused while fewer of the last drafts than this are accepted (0: never), a probe step every
    # pause_probe_interval paused steps, doubled after each probe that does not resume up to
    # pause_max_probe_interval (engine/spec_pause.py): speculation that does not pay costs little
    pause_below_acceptance: float = 0.3
    pause_probe_interval: int = 32
    pause_max_probe_interval: int = 256

    def __post_init__(self):
        if self.decoding_type.upper() != "MTP":
            raise EngineConfigError(f"speculative_config.decoding_type {self.decoding_type!r}: only MTP is"
                                    " supported for DeepSeek-V4")
        if self.draft_len < 1:
            raise EngineConfigError("speculative_config: the number of draft tokens must be >= 1")
        if self.draft_len > MAX_DRAFT_LEN:
            raise EngineConfigError(f"speculative_config: {self.draft_len} draft tokens per step; at most"
                                    f" {MAX_DRAFT_LEN} (DeepSeek-V4's one MTP layer is chained once per draft"
                                    " token and its drafts are rarely accepted past 3 or 4)")
        if not 0 <= self.pause_below_acceptance <= 1:
            raise EngineConfigError(f"speculative_config.pause_below_acceptance {self.pause_below_acceptance}:"
                                    " an acceptance rate in [0, 1] (0 never pauses drafting)")
        if self.pause_probe_interval < 1:
            raise EngineConfigError(f"speculative_config.pause_probe_interval {self.pause_probe_interval}: the"
                                    " paused steps between two probes, >= 1")
        if self.pause_max_probe_interval < self.pause_probe_interval:
            raise EngineConfigError(f"speculative_config.pause_max_probe_interval {self.pause_max_probe_interval}:"
                                    " the most paused steps between two probes, >= pause_probe_interval"
                                    f" ({self.pause_probe_interval})")

    @property
    def draft_len(self) -> int:
        return self.max_draft_len if self.max_draft_len is not None else self.num_nextn_predict_layers


# prefill chunks of one request replayed as CUDA graphs (CudaGraphConfig.prefill_token_sizes' default)
DEFAULT_PREFILL_TOKEN_SIZES = (64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class CudaGraphConfig:
    enable_padding: bool = False
    batch_sizes: list[int] | None = None
    max_batch_size: int = 0
    # one request's prefill chunk of up to N tokens replays a graph captured for N tokens (padded with inert
    # rows): None gives DEFAULT_PREFILL_TOKEN_SIZES (those up to max_num_tokens), [] none. One device only.
    prefill_token_sizes: list[int] | None = None

    def __post_init__(self):
        if self.batch_sizes is not None and (not self.batch_sizes or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.batch_sizes)):
            raise EngineConfigError(f"cuda_graph_config.batch_sizes must be a non-empty list of integers >= 1,"
                                    f" got {self.batch_sizes!r}")
        if self.max_batch_size < 0:
            raise EngineConfigError(f"cuda_graph_config.max_batch_size must be >= 0 (0: max_batch_size), got"
                                    f" {self.max_batch_size}")
        if self.prefill_token_sizes is not None and not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.prefill_token_sizes):
            raise EngineConfigError(f"cuda_graph_config.prefill_token_sizes must be a list of integers >= 1 ([]: no"
                                    f" prefill graphs), got {self.prefill_token_sizes!r}")


@dataclass(frozen=True)
class MoeConfig:
    backend: str = "AUTO"  # TensorRT-LLM names (TRTLLM, CUTLASS, ...) map to this engine's one MoE path
    # the routed experts' weights on the device: "dequantized" (the model dtype; a checkpoint's FP4 is decoded at
    # load) or "fp4" (packed e2m1 with e8m0 scales per 32 inputs, as DeepSeek ships them; decoded in the grouped
    # GEMM: a quarter of the bytes a decode step reads for them). dsv4.model.expert_weights
    expert_format: str = "dequantized"

    def __post_init__(self):
        if self.expert_format not in ("dequantized", "fp4"):
            raise EngineConfigError(f"moe_config.expert_format {self.expert_format!r}: use dequantized or fp4")


def _check_device(device) -> None:
    """``cpu`` or ``cuda[:N]`` with a GPU this PyTorch can use; anything else is a setting to change."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise EngineConfigError(f"device {device!r}: use cpu or cuda (cuda:N for one GPU of several)") from None
    if dev.type not in ("cpu", "cuda"):
        raise EngineConfigError(f"device {device!r}: dsv4 runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineConfigError(f"device {device!r}: this PyTorch build has no CUDA or sees no GPU"
                                f" (torch {torch.__version__}); use device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise EngineConfigError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA devices")


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: str = "auto"  # model weights/activations: auto = fp32 on CPU, bf16 on CUDA
    max_batch_size: int = 64
    max_num_tokens: int = 8192
    max_seq_len: int | None = None  # default: min(max_position_embeddings, 8192)
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    speculative_config: SpeculativeConfig | None = None
    cuda_graph_config: CudaGraphConfig | None = None
    moe_config: MoeConfig = field(default_factory=MoeConfig)
    # the linears DeepSeek ships as FP8 (attention, shared experts, MTP): "dequantized" (the model dtype) or
    # "fp8" (e4m3 with block-128 scales kept on the device, multiplied weight-only: half the bytes a decode step
    # reads for them). dsv4.model.linear_weights
    linear_format: str = "dequantized"
    enforce_eager: bool = False
    # the overlap scheduler (on by default, as in TensorRT-LLM): a step without MTP is launched before the
    # previous step's tokens are read back, so the host's bookkeeping runs while the device computes
    disable_overlap_scheduler: bool = False
    attention_backend: str = "auto"  # "auto" (Triton kernels on CUDA: decode, verify and prefill), "torch", "triton"
    # every row's result independent of the batch (model/rows.py): projections on fixed 128-row chunks, one
    # attention path, a prefill chunk alone in its step; bf16 greedy output with MTP on then equals MTP off. Off by
    # default (it costs time).
    batch_invariant: bool = False
    enable_attention_dp: bool = False
    tensor_parallel_size: int = 1
    moe_expert_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    seed: int = 0

    def __post_init__(self):
        for name, most in (("max_batch_size", MAX_BATCH_SIZE), ("max_num_tokens", MAX_NUM_TOKENS)):
            if not 1 <= getattr(self, name) <= most:
                raise EngineConfigError(f"{name} must be in [1, {most}], got {getattr(self, name)}")
        _check_device(self.device)
        if self.linear_format not in ("dequantized", "fp8"):
            raise EngineConfigError(f"linear_format {self.linear_format!r}: use dequantized or fp8")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise EngineConfigError(f"attention_backend {self.attention_backend!r}: use auto, torch or triton")
        if self.max_seq_len is not None and self.max_seq_len < 2:
            raise EngineConfigError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if not -(1 << 63) <= self.seed < (1 << 64):  # what torch.Generator.manual_seed takes
            raise EngineConfigError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed}")

    @property
    def draft_len(self) -> int:
        return self.speculative_config.draft_len if self.speculative_config else 0


def from_dict(cls, data: dict, where: str = ""):
    """Build a config dataclass from a plain dict, refusing unknown keys and wrong types."""
    if data is None:
        return cls()
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise EngineConfigError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in fields:
            raise EngineConfigError(f"unknown key {path!r}; valid keys{' of ' + where if where else ''}: "
                                    f"{', '.join(sorted(fields))}")
        kwargs[key] = _coerce(hints[key], value, path)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - defensive
        raise EngineConfigError(f"{where or cls.__name__}: {e}") from None


def _coerce(tp, value, path):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value, path)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise EngineConfigError(f"{path}: expected a list, got {value!r}")
        return [_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if not isinstance(value, bool):
            raise EngineConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise EngineConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise EngineConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise EngineConfigError(f"{path}: expected a string, got {value!r}")
        return value
    return value
