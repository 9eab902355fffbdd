"""``LLM``: the offline API, shaped like TensorRT-LLM's and vLLM's.

    from dsv4 import LLM, SamplingParams
    llm = LLM(model="tiny", speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
    out[0].outputs[0].token_ids
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Iterator, Sequence

import torch

from .builtin import resolve_model
from .cache.layout import CacheLayout
from .cache.manager import KVCacheManager
from .cache.sizing import budget_from_fraction, size_cache
from .cache.storage import CacheStorage
from .engine.config import CudaGraphConfig, EngineConfig, EngineConfigError, KvCacheConfig, from_dict
from .engine.engine import LLMEngine, RequestError
from .engine.graphs import build_graphs, default_buckets
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.sampling_params import SamplingParams
from .engine.warmup import run_warmup
from .checkpoint.tokenizer import load_tokenizer
from .model.loader import load_model, model_config
from .parallel.mapping import ParallelMapping

log = logging.getLogger("dsv4")


_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}


def _resolve_dtype(dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if dtype not in _DTYPES:
        raise EngineConfigError(f"dtype {dtype!r}: use auto, fp32, bf16 (or fp16, fp64)")
    return _DTYPES[dtype]


class LLM:
    def __init__(self, model: str, *, device: str = "cpu", dtype="auto", warmup: bool = True, **settings):
        """``model``: a checkpoint directory, a built-in checkpoint (``mini``: trained, see ``dsv4.builtin``) or
        a preset name with random weights (``tiny``, ``tiny-r128``, ``flash-L4-E32``).
        ``settings``: the EngineConfig fields (max_batch_size, max_num_tokens, max_seq_len, kv_cache_config,
        speculative_config, cuda_graph_config, moe_config, enforce_eager, enable_attention_dp, ...).

        Several devices: ``tensor_parallel_size`` / ``moe_expert_parallel_size`` / ``enable_attention_dp``
        start max(tp, ep) ranks (see ``dsv4.parallel``); this process is rank 0, the driver. Call
        ``shutdown()`` (or use ``with LLM(...) as llm``) to stop the other ranks before building another."""
        model = resolve_model(model)
        if isinstance(settings.get("kv_cache_config"), KvCacheConfig):
            settings["kv_cache_config"] = vars(settings["kv_cache_config"])
        cfg: EngineConfig = from_dict(EngineConfig, {"device": device, **settings})
        self._group = None
        self.mapping = ParallelMapping.from_engine_config(cfg)  # refuses what cannot run (pp > 1, ...)
        self.mapping.check_devices(device)
        if self.mapping.world_size > 1:
            from .parallel.driver import serve_torchrun, torchrun_rank

            self.mapping.check_model(model_config(model))
            if torchrun_rank() not in (None, 0):
                serve_torchrun(device, self.mapping)  # ranks >= 1 under torchrun serve rank 0, then exit
        self.config = cfg
        self.notes = self._mapping_notes(cfg, device)
        torch_dtype = _resolve_dtype(dtype, device)
        with_mtp = True if cfg.speculative_config else None
        try:
            self._build(model, cfg, device, torch_dtype, with_mtp, warmup)
        except BaseException:
            self.shutdown()  # a multi-device start that failed leaves no rank behind
            raise

    def _build(self, model: str, cfg: EngineConfig, device: str, torch_dtype, with_mtp, warmup: bool):
        try:
            if self.mapping.world_size == 1:
                self.model = load_model(model, device=device, dtype=torch_dtype, with_mtp=with_mtp, seed=cfg.seed)
            else:
                from .parallel.driver import load_rank_model, start_group

                self._group = start_group(self.mapping, device)
                weakref.finalize(self, self._group.shutdown)
                _, self.model = load_rank_model(model, self._group, self.mapping, torch_dtype, with_mtp, cfg.seed)
        except Exception as e:
            if with_mtp and "mtp" in str(e).lower():
                raise EngineConfigError(f"speculative_config asks for MTP but {model!r} cannot provide it: {e}."
                                        " Drop speculative_config or use a checkpoint with mtp.* weights") from e
            raise
        mcfg = self.model.cfg
        self.model_config = mcfg
        max_seq_len = cfg.max_seq_len or min(mcfg.max_position_embeddings, 8192)
        if max_seq_len > mcfg.max_position_embeddings:
            raise EngineConfigError(f"max_seq_len {max_seq_len} exceeds the model's max_position_embeddings"
                                    f" {mcfg.max_position_embeddings}")
        if cfg.max_num_tokens < 1 + cfg.draft_len:
            raise EngineConfigError(f"max_num_tokens ({cfg.max_num_tokens}) must hold a verify step of"
                                    f" 1 + {cfg.draft_len} draft tokens")

        kvc = cfg.kv_cache_config
        kv_dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(kvc.dtype, kvc.dtype)
        layout = CacheLayout(mcfg, cfg.draft_len, kvc.tokens_per_block)
        if kvc.max_gpu_memory_bytes:
            budget = kvc.max_gpu_memory_bytes
        elif kvc.max_tokens:
            budget = (max(cfg.max_batch_size, 1) * CacheStorage.bytes_per_slot(layout, torch_dtype, kv_dtype)
                      + -(-kvc.max_tokens // kvc.tokens_per_block)
                      * CacheStorage.bytes_per_block(layout, torch_dtype, kv_dtype))
        else:
            budget = budget_from_fraction(kvc.free_gpu_memory_fraction, device)
        self.cache_sizing = size_cache(layout, torch_dtype, kv_dtype, budget, cfg.max_batch_size, max_seq_len)
        log.info("%s", self.cache_sizing.describe())
        self.tokenizer = load_tokenizer(model)
        if self._group is None:
            cache = KVCacheManager(layout, self.cache_sizing.num_slots, self.cache_sizing.num_blocks)
            storage = CacheStorage(layout, self.cache_sizing.num_slots, self.cache_sizing.num_blocks, device=device,
                                   dtype=torch_dtype, kv_dtype=kv_dtype)
            self.engine = LLMEngine(self.model, mcfg, cache, storage, cfg, max_seq_len, tokenizer=self.tokenizer)
            self._prepare_graphs(cfg, layout, max_seq_len)
        else:
            from .parallel.driver import RankSetup, start_ranks

            setup = RankSetup(os.path.abspath(model) if os.path.isdir(model) else model, torch_dtype, cfg.seed,
                              self.model.has_mtp, cfg.draft_len, kvc.tokens_per_block, kv_dtype,
                              self.cache_sizing.num_slots, self.cache_sizing.num_blocks, self.mapping,
                              cfg.attention_backend,
                              self._graph_spec(cfg, layout, max_seq_len))
            self.engine = start_ranks(self._group, setup, self.model, mcfg, cfg, max_seq_len, self.tokenizer, device)
        self.warmup_paths = run_warmup(self.engine) if warmup else []

    def _graph_spec(self, cfg: EngineConfig, layout: CacheLayout, max_seq_len: int) -> dict | None:
        """The CUDA-graph buckets (GraphRunner's arguments but ``capture``), the same on every rank; None
        with enforce_eager or no bucket. Under attention DP they are per lane (max_batch_size is per rank)."""
        if cfg.enforce_eager:
            return None
        gcfg = cfg.cuda_graph_config or CudaGraphConfig()
        limit = min(gcfg.max_batch_size or cfg.max_batch_size, cfg.max_batch_size, self.cache_sizing.num_slots)
        buckets = sorted({b for b in (gcfg.batch_sizes or default_buckets(limit)) if 1 <= b <= limit})
        if not buckets:
            return None
        k = cfg.draft_len
        ratios = self.model_config.ratios
        max_entries = (max_seq_len + k) // min(ratios) + 1 if ratios else 1
        return dict(rows_per_seq=1 + k, buckets=buckets, enable_padding=gcfg.enable_padding,
                    max_entries=max_entries, max_blocks=layout.num_blocks_for(max_seq_len + k), with_mtp=k > 0,
                    draft_len=k)

    def _prepare_graphs(self, cfg: EngineConfig, layout: CacheLayout, max_seq_len: int, capture: bool = True):
        """Capture the decode/verify CUDA graphs (after the cache is sized, before warmup replays them)."""
        spec = self._graph_spec(cfg, layout, max_seq_len)
        if build_graphs(self.engine.runner, spec, capture) is not None:
            log.info("CUDA graphs: batch sizes %s x %d rows per request, padding %s", spec["buckets"],
                     spec["rows_per_seq"], "on" if spec["enable_padding"] else "off")

    def shutdown(self) -> None:
        """Stop the other ranks and leave the process groups (multi-device; nothing to do on one device).
        Also runs when the LLM is garbage-collected or the interpreter exits."""
        if self._group is not None:
            self._group.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _mapping_notes(self, cfg: EngineConfig, device: str) -> list[str]:
        """Settings honoured differently from what they name: said once, visibly (log + llm.notes)."""
        notes = []
        if cfg.moe_config.backend.upper() not in ("AUTO", "TORCH", "DSV4"):
            notes.append(f"moe_config.backend={cfg.moe_config.backend} is a TensorRT-LLM kernel choice; dsv4 maps"
                         " it to its own grouped-expert MoE path")
        if cfg.cuda_graph_config is not None and not cfg.enforce_eager and not device.startswith("cuda"):
            notes.append("cuda_graph_config: there are no CUDA graphs on the CPU; steps run eagerly")
        for n in notes:
            log.warning("%s", n)
        return notes

    # ---- generation ---------------------------------------------------------------------------------
    def _encode(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer (no tokenizer.json in the checkpoint); pass"
                                   " token-id lists instead of strings")
            return self.tokenizer.encode(prompt).ids, prompt
        return [int(t) for t in prompt], None

    def _submit(self, prompts, sampling_params) -> list[tuple[str | None, RequestOutput | None]]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        handles = []
        for prompt, sp in zip(prompts, sampling_params):
            try:
                ids, text = self._encode(prompt)
                handles.append((self.engine.add_request(ids, sp, prompt=text), None))
            except RequestError as e:  # only this request is refused; the others run
                handles.append((None, RequestOutput("", [], [CompletionOutput(0, [], None, "error")], True,
                                                    error=str(e))))
        return handles

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        handles = self._submit(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=sum(1 for h, _ in handles if h is not None), desc="generate")
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        results = []
        for rid, err in handles:
            results.append(err if rid is None else final[rid])
            if rid is not None:
                self.engine.requests.pop(rid, None)
        return results

    def generate_stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput (cumulative tokens) each time a request gets new tokens or finishes. A
        finished request leaves the engine's table once its last output is yielded (as in ``generate``)."""
        handles = self._submit(prompts, sampling_params)
        for rid, err in handles:
            if err is not None:
                yield err
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    self.engine.requests.pop(out.request_id, None)
                yield out

    def get_stats(self) -> dict:
        stats = self.engine.get_stats()
        stats["kv_cache"] = {"num_slots": self.cache_sizing.num_slots, "num_blocks": self.cache_sizing.num_blocks,
                             "tokens_per_block": self.config.kv_cache_config.tokens_per_block,
                             "dtype": self.config.kv_cache_config.dtype, "summary": self.cache_sizing.describe()}
        stats["parallel"] = self.mapping.describe()  # world_size: the devices per-device throughput divides by
        return stats
