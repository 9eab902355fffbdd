"""The resolved configuration: decided once from the settings, the model's config and the device; what the
engine, the graphs and every rank are built from, and what the LLM and the bench report say."""

from __future__ import annotations

import pickle

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.config import ModelConfig
from dsv4.engine.config import EngineConfig, EngineConfigError, from_dict
from dsv4.engine.resolved import GraphSpec, resolve
from dsv4.model.loader import model_config


def _cfg(**kw) -> EngineConfig:
    return from_dict(EngineConfig, kw)


def test_fp64_model_reports_fp64():
    """LLM(dtype=...) goes through EngineConfig: the resolved dtype is the one the weights have."""
    llm = LLM("tiny", dtype=torch.float64, max_batch_size=2, max_seq_len=64, warmup=False)
    assert llm.config.dtype == "fp64" and llm.resolved.dtype == torch.float64
    assert llm.model.embed.weight.dtype == torch.float64 and llm.resolved.kv_dtype == "fp64"
    assert all(t.dtype == torch.float64 for t in llm.engine.storage.swa)


def test_config_and_keywords_are_one_or_the_other():
    with pytest.raises(EngineConfigError, match="not both"):
        LLM("tiny", config=_cfg(max_batch_size=2), max_batch_size=2)


def test_config_object_builds_the_same_engine_as_keywords():
    kw = dict(max_batch_size=2, max_seq_len=96, kv_cache_config={"max_tokens": 256},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    a = LLM("tiny", warmup=False, **kw)
    b = LLM("tiny", warmup=False, config=_cfg(device="cpu", **kw))
    assert a.resolved.summary() == b.resolved.summary()
    prompt, sp = [[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0.0)
    assert ([o.outputs[0].token_ids for o in a.generate(prompt, sp)]
            == [o.outputs[0].token_ids for o in b.generate(prompt, sp)])


def test_resolve_decides_everything_once():
    mcfg: ModelConfig = model_config("tiny")
    r = resolve(_cfg(max_batch_size=4, max_seq_len=128, kv_cache_config={"max_tokens": 512},
                     speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 3}), mcfg)
    assert r.dtype == torch.float32 and r.kv_dtype == "fp32" and r.max_seq_len == 128
    assert r.draft_len == 3 == r.layout.max_draft_len and r.num_slots == 4
    assert r.num_blocks * r.layout.tokens_per_block >= 512  # kv_cache_config.max_tokens is honoured
    g = r.graphs
    assert isinstance(g, GraphSpec) and g.buckets == (1, 2, 4) and g.rows_per_seq == 4 and g.with_mtp
    assert g.max_blocks == r.layout.num_blocks_for(128 + 3)
    assert g.prefill_tokens == (64, 128, 256, 512, 1024)  # (the defaults up to max_num_tokens, 8192)
    for parallel in ({"tensor_parallel_size": 2}, {"moe_expert_parallel_size": 2}, {"enable_attention_dp": True}):
        spec = resolve(_cfg(max_batch_size=4, max_seq_len=128, kv_cache_config={"max_tokens": 512}, **parallel), mcfg)
        assert spec.graphs.prefill_tokens == ()  # prefill graphs on one device only
    assert pickle.loads(pickle.dumps(r)).summary() == r.summary()  # sent whole to every rank
    assert resolve(_cfg(max_batch_size=4, enforce_eager=True, max_seq_len=128), mcfg).graphs is None
    with pytest.raises(EngineConfigError, match="max_position_embeddings"):
        resolve(_cfg(max_seq_len=mcfg.max_position_embeddings + 1), mcfg)
    with pytest.raises(EngineConfigError, match="verify step"):
        resolve(_cfg(max_num_tokens=2, speculative_config={"decoding_type": "MTP",
                                                            "num_nextn_predict_layers": 2}), mcfg)
