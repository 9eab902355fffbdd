"""The FP8-shipped linears kept as FP8 (``linear_format: fp8``) against the dequantised twin.

A DeepSeek-layout checkpoint's linears are FP8 already, so the FP8 model must compute exactly what the
dequantised one computes (the quantisation at load is the inverse of the decode at read); random presets are
rounded to FP8 and then equal a dequantised model of the rounded weights. The Triton kernel's twin tests are
in test_kernel_fp8_linear_cuda.py."""

import pytest
import torch
from torch import nn

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.init_random import random_state_dict
from dsv4.checkpoint.io import write_checkpoint
from dsv4.checkpoint.names import is_fp8_linear
from dsv4.config import get_preset
from dsv4.engine.config import EngineConfigError
from dsv4.kernels.fp8_linear import dequantize, fp8_linear_torch, grouped_fp8_linear_torch
from dsv4.model.fused import FusedLinears
from dsv4.model.linear_weights import quantize_linear
from dsv4.model.loader import load_model, load_state
from dsv4.model.rows import Linear, fixed_rows, grouped_linear, linear

from .fp8_twin import round_fp8_linears

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, [9, 8, 7] * 5, [200]]
SP = SamplingParams(max_tokens=10, ignore_eos=True)


def _greedy(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)]


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """tiny written as DeepSeek ships it: FP8 block-128 linears (e8m0 scales), FP4 routed experts."""
    cfg = get_preset("tiny")
    path = tmp_path_factory.mktemp("tiny-fp8")
    write_checkpoint(str(path), cfg, random_state_dict(cfg, seed=5), quantize="fp8")
    return str(path)


def _fp8_linear(out: int, inp: int, g: torch.Generator) -> Linear:
    m = Linear(inp, out, bias=False)
    q = quantize_linear("layers.0.attn.wq_a.weight", torch.randn(out, inp, generator=g))
    m.use_fp8()
    m.load_state_dict({"weight": q["layers.0.attn.wq_a.weight"], "scale": q["layers.0.attn.wq_a.scale"]})
    return m


def test_the_quantisation_at_load_is_the_inverse_of_the_decode_at_read(fp8_checkpoint):
    """Every FP8-shipped linear comes back as e4m3 values and float32 scales whose product is exactly the
    dequantised load's weight (so nothing is rounded twice); the other tensors are the dequantised load's."""
    _, dq, _ = load_state(fp8_checkpoint)
    _, f8, _ = load_state(fp8_checkpoint, linear_format="fp8")
    fp8_names = [k for k in dq if is_fp8_linear(k)]
    assert len(fp8_names) >= 4 * 5 and any(k.startswith("mtp.") for k in fp8_names)
    for k, v in dq.items():
        if k in fp8_names:
            assert f8[k].dtype == torch.float8_e4m3fn and f8[k[:-7] + ".scale"].dtype == torch.float32
            assert torch.equal(dequantize(f8[k], f8[k[:-7] + ".scale"], v.dtype), v), k
        else:
            assert torch.equal(f8[k], v), k
    assert set(f8) == set(dq) | {k[:-7] + ".scale" for k in fp8_names}


def test_a_fp8_checkpoint_gives_the_same_logits_and_tokens_fp8_or_dequantised(fp8_checkpoint):
    dq = load_model(fp8_checkpoint)
    f8 = load_model(fp8_checkpoint, linear_format="fp8")
    wq_a = f8.layers[0].attn.wq_a
    assert wq_a.fp8 and wq_a.weight.dtype == torch.float8_e4m3fn
    assert not f8.head.fp8 and not f8.layers[1].attn.compressor.wkv.fp8  # bf16 in the checkpoint: unchanged
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(f8(ids), dq(ids))
    assert torch.equal(f8.mtp_logits(ids), dq.mtp_logits(ids))
    a = LLM(fp8_checkpoint, warmup=False, speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    b = LLM(fp8_checkpoint, warmup=False, linear_format="fp8",
            speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    assert _greedy(a) == _greedy(b)


def test_a_preset_in_fp8_equals_its_rounded_dequantised_twin():
    """Random weights are rounded to FP8: the FP8 engine equals an engine whose linears are the rounded weights
    decoded (and differs from the unrounded one, so the comparison can fail)."""
    b = LLM("tiny", warmup=False, linear_format="fp8")
    a = LLM("tiny", warmup=False)
    assert round_fp8_linears(a.model) == sum(1 for m in b.model.modules() if isinstance(m, Linear) and m.fp8)
    out = _greedy(b)
    assert out == _greedy(a)
    assert out != _greedy(LLM("tiny", warmup=False))


@pytest.mark.parametrize("sizes", [(256, 128, 64), (96, 64, 128)])
def test_fused_fp8_and_plain_linears_equal_the_modules_one_by_one(sizes):
    """FusedLinears splits its modules by format: the FP8 ones share a GEMM when their rows fill whole scale
    blocks (the first case), each keeps its own otherwise (the second: 96 rows end inside a block)."""
    g = torch.Generator().manual_seed(0)
    named = [(f"f{i}", _fp8_linear(n, 256, g)) for i, n in enumerate(sizes)]
    plain = nn.Linear(256, 40, bias=False)
    nn.init.normal_(plain.weight, generator=g)
    named.insert(1, ("p", plain))
    x = torch.randn(5, 256, generator=g)
    want = {n: m(x) for n, m in named}
    fused = FusedLinears(named)
    assert len(fused.groups) == (2 if sizes[0] % 128 == 0 else 1 + len(sizes))
    got = fused(x)
    assert set(got) == set(want)
    for n in want:
        assert torch.allclose(got[n], want[n], atol=1e-5, rtol=1e-5), n
        assert torch.allclose(dict(named)[n](x), want[n], atol=1e-5, rtol=1e-5), n  # modules now views: same


def test_fp8_products_follow_fixed_rows_and_groups():
    """``linear`` and ``grouped_linear`` with scales equal the dequantised weight's product, also in fixed-row
    chunks; a grouped weight's scales run over [g * out, in] (a block may span two groups)."""
    g = torch.Generator().manual_seed(1)
    m = _fp8_linear(192, 300, g)
    x = torch.randn(7, 300, generator=g)
    ref = x @ m.dense_weight(torch.float32).T
    assert torch.allclose(fp8_linear_torch(x, m.weight, m.scale), ref, atol=1e-5)
    with fixed_rows(4):
        assert torch.allclose(linear(x, m.weight, m.scale), ref, atol=1e-5)
    w3 = m.weight.view(3, 64, 300)  # 3 groups of 64 rows: the second group's rows straddle block rows 0 and 1
    xg = torch.randn(7, 3, 300, generator=g)
    dense = m.dense_weight(torch.float32).view(3, 64, 300)
    ref = torch.einsum("ngi,goi->ngo", xg, dense)
    assert torch.allclose(grouped_fp8_linear_torch(xg, w3, m.scale), ref, atol=1e-5)
    with fixed_rows(4):
        assert torch.allclose(grouped_linear(xg, w3, m.scale), ref, atol=1e-5)
    wrong = m.scale.clone()
    wrong[1] *= 2
    assert not torch.allclose(grouped_fp8_linear_torch(xg, w3, wrong), ref, atol=1e-3)


def test_the_row_kernel_takes_few_row_products_of_whole_words_and_chunks():
    """Which products ``_fp8_row_kernel`` takes (its twin tests run on CUDA): 1 to ROW_MAX_ROWS (4) rows (a decode
    step of one request, its MTP verify step at k <= 3), K in whole 512-input chunks,
    groups of whole 128-row blocks, a weight whose rows start on a 32-bit word (a fused weight's slice may not)."""
    from dsv4.kernels.fp8_linear import row_kernel_fits

    w = torch.zeros(8 * 1024 + 1, 4096, dtype=torch.float8_e4m3fn)
    assert row_kernel_fits(1, 1, 1536, 4096, w[:1536])  # wq_a + wkv
    assert row_kernel_fits(1, 8, 1024, 4096, w[:8192].view(8, 1024, 4096))  # wo_a, grouped
    assert row_kernel_fits(2, 1, 1536, 4096, w[:1536])  # MTP k = 1's verify at concurrency 1
    assert row_kernel_fits(4, 8, 1024, 4096, w[:8192].view(8, 1024, 4096))
    assert not row_kernel_fits(5, 1, 1536, 4096, w[:1536])  # five rows: the tensor-core kernel
    assert not row_kernel_fits(0, 1, 1536, 4096, w[:1536])
    assert not row_kernel_fits(1, 3, 64, 4096, w[:192].view(3, 64, 4096))  # a group inside a block row
    assert not row_kernel_fits(1, 1, 100, 1000, torch.zeros(100, 1000, dtype=torch.float8_e4m3fn))  # K = 1000
    odd = torch.zeros(100 * 4096 + 1, dtype=torch.float8_e4m3fn)[1:].view(100, 4096)  # starts mid-word
    assert not row_kernel_fits(1, 1, 100, 4096, odd)


def test_the_bf16_row_kernel_chunks_any_width_of_whole_32s():
    """``bf16_gemv.block_k``: Flash's widths in chunks of 512 inputs, a small model's (mini: 256, 128, 96) in the
    largest power of two that divides them, from 32 up; other widths stay on cuBLAS."""
    from dsv4.kernels.bf16_gemv import block_k

    assert [block_k(k) for k in (4096, 7168, 8192, 256, 128, 96, 384, 32)] == [512, 512, 512, 256, 128, 32, 128, 32]
    assert block_k(1000) is None and block_k(48) is None and block_k(16) is None


def test_bad_linear_formats_are_refused_before_loading():
    with pytest.raises(EngineConfigError, match="linear_format 'fp4': use dequantized or fp8"):
        LLM("tiny", warmup=False, linear_format="fp4")
    with pytest.raises(ValueError, match="linear_format 'int8'"):
        load_model("tiny", linear_format="int8")


@pytest.mark.parametrize("split", [{"tensor_parallel_size": 2, "moe_expert_parallel_size": 2},
                                   {"tensor_parallel_size": 2, "moe_expert_parallel_size": 2,
                                    "enable_attention_dp": True}])
def test_fp8_on_two_ranks_equals_one(fp8_checkpoint, split):
    """FP8 linears split across two ranks (gloo) with their block scales: attention TP 2 halves wq_b, wo_a and
    wo_b, each share inside one of tiny's scale blocks; attention DP keeps them whole. In float64, as the
    multi-device matrix, so the ranks' partial sums cannot tip a greedy choice."""
    kw = dict(warmup=False, dtype="fp64", linear_format="fp8")
    one = _greedy(LLM(fp8_checkpoint, **kw))
    with LLM(fp8_checkpoint, **split, **kw) as llm:
        attn = llm.model.layers[0].attn
        assert attn.wq_b.fp8 and attn.wo_a.fp8 and attn.wo_b.fp8
        heads = 4 if split.get("enable_attention_dp") else 2  # tiny: 4 heads of 32
        assert attn.wq_b.weight.shape[0] == heads * 32 and attn.wq_b.scale.shape == (1, 1)
        assert _greedy(llm) == one


def test_fp8_shares_that_cut_a_scale_block_are_refused():
    """A share of rows starting inside a 128-block and reaching past it would need two blocks' scales: refused
    before any rank starts, naming the linear; shares on block boundaries or inside one block take theirs."""
    import dataclasses

    from dsv4.parallel.mapping import ParallelMapping
    from dsv4.parallel.shard import check_fp8_shards, fp8_share

    assert fp8_share(slice(256, 512)) == slice(2, 4) and fp8_share(slice(64, 128)) == slice(0, 1)
    assert fp8_share(slice(128, 200)) == slice(1, 2)
    with pytest.raises(ValueError, match=r"wq_b's share \[192, 384\) of a rank cuts a 128-wide scale block"):
        fp8_share(slice(192, 384), "wq_b")
    cfg = get_preset("tiny")
    m = ParallelMapping(world_size=2, tp=2)
    check_fp8_shards(cfg, m)  # tiny: every share inside one block
    with pytest.raises(ValueError, match="wq_b's share"):
        check_fp8_shards(dataclasses.replace(cfg, head_dim=96), m)
