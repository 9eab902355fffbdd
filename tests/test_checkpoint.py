"""dsv4.checkpoint: quantisation formats, schema, name conversions, reading/writing, random init."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dsv4.config import get_preset, load_config
from dsv4.checkpoint.init_random import init_random_checkpoint, random_state_dict
from dsv4.checkpoint.io import CheckpointError, load_checkpoint, read_state_dict, write_checkpoint
from dsv4.checkpoint.names import (deepseek_to_hf, deepseek_to_hf_name, deepseek_to_model, detect_naming,
                                   hf_to_deepseek, hf_to_deepseek_name, hf_to_model, model_to_deepseek,
                                   model_to_hf)
from dsv4.checkpoint.quant import (dequant_fp4, dequant_fp8_block, e8m0_to_float, quant_fp4,
                                   quant_fp8_block)
from dsv4.checkpoint.schema import checkpoint_schema, is_fp32_tensor, mtp_schema

FIXTURE = "/work/shared/fixtures/dsv4-tiny-official-r128/checkpoint"
needs_fixture = pytest.mark.skipif(not os.path.isdir(FIXTURE), reason="shared fixture not present")


def u8(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8)


@pytest.fixture(scope="module")
def tiny():
    return get_preset("tiny")


@pytest.fixture(scope="module")
def tiny_sd(tiny):
    return random_state_dict(tiny, seed=0)


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


# ================================================================================================
# quant.py: hand-computed bytes
# ================================================================================================
def test_e8m0_hand_values():
    got = e8m0_to_float(u8([0x7F, 0x80, 0x7E, 0x85, 0x00, 0xFE, 0xFF]))
    assert got.dtype == torch.float32
    assert got[:6].tolist() == [1.0, 2.0, 0.5, 64.0, 2.0 ** -127, 2.0 ** 127]
    assert math.isnan(got[6])
    as_e8m0 = u8([0x7F, 0x7C]).view(torch.float8_e8m0fnu)
    assert e8m0_to_float(as_e8m0).tolist() == [1.0, 0.125]


@pytest.mark.parametrize("scale_kind", ["e8m0", "float32"])
def test_dequant_fp8_block_hand_values(scale_kind):
    # weight [130, 129]: 2x2 blocks of 128 (the last ones partial)
    w = torch.zeros(130, 129, dtype=torch.uint8)
    w[0, 0] = 0x38  # +1.0   (e4m3: sign 0, exponent 0111, mantissa 000)
    w[0, 128] = 0x40  # +2.0
    w[129, 0] = 0xB8  # -1.0
    w[129, 128] = 0x3C  # +1.5
    w[5, 7] = 0x7E  # 448, the largest e4m3
    w[6, 7] = 0x01  # 2**-9, the smallest subnormal
    scale = u8([[0x7F, 0x81], [0x7C, 0x80]])  # [[1, 4], [1/8, 2]]
    if scale_kind == "e8m0":
        scale = scale.view(torch.float8_e8m0fnu)
    else:
        scale = torch.tensor([[1.0, 4.0], [0.125, 2.0]])
    got = dequant_fp8_block(w.view(torch.float8_e4m3fn), scale, torch.float32)
    assert got.shape == (130, 129) and got.dtype == torch.float32
    assert got[0, 0] == 1.0 and got[0, 128] == 8.0 and got[129, 0] == -0.125 and got[129, 128] == 3.0
    assert got[5, 7] == 448.0 and got[6, 7] == 2.0 ** -9
    assert torch.count_nonzero(got) == 6
    with pytest.raises(ValueError, match="scale"):
        dequant_fp8_block(w.view(torch.float8_e4m3fn), scale[:1], torch.float32)


def _fp4_hand_case():
    """packed [2, 32] (rows of 64 e2m1 values), scale [2, 2], and the expected values written by hand."""
    packed = torch.zeros(2, 32, dtype=torch.uint8)
    packed[0, :4] = u8([0x21, 0x9F, 0x70, 0xA3])  # (.5, 1) (-6, -.5) (0, 6) (1.5, -1): LOW nibble first
    packed[0, 16] = 0x71  # elements 32, 33 = (.5, 6), second scale group
    packed[1, :2] = u8([0x54, 0xEB])  # (2, 3) (-1.5, -4)
    packed[1, 2:] = 0x88  # negative zeros
    scale = u8([[0x80, 0x7D], [0x7E, 0x7F]])  # [[2, 1/4], [1/2, 1]]
    want = torch.zeros(2, 64)
    want[0, :8] = torch.tensor([1.0, 2.0, -12.0, -1.0, 0.0, 12.0, 3.0, -2.0])
    want[0, 32:34] = torch.tensor([0.125, 1.5])
    want[1, :4] = torch.tensor([1.0, 1.5, -0.75, -2.0])
    return packed, scale, want


@pytest.mark.parametrize("storage", ["uint8", "int8", "float4_e2m1fn_x2"])
def test_dequant_fp4_hand_values(storage):
    packed, scale, want = _fp4_hand_case()
    stored = packed if storage == "uint8" else packed.view(getattr(torch, storage))
    got = dequant_fp4(stored, scale.view(torch.float8_e8m0fnu), torch.float32)
    assert torch.equal(got, want)
    got_float_scale = dequant_fp4(stored, e8m0_to_float(scale), torch.bfloat16)
    assert got_float_scale.dtype == torch.bfloat16 and torch.equal(got_float_scale.float(), want)


def test_quant_fp8_block_hand_bytes():
    q, scale = quant_fp8_block(torch.tensor([[1.0, -896.0]]))
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (1, 1)
    assert scale.view(torch.uint8).item() == 0x80  # amax 896 = 2 * 448 -> scale 2
    assert q.dtype == torch.float8_e4m3fn
    assert q.view(torch.uint8).tolist() == [[0x30, 0xFE]]  # 0.5, -448


def test_quant_fp4_hand_bytes():
    w = torch.zeros(1, 32)
    w[0, :8] = torch.tensor([0.5, 1.0, -6.0, -0.5, 0.0, 6.0, 1.5, -1.0])
    packed, scale = quant_fp4(w)
    assert packed.dtype == torch.int8 and packed.shape == (1, 16)
    assert packed.view(torch.uint8)[0, :4].tolist() == [0x21, 0x9F, 0x70, 0xA3]
    assert scale.view(torch.uint8).tolist() == [[0x7F]]


def test_fp8_round_trip():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(200, 300, generator=gen) * torch.logspace(-3, 2, 300)
    q, scale = quant_fp8_block(w)
    assert scale.shape == (2, 3)
    dq = dequant_fp8_block(q, scale, torch.float32)
    s = e8m0_to_float(scale).repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert torch.all((dq - w).abs() <= w.abs() / 16 + s * 2.0 ** -10)  # 3 mantissa bits; subnormal step
    assert torch.equal(dequant_fp8_block(*quant_fp8_block(dq), torch.float32), dq)  # FP8 values are fixed points
    exact = dq.to(torch.bfloat16)  # e4m3 x 2**k fits in bf16: dequant to bf16 is exact too
    assert torch.equal(dequant_fp8_block(q, scale, torch.bfloat16), exact)


def test_fp4_round_trip():
    gen = torch.Generator().manual_seed(2)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = grid[torch.randint(0, 8, (16, 96), generator=gen)] * (torch.randint(0, 2, (16, 96), generator=gen) * 2 - 1)
    values[:, ::32] = 6.0  # each 32-group reaches amax 6 -> its scale is exactly the power of two below
    pow2 = 2.0 ** torch.randint(-6, 6, (16, 3), generator=gen).float()
    w = values * pow2.repeat_interleave(32, dim=1)
    packed, scale = quant_fp4(w)
    assert packed.shape == (16, 48) and scale.shape == (16, 3)
    assert torch.equal(dequant_fp4(packed, scale, torch.float32), w)
    noisy = torch.randn(8, 64, generator=gen)
    p, s = quant_fp4(noisy)
    dq = dequant_fp4(p, s, torch.float32)
    step = e8m0_to_float(s).repeat_interleave(32, dim=1)  # e2m1 gaps are at most 2 units of scale
    assert torch.all((dq - noisy).abs() <= step)


# ================================================================================================
# schema.py
# ================================================================================================
def test_schema_hand_shapes(tiny):
    s = checkpoint_schema(tiny)
    assert s["layers.0.hc_attn_fn"] == (24, 256) and s["hc_head_fn"] == (4, 256) and s["hc_head_scale"] == (1,)
    assert s["layers.0.attn.wo_a.weight"] == (32, 64) and s["layers.0.attn.wq_b.weight"] == (128, 32)
    assert s["layers.1.attn.compressor.ape"] == (4, 64)  # ratio 4: overlapping, 2*D
    assert s["layers.2.attn.compressor.ape"] == (16, 32)  # ratio 16: D
    assert s["layers.1.attn.indexer.wq_b.weight"] == (256, 32)
    assert "layers.2.attn.indexer.wq_b.weight" not in s and "layers.0.attn.compressor.ape" not in s
    assert s["layers.0.ffn.gate.tid2eid"] == (256, 2) and "layers.0.ffn.gate.bias" not in s
    assert s["layers.1.ffn.gate.bias"] == (8,) and "layers.1.ffn.gate.tid2eid" not in s
    assert s["layers.3.ffn.experts.w2"] == (8, 64, 32)
    assert s["mtp.0.ffn.gate.bias"] == (8,) and "mtp.0.attn.compressor.ape" not in s
    assert s["mtp.0.e_proj.weight"] == (64, 64)
    no_mtp = checkpoint_schema(tiny, with_mtp=False)
    assert set(s) - set(no_mtp) == set(mtp_schema(tiny))
    assert not checkpoint_schema(tiny.replace(num_mtp_layers=0)).keys() & set(mtp_schema(tiny))


def test_fp32_names():
    for name in ("hc_head_fn", "layers.3.hc_ffn_scale", "mtp.0.hc_head_base", "layers.1.attn.attn_sink",
                 "layers.1.attn.compressor.ape", "layers.1.attn.indexer.compressor.ape", "mtp.0.ffn.gate.bias"):
        assert is_fp32_tensor(name), name
    for name in ("embed.weight", "layers.1.ffn.gate.weight", "layers.0.attn_norm.weight", "layers.0.ffn.experts.w1"):
        assert not is_fp32_tensor(name), name


@needs_fixture
def test_fixture_matches_schema():
    cfg = load_config(FIXTURE)
    raw = load_file(os.path.join(FIXTURE, "model.safetensors"))
    sd, has_mtp = read_state_dict(FIXTURE, cfg)
    assert has_mtp
    want = checkpoint_schema(cfg)
    assert {k: tuple(v.shape) for k, v in sd.items()} == want
    # stacked experts hold the per-expert tensors; everything else is the file's tensor
    for e in range(cfg.n_routed_experts):
        assert torch.equal(sd["layers.2.ffn.experts.w2"][e], raw[f"layers.2.ffn.experts.{e}.w2.weight"])
        assert torch.equal(sd["mtp.0.ffn.experts.w1"][e], raw[f"mtp.0.ffn.experts.{e}.w1.weight"])
    assert sd["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert torch.equal(sd["layers.0.ffn.gate.tid2eid"], raw["layers.0.ffn.gate.tid2eid"].long())
    assert torch.equal(sd["layers.2.attn.compressor.ape"], raw["layers.2.attn.compressor.ape"])


@needs_fixture
def test_fixture_bf16_keeps_fp32_tensors():
    _, sd, _ = load_checkpoint(FIXTURE, dtype=torch.bfloat16)
    assert sd["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    assert sd["layers.1.ffn.experts.w1"].dtype == torch.bfloat16
    for name in ("hc_head_fn", "layers.1.hc_attn_base", "layers.1.attn.attn_sink", "layers.1.attn.compressor.ape",
                 "layers.1.ffn.gate.bias", "mtp.0.hc_head_scale"):
        assert sd[name].dtype == torch.float32, name


# ================================================================================================
# names.py
# ================================================================================================
def test_name_tables():
    pairs = {
        "embed.weight": "model.embed_tokens.weight",
        "head.weight": "lm_head.weight",
        "norm.weight": "model.norm.weight",
        "hc_head_base": "model.hc_head.hc_base",
        "layers.3.attn_norm.weight": "model.layers.3.input_layernorm.weight",
        "layers.3.hc_ffn_fn": "model.layers.3.ffn_hc.fn",
        "layers.1.attn.attn_sink": "model.layers.1.self_attn.sinks",
        "layers.1.attn.compressor.norm.weight": "model.layers.1.self_attn.compressor.kv_norm.weight",
        "layers.1.attn.indexer.compressor.ape": "model.layers.1.self_attn.compressor.indexer.position_bias",
        "layers.1.attn.indexer.weights_proj.weight":
            "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
        "layers.1.ffn.gate.bias": "model.layers.1.mlp.gate.e_score_correction_bias",
        "layers.0.ffn.shared_experts.w2.weight": "model.layers.0.mlp.shared_experts.down_proj.weight",
    }
    for ds, hf in pairs.items():
        assert deepseek_to_hf_name(ds) == hf
        assert hf_to_deepseek_name(hf) == ds
    assert deepseek_to_hf_name("mtp.0.attn.wq_a.weight") == "mtp.0.attn.wq_a.weight"
    assert hf_to_deepseek_name("model.layers.0.bogus") == "model.layers.0.bogus"
    assert detect_naming(["lm_head.weight"]) == "hf" and detect_naming(["head.weight"]) == "deepseek"


def test_expert_stacking(tiny, tiny_sd):
    ds = model_to_deepseek(tiny_sd)
    assert "layers.0.ffn.experts.w1" not in ds
    assert torch.equal(ds["layers.0.ffn.experts.5.w3.weight"], tiny_sd["layers.0.ffn.experts.w3"][5])
    assert_same(deepseek_to_model(ds, tiny.n_routed_experts), tiny_sd)
    del ds["layers.2.ffn.experts.6.w2.weight"]
    with pytest.raises(CheckpointError, match=r"layers\.2\.ffn\.experts\.6\.w2\.weight"):
        deepseek_to_model(ds, tiny.n_routed_experts)


def test_hf_fused_experts(tiny_sd):
    hf = model_to_hf(tiny_sd)
    gate_up = hf["model.layers.1.mlp.experts.gate_up_proj"]  # [E, 2I, d], w1 rows first
    assert torch.equal(gate_up[:, :32], tiny_sd["layers.1.ffn.experts.w1"])
    assert torch.equal(gate_up[:, 32:], tiny_sd["layers.1.ffn.experts.w3"])
    assert torch.equal(hf["model.layers.1.mlp.experts.down_proj"], tiny_sd["layers.1.ffn.experts.w2"])
    assert "mtp.0.ffn.experts.3.w1.weight" in hf and "mtp.0.attn.wq_a.weight" in hf  # MTP keeps DeepSeek names
    assert_same(hf_to_model(hf, 8), tiny_sd)
    ds = model_to_deepseek(tiny_sd)
    assert_same(hf_to_deepseek(deepseek_to_hf(ds, 8), 8), ds)


@pytest.fixture(scope="module")
def hf_model(tiny):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        pytest.skip("transformers without deepseek_v4")
    return transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**tiny.to_hf_dict()))


def test_hf_names_match_transformers(tiny, tiny_sd, hf_model):
    ours = {k: v for k, v in model_to_hf(tiny_sd).items() if not k.startswith("mtp.")}
    theirs = hf_model.state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in theirs.items()}
    assert theirs["model.layers.0.mlp.gate.tid2eid"].dtype == ours["model.layers.0.mlp.gate.tid2eid"].dtype
    hf_model.load_state_dict(ours, strict=True)


def test_read_transformers_saved_file(tiny, tiny_sd, hf_model, tmp_path):
    hf_model.load_state_dict({k: v for k, v in model_to_hf(tiny_sd).items() if not k.startswith("mtp.")})
    save_file({k: v.clone().contiguous() for k, v in hf_model.state_dict().items()}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(tiny.to_hf_dict()))
    cfg, sd, has_mtp = load_checkpoint(str(tmp_path))
    assert cfg == tiny and not has_mtp
    assert_same(sd, {k: v for k, v in tiny_sd.items() if not k.startswith("mtp.")})


def test_read_what_transformers_save_pretrained_writes(tiny, tiny_sd, hf_model, tmp_path):
    """The installed transformers' own save_pretrained (its layout and its config.json)."""
    hf_model.load_state_dict({k: v for k, v in model_to_hf(tiny_sd).items() if not k.startswith("mtp.")})
    hf_model.save_pretrained(str(tmp_path))
    cfg, sd, has_mtp = load_checkpoint(str(tmp_path))
    assert cfg == tiny and not has_mtp
    assert_same(sd, {k: v for k, v in tiny_sd.items() if not k.startswith("mtp.")})


@pytest.mark.parametrize("version", ["5.23"])
def test_read_what_newer_transformers_wrote(tiny, tiny_sd, version):
    """A checkpoint transformers 5.23's save_pretrained wrote (tools/make_transformers_fixture.py, from the same
    seed-0 weights): DeepSeek's module names under ``model.``, unfused experts, a transformers config.json."""
    d = os.path.join(os.path.dirname(__file__), "fixtures", f"transformers-{version}-tiny")
    with safe_open(os.path.join(d, "model.safetensors"), "pt") as f:
        assert detect_naming(f.keys()) == "hf-deepseek"
    cfg, sd, has_mtp = load_checkpoint(d)
    assert cfg == tiny and not has_mtp
    assert_same(sd, {k: v for k, v in tiny_sd.items() if not k.startswith("mtp.")})


# ================================================================================================
# io.py
# ================================================================================================
@pytest.mark.parametrize("naming", ["deepseek", "hf"])
def test_write_read_round_trip(tiny, tiny_sd, naming, tmp_path):
    write_checkpoint(str(tmp_path), tiny, tiny_sd, naming=naming)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        tid = "layers.0.ffn.gate.tid2eid" if naming == "deepseek" else "model.layers.0.mlp.gate.tid2eid"
        assert f.get_slice(tid).get_dtype() == ("I32" if naming == "deepseek" else "I64")
    assert ("layers.0.ffn.experts.7.w1.weight" in keys) == (naming == "deepseek")
    assert ("model.layers.0.mlp.experts.gate_up_proj" in keys) == (naming == "hf")
    assert "mtp.0.ffn.experts.7.w1.weight" in keys
    cfg, sd, has_mtp = load_checkpoint(str(tmp_path))
    assert cfg == tiny and has_mtp
    assert_same(sd, tiny_sd)


@pytest.mark.parametrize("naming, quantize", [("deepseek", None), ("hf", None), ("deepseek", "fp8")])
def test_read_one_ranks_experts(tiny, tiny_sd, naming, quantize, tmp_path, monkeypatch):
    """An expert-parallel rank reads only its routed experts: the stacked tensors hold experts 2..5, equal
    to those rows of the full read, everything else is the full read, and no other expert's bytes are read
    (per-expert keys are never opened; transformers' fused tensors are read as a row slice)."""
    from dsv4.checkpoint import io

    write_checkpoint(str(tmp_path), tiny, tiny_sd, naming=naming, quantize=quantize)
    full, _ = read_state_dict(str(tmp_path), tiny)
    asked = []
    get = io._Reader._get
    monkeypatch.setattr(io._Reader, "_get",
                        lambda self, name, rows: asked.append((name, rows)) or get(self, name, rows))
    part, has_mtp = read_state_dict(str(tmp_path), tiny, experts=range(2, 6))
    assert has_mtp and sorted(part) == sorted(full)
    stacked = [k for k in full if k.endswith(("ffn.experts.w1", "ffn.experts.w2", "ffn.experts.w3"))]
    assert any(k.startswith("mtp.") for k in stacked)
    for k in full:
        assert torch.equal(part[k], full[k][2:6] if k in stacked else full[k]), k
    per_expert = [int(n.split(".experts.")[1].split(".")[0]) for n, _ in asked if ".experts." in n
                  and n.split(".experts.")[1].split(".")[0].isdigit()]
    assert per_expert and set(per_expert) <= {2, 3, 4, 5}
    fused = [rows for n, rows in asked if n.endswith(("gate_up_proj", "down_proj"))]
    assert all(r == range(2, 6) for r in fused) and (len(fused) > 0) == (naming == "hf")
    with pytest.raises(ValueError, match="contiguous range"):
        read_state_dict(str(tmp_path), tiny, experts=range(6, 10))


def test_fp8_write_read(tiny, tiny_sd, tmp_path):
    write_checkpoint(str(tmp_path), tiny, tiny_sd, quantize="fp8")
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes["layers.1.attn.wq_b.weight"] == "F8_E4M3" and dtypes["layers.1.attn.wq_b.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.indexer.wq_b.weight"] == "F8_E4M3" and dtypes["mtp.0.e_proj.weight"] == "F8_E4M3"
    assert dtypes["layers.0.ffn.shared_experts.w2.weight"] == "F8_E4M3"
    assert dtypes["layers.0.ffn.experts.3.w2.weight"] == "I8" and dtypes["layers.0.ffn.experts.3.w2.scale"] == "F8_E8M0"
    assert dtypes["layers.1.attn.compressor.wkv.weight"] == "F32" and dtypes["embed.weight"] == "F32"
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]

    sd, _ = read_state_dict(str(tmp_path), tiny)
    assert sorted(sd) == sorted(tiny_sd)
    w = tiny_sd["layers.1.attn.wq_b.weight"]
    assert torch.equal(sd["layers.1.attn.wq_b.weight"], dequant_fp8_block(*quant_fp8_block(w), torch.float32))
    assert not torch.equal(sd["layers.1.attn.wq_b.weight"], w)
    w2 = tiny_sd["layers.0.ffn.experts.w2"]
    for e in range(tiny.n_routed_experts):
        assert torch.equal(sd["layers.0.ffn.experts.w2"][e], dequant_fp4(*quant_fp4(w2[e]), torch.float32))
    for name in ("embed.weight", "layers.1.attn.compressor.wgate.weight", "layers.1.hc_attn_fn",
                 "layers.0.ffn.gate.tid2eid"):
        assert torch.equal(sd[name], tiny_sd[name])


def test_fp8_with_float_weight_scale_inv(tiny, tiny_sd, tmp_path):
    write_checkpoint(str(tmp_path), tiny, tiny_sd, quantize="fp8")
    reference, _ = read_state_dict(str(tmp_path), tiny)
    raw = load_file(tmp_path / "model.safetensors")
    fp8_scales = [k for k in raw if k.endswith(".scale") and raw[k[:-6] + ".weight"].dtype == torch.float8_e4m3fn]
    for k in fp8_scales:  # the other FP8 convention: float32 scales named X.weight_scale_inv
        raw[k[:-6] + ".weight_scale_inv"] = e8m0_to_float(raw.pop(k))
    save_file(raw, tmp_path / "model.safetensors")
    sd, _ = read_state_dict(str(tmp_path), tiny)
    assert_same(sd, reference)


def test_sharded_checkpoint(tiny, tiny_sd, tmp_path):
    write_checkpoint(str(tmp_path), tiny, tiny_sd)
    raw = load_file(tmp_path / "model.safetensors")
    os.remove(tmp_path / "model.safetensors")
    names = sorted(raw)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: raw[k] for k in keys}, tmp_path / file)
        weight_map.update({k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sd, _ = read_state_dict(str(tmp_path), tiny)
    assert_same(sd, tiny_sd)


def _rewrite(path, edit):
    raw = load_file(path / "model.safetensors")
    edit(raw)
    save_file(raw, path / "model.safetensors")


@pytest.mark.parametrize("edit, pattern", [
    (lambda r: r.__setitem__("layers.1.attn.wq_a.weight", torch.zeros(33, 64)),
     r"layers\.1\.attn\.wq_a\.weight.*\[33, 64\].*\[32, 64\]"),
    (lambda r: r.pop("layers.2.attn.compressor.ape"), r"missing tensor 'layers\.2\.attn\.compressor\.ape'"),
    (lambda r: r.__setitem__("layers.0.attn.bogus", torch.zeros(3)), r"unexpected tensor 'layers\.0\.attn\.bogus'"),
    (lambda r: r.pop("layers.3.ffn.experts.5.w3.weight"), r"layers\.3\.ffn\.experts\.5\.w3\.weight"),
    (lambda r: r.__setitem__("layers.0.ffn.experts.8.w1.weight", torch.zeros(32, 64)),
     r"unexpected tensor 'layers\.0\.ffn\.experts\.8\.w1\.weight'"),
    (lambda r: r.__setitem__("layers.0.ffn.gate.tid2eid", torch.full((256, 2), 9, dtype=torch.int32)),
     r"layers\.0\.ffn\.gate\.tid2eid.*expert ids"),
])
def test_mismatch_errors_name_the_tensor(tiny, tiny_sd, tmp_path, edit, pattern):
    write_checkpoint(str(tmp_path), tiny, tiny_sd)
    _rewrite(tmp_path, edit)
    with pytest.raises(CheckpointError, match=pattern):
        read_state_dict(str(tmp_path), tiny)
    assert issubclass(CheckpointError, ValueError)


def test_mis_shaped_stacked_experts_name_file_keys(tiny, tiny_sd, tmp_path):
    write_checkpoint(str(tmp_path), tiny, tiny_sd)
    _rewrite(tmp_path, lambda r: r.update({f"layers.1.ffn.experts.{e}.w2.weight": torch.zeros(64, 31)
                                           for e in range(8)}))
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.experts\.\{e\}\.w2\.weight.*\[8, 64, 31\]"):
        read_state_dict(str(tmp_path), tiny)


def test_pickle_only_directory_refused(tiny, tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not a real pickle")
    (tmp_path / "config.json").write_text(json.dumps(tiny.to_official_dict()))
    with pytest.raises(CheckpointError, match="safetensors is required"):
        read_state_dict(str(tmp_path), tiny)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        read_state_dict(str(tmp_path / "empty"), tiny)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_state_dict(str(tmp_path / "missing"), tiny)


def test_mtp_optional(tiny, tiny_sd, tmp_path):
    main_only = {k: v for k, v in tiny_sd.items() if not k.startswith("mtp.")}
    write_checkpoint(str(tmp_path), tiny, main_only)
    sd, has_mtp = read_state_dict(str(tmp_path), tiny)
    assert not has_mtp
    assert_same(sd, main_only)
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.0\.e_proj\.weight'"):
        read_state_dict(str(tmp_path), tiny, with_mtp=True)


def test_mtp_partial_and_skipped(tiny, tiny_sd, tmp_path):
    write_checkpoint(str(tmp_path), tiny, tiny_sd)
    sd, has_mtp = read_state_dict(str(tmp_path), tiny, with_mtp=False)
    assert not has_mtp and not any(k.startswith("mtp.") for k in sd)
    with pytest.raises(CheckpointError, match="pass with_mtp=False"):
        read_state_dict(str(tmp_path), tiny.replace(num_mtp_layers=0))
    _rewrite(tmp_path, lambda r: (r.pop("mtp.0.h_proj.weight"), r.pop("mtp.0.hc_head_fn")))
    with pytest.raises(CheckpointError, match=r"mtp\.0\.h_proj\.weight.*|mtp\.0\.hc_head_fn") as err:
        read_state_dict(str(tmp_path), tiny)
    assert "mtp.0.h_proj.weight" in str(err.value) and "mtp.0.hc_head_fn" in str(err.value)


def test_write_validates_and_rejects_hf_quantize(tiny, tiny_sd, tmp_path):
    bad = dict(tiny_sd)
    bad["layers.0.attn.wkv.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wkv\.weight"):
        write_checkpoint(str(tmp_path), tiny, bad)
    with pytest.raises(ValueError, match="deepseek"):
        write_checkpoint(str(tmp_path), tiny, tiny_sd, naming="hf", quantize="fp8")


# ================================================================================================
# init_random.py
# ================================================================================================
def test_init_random_deterministic(tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    init_random_checkpoint("tiny", str(a), seed=3)
    init_random_checkpoint(get_preset("tiny"), str(b), seed=3)
    init_random_checkpoint("tiny", str(c), seed=4)
    data = (a / "model.safetensors").read_bytes()
    assert data == (b / "model.safetensors").read_bytes()
    assert data != (c / "model.safetensors").read_bytes()
    assert load_config(str(a)) == get_preset("tiny")


def test_random_state_dict_values(tiny):
    sd = random_state_dict(tiny, seed=0, dtype=torch.bfloat16)
    assert {k: tuple(v.shape) for k, v in sd.items()} == checkpoint_schema(tiny)
    for name, t in sd.items():
        assert torch.count_nonzero(t) > 0, f"{name} is all zeros"
        want = torch.int64 if name.endswith("tid2eid") else torch.float32 if is_fp32_tensor(name) else torch.bfloat16
        assert t.dtype == want, name
    tid = sd["layers.0.ffn.gate.tid2eid"]  # [V, k]: k distinct experts per token, all experts used
    assert torch.all(tid[:, 0] != tid[:, 1]) and set(tid.unique().tolist()) == set(range(8))
    norm = sd["layers.2.attn.kv_norm.weight"].float()
    assert abs(norm.mean() - 1) < 0.1 and 0.03 < norm.std() < 0.3
    wq_b = sd["layers.1.attn.wq_b.weight"].float()  # [H*D, q]: std 1/sqrt(q)
    assert abs(wq_b.std() * math.sqrt(32) - 1) < 0.1
    assert abs(sd["layers.1.attn.attn_sink"].std() - 0.5) < 0.3
    assert abs(sd["layers.1.hc_attn_scale"].mean() - 0.5) < 0.2
    assert sd["layers.1.hc_attn_fn"].abs().max() < 0.2
    # activations stay O(1): a unit-variance input through a stacked expert weight
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    y = x @ sd["layers.1.ffn.experts.w1"][0].float().T
    assert 0.5 < y.std() < 2.0
    assert_same(random_state_dict(tiny, seed=0, dtype=torch.bfloat16), sd)
