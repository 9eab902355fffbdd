"""``LLM``: the offline API, shaped like TensorRT-LLM's and vLLM's.

    from dsv4 import LLM, SamplingParams
    llm = LLM(model="tiny", speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))
    out[0].outputs[0].token_ids
"""

from __future__ import annotations

import logging
import numbers
import os
import weakref
from typing import Iterator, Sequence

from .builtin import resolve_model
from .checkpoint.tokenizer import load_tokenizer
from .config import is_checkpoint_dir
from .engine.build import build_engine
from .engine.config import EngineConfig, EngineConfigError, KvCacheConfig, from_dict
from .engine.engine import RequestError
from .engine.outputs import CompletionOutput, RequestOutput
from .engine.resolved import dtype_name, resolve, resolve_dtype
from .engine.sampling_params import SamplingParams, is_int, plain_ints
from .engine.warmup import run_warmup
from .kernels.compiles import COMPILES
from .model.expert_weights import check_fp4_shapes
from .model.loader import load_model, model_config
from .parallel.mapping import ParallelMapping

log = logging.getLogger("dsv4")


def _token_ids(p) -> bool:
    """Whether every element of p is an integer token id (bool is not). Plain ints take the fast test
    (``plain_ints``); the ABC check (about 6 ms for an 8k prompt) only other types."""
    return plain_ints(p) or all(is_int(t) for t in p)


class LLM:
    def __init__(self, model: str, *, device: str = "cpu", dtype="auto", warmup: bool = True,
                 config: EngineConfig | None = None, **settings):
        """``model``: a checkpoint directory, a built-in checkpoint (``mini``: trained, see ``dsv4.builtin``) or
        a preset name with random weights (``tiny``, ``tiny-r128``, ``flash-L4-E32``).
        ``settings``: the EngineConfig fields (max_batch_size, max_num_tokens, max_seq_len, kv_cache_config,
        speculative_config, cuda_graph_config, moe_config, enforce_eager, enable_attention_dp, ...).

        Several devices: ``tensor_parallel_size`` / ``moe_expert_parallel_size`` / ``enable_attention_dp``
        start max(tp, ep) ranks (see ``dsv4.parallel``); this process is rank 0, the driver. Call
        ``shutdown()`` (or use ``with LLM(...) as llm``) to stop the other ranks before building another.

        ``config``: an ``EngineConfig`` already validated (device and dtype included) instead of keywords.
        Everything the settings leave open is decided once, after the weights are loaded: ``self.resolved``
        (``dsv4.engine.resolved.ResolvedConfig``), which every rank receives whole."""
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        if not isinstance(model, str):
            raise TypeError(f"LLM: model must be a checkpoint directory, a built-in model (mini) or a preset name"
                            f" (tiny, ...), as a string or path; got {type(model).__name__}")
        if not isinstance(warmup, bool):
            raise TypeError(f"LLM: warmup must be True or False, got {warmup!r}")
        model = resolve_model(model)
        if config is not None:
            if not isinstance(config, EngineConfig):
                raise TypeError(f"LLM: config= takes an EngineConfig, got {type(config).__name__}; give the settings"
                                " as keywords instead (LLM(model, max_batch_size=8, ...))")
            if settings or (device, dtype) != ("cpu", "auto"):
                raise EngineConfigError("LLM: give the settings either as config= or as keywords, not both")
            cfg = config
        else:
            if isinstance(settings.get("kv_cache_config"), KvCacheConfig):
                settings["kv_cache_config"] = vars(settings["kv_cache_config"])
            cfg = from_dict(EngineConfig, {"device": device, "dtype": dtype_name(dtype), **settings})
        device = cfg.device
        self._group = None
        self.mapping = ParallelMapping.from_engine_config(cfg)  # refuses what cannot run (pp > 1, ...)
        self.mapping.check_devices(device)
        if self.mapping.world_size > 1:
            from .parallel.driver import serve_torchrun, torchrun_rank

            mc = model_config(model)
            self.mapping.check_model(mc)
            if cfg.linear_format == "fp8":  # refused before any rank starts
                from .parallel.shard import check_fp8_shards

                try:
                    check_fp8_shards(mc, self.mapping)
                except ValueError as e:
                    raise EngineConfigError(str(e)) from None
            if torchrun_rank() not in (None, 0):
                serve_torchrun(device, self.mapping)  # ranks >= 1 under torchrun serve rank 0, then exit
        if cfg.moe_config.expert_format == "fp4":  # refused before any weight is read
            mc = model_config(model)
            try:
                check_fp4_shapes(mc.hidden_size, mc.moe_inter_dim // self.mapping.moe_tp,
                                 f" / moe_tp ({self.mapping.moe_tp})" if self.mapping.moe_tp > 1 else "")
            except ValueError as e:
                raise EngineConfigError(str(e)) from None
        self.config = cfg
        self.notes = self._mapping_notes(cfg, device)
        torch_dtype = resolve_dtype(cfg.dtype, device)
        with_mtp = True if cfg.speculative_config else None
        try:
            self._build(model, cfg, device, torch_dtype, with_mtp, warmup)
        except BaseException:
            self.shutdown()  # a multi-device start that failed leaves no rank behind
            raise

    def _build(self, model: str, cfg: EngineConfig, device: str, torch_dtype, with_mtp, warmup: bool):
        COMPILES.quiet()  # (compiles expected until warmup's end: the graphs' capture, warmup's paths)
        try:
            if self.mapping.world_size == 1:
                self.model = load_model(model, device=device, dtype=torch_dtype, with_mtp=with_mtp, seed=cfg.seed,
                                        expert_format=cfg.moe_config.expert_format,
                                        linear_format=cfg.linear_format)
            else:
                from .parallel.driver import load_rank_model, start_group

                self._group = start_group(self.mapping, device)
                weakref.finalize(self, self._group.shutdown)
                _, self.model = load_rank_model(model, self._group, self.mapping, torch_dtype, with_mtp, cfg.seed,
                                                cfg.moe_config.expert_format, cfg.linear_format)
        except Exception as e:
            if with_mtp and "mtp" in str(e).lower():
                raise EngineConfigError(f"speculative_config asks for MTP but {model!r} cannot provide it: {e}."
                                        " Drop speculative_config or use a checkpoint with mtp.* weights") from e
            raise
        mcfg = self.model.cfg
        self.model_config = mcfg
        self.resolved = r = resolve(cfg, mcfg)  # after the weights: the cache's budget is the memory left
        log.info("%s", r.sizing.describe())
        if r.num_slots < cfg.max_batch_size:  # both per rank under attention DP
            self.notes.append(f"the KV cache has room for {r.num_slots} requests at once; max_batch_size="
                              f"{cfg.max_batch_size} is capped to {r.num_slots} (give the cache more memory or"
                              f" lower max_seq_len={r.max_seq_len} for more)")
            log.warning("%s", self.notes[-1])
        self.tokenizer = load_tokenizer(model)
        if self._group is None:
            self.engine = build_engine(self.model, r, self.tokenizer)
        else:
            from .parallel.driver import RankSetup, start_ranks

            setup = RankSetup(os.path.abspath(model) if is_checkpoint_dir(model) else model, r, self.mapping,
                              self.model.has_mtp)
            self.engine = start_ranks(self._group, setup, self.model, self.tokenizer)
        self.warmup_paths = run_warmup(self.engine) if warmup else []

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
        return list(prompt), None

    @staticmethod
    def _check_inputs(prompts, sampling_params) -> tuple[list, list[SamplingParams]]:
        """Every prompt a string or a list of integer token ids, every sampling param a SamplingParams, one per
        prompt: checked for the whole call before any request is queued (TypeError / ValueError naming the
        element)."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of those; got"
                            f" {type(prompts).__name__}")
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                try:
                    p.encode("utf-8")
                except UnicodeEncodeError as e:  # (the tokenizer cannot take it)
                    raise ValueError(f"prompt {i}: not valid Unicode text: a lone surrogate ({p[e.start]!r}) at"
                                     f" character {e.start}") from None
                continue
            if not isinstance(p, (list, tuple)) or not _token_ids(p):
                raise TypeError(f"prompt {i}: expected a string or a list of integer token ids, got {p!r:.80}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or not all(
                isinstance(sp, SamplingParams) for sp in sampling_params):
            raise TypeError("sampling_params must be a SamplingParams or a list of them, one per prompt")
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        return list(prompts), list(sampling_params)

    def _submit(self, prompts, sampling_params) -> list[tuple[str | None, RequestOutput | None]]:
        """Queue the call's requests (all inputs checked first). A request the engine refuses (too long, a
        token outside the vocabulary) gets an error output and the others run; any other failure leaves
        nothing of the call queued."""
        prompts, sampling_params = self._check_inputs(prompts, sampling_params)
        handles = []
        try:
            for prompt, sp in zip(prompts, sampling_params):
                try:
                    ids, text = self._encode(prompt)
                    handles.append((self.engine.add_request(ids, sp, prompt=text), None))
                except RequestError as e:  # only this request is refused; the others run
                    handles.append((None, RequestOutput("", [], [CompletionOutput(0, [], None, "error")], True,
                                                        error=str(e))))
        except BaseException:
            self._release(handles)
            raise
        return handles

    def _release(self, handles) -> None:
        """Abort the call's requests that have not finished and drop them all from the engine's table (a
        failed step, an abandoned stream, a failed submit)."""
        for rid, _ in handles:
            if rid is not None:
                self.engine.abort_request(rid)  # drops it from the engine's table, finished or not

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        handles = self._submit(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=sum(1 for h, _ in handles if h is not None), desc="generate")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            self._release(handles)
        return [err if rid is None else final[rid] for rid, err in handles]

    def generate_stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yield a RequestOutput (cumulative tokens) each time a request gets new tokens or finishes. A
        finished request leaves the engine's table once its last output is yielded (as in ``generate``); a
        stream closed early (or failed) aborts its requests that had not finished."""
        handles = self._submit(prompts, sampling_params)
        try:
            for rid, err in handles:
                if err is not None:
                    yield err
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        self.engine.requests.pop(out.request_id, None)
                    yield out
        finally:
            self._release(handles)

    def get_stats(self) -> dict:
        stats = self.engine.get_stats()
        r = self.resolved
        stats["kv_cache"] = {"num_slots": r.num_slots, "num_blocks": r.num_blocks,
                             "tokens_per_block": r.layout.tokens_per_block, "dtype": r.kv_dtype,
                             "summary": r.sizing.describe()}
        stats["parallel"] = self.mapping.describe()  # world_size: the devices per-device throughput divides by
        return stats
