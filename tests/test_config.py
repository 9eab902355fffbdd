"""The config adapter against the real Flash and Pro config.json values (model doc, section 1.1)."""

import pytest

from dsv4.config import CSA, FLASH, HCA, PRO, SWA, ConfigError, from_config_dict, get_preset


def official(hidden, layers, heads, q_lora, o_groups, ratios, topk, experts, inter, route):
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 129280,
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": q_lora,
        "o_groups": o_groups, "o_lora_rank": 1024, "sliding_window": 128, "compress_ratios": ratios,
        "index_n_heads": 64, "index_head_dim": 128, "index_topk": topk, "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 1048576, "n_routed_experts": experts, "num_experts_per_tok": 6,
        "n_shared_experts": 1, "moe_intermediate_size": inter, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": route, "num_hash_layers": 3,
        "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
        "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1,
    }


FLASH_JSON = official(4096, 43, 64, 1024, 8, [0, 0] + [4, 128] * 20 + [4] + [0], 512, 256, 2048, 1.5)
PRO_JSON = official(7168, 61, 128, 1536, 16, [128, 128] + [4, 128] * 29 + [4] + [0], 1024, 384, 3072, 2.5)


def test_flash_official_config():
    cfg = from_config_dict(FLASH_JSON)
    assert cfg == FLASH
    kinds = cfg.layer_kinds
    assert kinds[:2] == (SWA, SWA) and kinds.count(CSA) == 21 and kinds.count(HCA) == 20
    assert all(kinds[i] == CSA for i in range(2, 43, 2)) and all(kinds[i] == HCA for i in range(3, 42, 2))
    assert cfg.num_mtp_layers == 1 and cfg.num_hash_layers == 3 and cfg.yarn.factor == 16
    assert cfg.yarn.original_max_position_embeddings == 65536 and cfg.rope_dim == 64


def test_pro_official_config():
    cfg = from_config_dict(PRO_JSON)
    assert cfg == PRO
    kinds = cfg.layer_kinds
    assert kinds.count(HCA) == 31 and kinds.count(CSA) == 30 and SWA not in kinds
    assert cfg.index_topk == 1024 and cfg.route_scale == 2.5 and cfg.o_groups == 16


@pytest.mark.parametrize("cfg", [FLASH, PRO, get_preset("tiny"), get_preset("tiny-r128")])
def test_transformers_form_round_trip(cfg):
    assert from_config_dict(cfg.to_hf_dict()) == cfg
    assert from_config_dict(cfg.to_official_dict()) == cfg


def test_transformers_nested_rope_parameters():
    d = FLASH.to_hf_dict()
    d["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
                            "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
                                         "original_max_position_embeddings": 65536, "beta_fast": 32,
                                         "beta_slow": 1, "partial_rotary_factor": 0.125}}
    assert from_config_dict(d) == FLASH


def test_reduced_flash_keeps_layer_dimensions():
    cfg = get_preset("flash-L4-E32")
    assert cfg.num_layers == 4 and cfg.n_routed_experts == 32
    assert cfg.layer_kinds == (SWA, CSA, HCA, CSA)
    for k in ("hidden_size", "num_heads", "head_dim", "q_lora_rank", "o_lora_rank", "moe_inter_dim", "index_topk"):
        assert getattr(cfg, k) == getattr(FLASH, k)


def test_full_depth_flash_keeps_the_whole_layer_stack():
    """flash-E128: Flash with half its experts, everything else Flash's own (and a clear refusal below 6)."""
    cfg = get_preset("flash-E128")
    assert cfg == FLASH.replace(n_routed_experts=128) and cfg.num_layers == 43 and cfg.num_hash_layers == 3
    with pytest.raises(ConfigError, match="needs >= 6 experts"):
        get_preset("flash-E4")


@pytest.mark.parametrize("change, needle", [
    ({"compress_ratios": [0, 4]}, "compress_ratios"),
    ({"model_type": "llama"}, "model_type"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
])
def test_bad_configs_name_the_key(change, needle):
    with pytest.raises(ConfigError, match=needle):
        from_config_dict({**FLASH_JSON, **change})


def test_unknown_hf_layer_type():
    d = get_preset("tiny").to_hf_dict()
    d["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    with pytest.raises(ConfigError, match="full_attention"):
        from_config_dict(d)


def test_layer_kinds_are_specified_once():
    from dsv4.config import kind_spec

    assert [(s.kind, s.coff, s.has_indexer) for s in map(kind_spec, (0, 4, 128))] == [
        (SWA, 0, False), (CSA, 2, True), (HCA, 1, False)]
    cfg = get_preset("tiny")
    from dsv4.cache.layout import CacheLayout

    layout = CacheLayout(cfg, 0, 128)
    assert layout.csa_layers == tuple(i for i, r in enumerate(cfg.compress_ratios) if kind_spec(r).has_indexer)
