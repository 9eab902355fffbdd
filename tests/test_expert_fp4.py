"""Routed experts kept as packed FP4 (``moe_config.expert_format: fp4``) against the dequantised twin.

A DeepSeek-layout checkpoint's experts are FP4 already, so the packed model must compute exactly what the
dequantised one computes (the packing is the inverse of the decode at read); random presets are rounded to FP4
and then equal a dequantised model of the rounded weights. The Triton kernel's twin test is in
test_kernel_fp4_cuda.py."""

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.init_random import random_state_dict
from dsv4.checkpoint.io import write_checkpoint
from dsv4.checkpoint.quant import dequant_fp4, pack_fp4_stacked, quant_fp4
from dsv4.kernels.fp4 import unpack_fp4
from dsv4.config import get_preset
from dsv4.engine.config import EngineConfigError
from dsv4.kernels import moe
from dsv4.model.expert_weights import pack_experts
from dsv4.model.loader import load_model
from dsv4.model.moe import Experts

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, [9, 8, 7] * 5, [200]]
SP = SamplingParams(max_tokens=10, ignore_eos=True)


def _greedy(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP)]


@pytest.fixture(scope="module")
def fp4_checkpoint(tmp_path_factory):
    """tiny written as DeepSeek ships it: FP8 block-128 linears, FP4 routed experts."""
    cfg = get_preset("tiny")
    path = tmp_path_factory.mktemp("tiny-fp4")
    write_checkpoint(str(path), cfg, random_state_dict(cfg, seed=3), quantize="fp8")
    return str(path)


def test_packing_is_the_inverse_of_the_decode():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 40, 96, generator=g) * 0.02
    w[1, 5, :32] = 0  # an all-zero scale block
    packed, scale = pack_fp4_stacked(w)
    assert packed.dtype == scale.dtype == torch.uint8
    assert packed.shape == (3, 40, 48) and scale.shape == (3, 40, 3)
    d = unpack_fp4(packed, scale, torch.float32)
    for e in range(3):  # the same values as the checkpoint format's own encode and decode, row by row
        assert torch.equal(d[e], dequant_fp4(*quant_fp4(w[e]), torch.float32))
    again = pack_fp4_stacked(d)  # FP4 values pack back to themselves: loading a checkpoint's experts is lossless
    assert torch.equal(unpack_fp4(*again, torch.float32), d)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_fp4_stacked(torch.zeros(1, 4, 48))


def test_experts_module_and_grouped_twin_equal_the_dequantised_experts():
    """The CPU loop and the grouped GEMM's torch twin on packed weights == both on the decoded weights."""
    cfg = get_preset("tiny")
    g = torch.Generator().manual_seed(1)
    dense, packed = Experts(cfg), Experts(cfg)
    sd = {n: torch.randn(getattr(dense, n).shape, generator=g) * 0.1 for n in ("w1", "w2", "w3")}
    psd = pack_experts({f"x.ffn.experts.{n}": t for n, t in sd.items()})
    packed.use_fp4()
    packed.load_state_dict({k.split(".")[-1]: v for k, v in psd.items()})
    dense.load_state_dict({n: unpack_fp4(psd[f"x.ffn.experts.{n}"], psd[f"x.ffn.experts.{n}_scale"],
                                                 torch.float32) for n in sd})
    assert set(packed.state_dict()) == {"w1", "w2", "w3", "w1_scale", "w2_scale", "w3_scale"}
    x = torch.randn(7, cfg.hidden_size, generator=g)
    ids = torch.rand(7, cfg.n_routed_experts, generator=g).topk(cfg.n_experts_per_tok, dim=1).indices
    w = torch.rand(7, cfg.n_experts_per_tok, generator=g)
    ref = dense(x, w, ids)
    assert torch.equal(packed(x, w, ids), ref)
    grouped = moe.grouped_experts(x, w, ids, packed.w1, packed.w2, packed.w3, packed.limit, scales=packed.scales())
    assert torch.allclose(grouped, ref, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(grouped, moe.grouped_experts(x, w, ids, packed.w1, packed.w2, packed.w3,
                                                           packed.limit, scales=packed.scales()[::-1]))


def test_a_fp4_checkpoint_gives_the_same_logits_and_tokens_packed_or_dequantised(fp4_checkpoint):
    dq = load_model(fp4_checkpoint)
    p4 = load_model(fp4_checkpoint, expert_format="fp4")
    ex = p4.layers[0].ffn.experts
    assert ex.fp4 and ex.w1.dtype == torch.uint8
    nbytes = lambda m: sum(t.numel() * t.element_size() for t in m.state_dict().values())  # noqa: E731
    # fp32 here: 4 bytes per weight dequantised, 1/2 + 1/32 packed
    assert nbytes(ex) * 4 / (0.5 + 1 / 32) == nbytes(dq.layers[0].ffn.experts)
    ids = torch.tensor([PROMPTS[0]])
    assert torch.equal(p4(ids), dq(ids))
    a = LLM(fp4_checkpoint, warmup=False)
    b = LLM(fp4_checkpoint, warmup=False, moe_config={"expert_format": "fp4"})
    assert _greedy(a) == _greedy(b)


def test_loading_notes_whether_the_scales_allow_the_one_product_decode(fp4_checkpoint):
    """A model's packed experts know after loading whether every scale byte is at most FOLD_MAX_SCALE (the
    tensor-core GEMM's one-product decode); one byte past it turns that off; dequantised experts never fold."""
    from dsv4.kernels.fp4_gemv import FOLD_MAX_SCALE, fold_scales

    p4 = load_model(fp4_checkpoint, expert_format="fp4")
    experts = [blk.ffn.experts for blk in list(p4.layers) + list(p4.mtp)]
    assert all(ex.fold == fold_scales(*ex.scales()) for ex in experts)
    assert all(ex.fold for ex in experts)  # random weights: scale bytes near 2**-4, far below 2**1
    ex = experts[0]
    ex.w2_scale[1, 2, 0] = FOLD_MAX_SCALE
    ex.note_scales()
    assert ex.fold
    ex.w2_scale[1, 2, 0] = FOLD_MAX_SCALE + 1
    ex.note_scales()
    assert not ex.fold
    assert not any(blk.ffn.experts.fold for blk in load_model(fp4_checkpoint).layers)


def test_a_checkpoint_s_fp4_experts_are_read_as_stored(fp4_checkpoint, monkeypatch):
    """No decode and re-encode: the stacked bytes are the file's bytes, for every expert and for an
    expert-parallel share, and nothing is quantised on the way."""
    import os

    from safetensors import safe_open

    import dsv4.checkpoint.quant as quant
    from dsv4.model.loader import load_state

    monkeypatch.setattr(quant, "quant_fp4", lambda *a: pytest.fail("an FP4 expert was re-encoded"))
    with safe_open(os.path.join(fp4_checkpoint, "model.safetensors"), "pt") as f:
        file = {k: f.get_tensor(k) for k in f.keys() if ".ffn.experts." in k}
    for experts in (None, range(4, 8)):
        _, sd, _ = load_state(fp4_checkpoint, expert_format="fp4", experts=experts)
        first = 0 if experts is None else experts.start
        w2, s2 = sd["layers.2.ffn.experts.w2"], sd["layers.2.ffn.experts.w2_scale"]
        assert w2.dtype == s2.dtype == torch.uint8 and w2.shape[0] == (8 if experts is None else 4)
        for i in range(w2.shape[0]):
            assert torch.equal(w2[i], file[f"layers.2.ffn.experts.{first + i}.w2.weight"].view(torch.uint8))
            assert torch.equal(s2[i], file[f"layers.2.ffn.experts.{first + i}.w2.scale"].view(torch.uint8))


def test_a_preset_in_fp4_equals_its_rounded_dequantised_twin():
    """Random bf16-style weights are rounded to FP4: the packed engine equals an engine whose experts are the
    rounded weights decoded (and differs from the unrounded one, so the comparison can fail)."""
    b = LLM("tiny", warmup=False, moe_config={"expert_format": "fp4"})
    a = LLM("tiny", warmup=False)
    for blk in list(a.model.layers) + list(a.model.mtp):
        ex = blk.ffn.experts
        for n in ("w1", "w2", "w3"):
            getattr(ex, n).copy_(unpack_fp4(*pack_fp4_stacked(getattr(ex, n)), torch.float32))
    out = _greedy(b)
    assert out == _greedy(a)
    assert out != _greedy(LLM("tiny", warmup=False))


def test_fp4_on_two_ranks_equals_one(fp4_checkpoint):
    """Attention TP 2 with expert parallelism 2 (gloo): each rank holds half the packed experts. In float64,
    as the multi-device matrix, so the ranks' partial sums cannot tip a greedy choice."""
    kw = dict(warmup=False, dtype="fp64", moe_config={"expert_format": "fp4"})
    one = _greedy(LLM(fp4_checkpoint, **kw))
    with LLM(fp4_checkpoint, tensor_parallel_size=2, moe_expert_parallel_size=2, **kw) as llm:
        assert _greedy(llm) == one


def test_bad_expert_formats_are_refused_before_loading():
    with pytest.raises(EngineConfigError, match="expert_format 'fp5': use dequantized or fp4"):
        LLM("tiny", warmup=False, moe_config={"expert_format": "fp5"})
    # tiny's moe_inter_dim 32 split over 2 ranks leaves 16 inputs per row: less than one scale block
    with pytest.raises(EngineConfigError, match=r"moe_inter_dim / moe_tp \(2\) to be a multiple of 32 \(got 16\)"):
        LLM("tiny", warmup=False, tensor_parallel_size=2, moe_config={"expert_format": "fp4"})
    with pytest.raises(ValueError, match="expert_format 'int4'"):
        load_model("tiny", expert_format="int4")


def test_big_steps_take_row_blocks_of_64_unless_batch_invariant(monkeypatch):
    """The grouped MoE's twin with row blocks of 64 (a prefill-sized step) and of 128 equals the one with
    blocks of 16 and the Experts loop; under batch invariance the block size never follows the step's size."""
    from dsv4.kernels import moe
    from dsv4.kernels.moe import BLOCK_M, LARGE_BLOCK_M, PREFILL_BLOCK_M, block_m_for, grouped_experts

    E, k, I, d, N = 4, 2, 64, 96, 140
    assert block_m_for(N * k, E) == PREFILL_BLOCK_M and block_m_for(N * k, E, invariant=True) == BLOCK_M
    assert block_m_for(N * k - 100, E) == BLOCK_M
    assert block_m_for(4 * 128 * E, E, large=True) == LARGE_BLOCK_M  # 16-bit activations, unpacked weights
    assert block_m_for(4 * 128 * E - 1, E, large=True) == block_m_for(4 * 128 * E, E) == PREFILL_BLOCK_M
    assert block_m_for(4 * 128 * E, E, invariant=True, large=True) == BLOCK_M
    g = torch.Generator().manual_seed(3)
    w1, w3 = (torch.randn(E, I, d, generator=g, dtype=torch.float64) / d ** 0.5 for _ in range(2))
    w2 = torch.randn(E, d, I, generator=g, dtype=torch.float64) / I ** 0.5
    x = torch.randn(N, d, generator=g, dtype=torch.float64)
    ids = torch.rand(N, E, generator=g).topk(k, dim=1).indices
    w = torch.rand(N, k, generator=g, dtype=torch.float64)
    big = grouped_experts(x, w, ids, w1, w2, w3, 10.0)
    small = grouped_experts(x, w, ids, w1, w2, w3, 10.0, invariant=True)
    assert torch.equal(big, small)
    monkeypatch.setattr(moe, "block_m_for", lambda *a, **kw: LARGE_BLOCK_M)
    assert torch.equal(grouped_experts(x, w, ids, w1, w2, w3, 10.0), small)  # row blocks of 128
    h = torch.nn.functional.silu((torch.einsum("nd,nkid->nki", x, w1[ids])).clamp(max=10))
    h = h * torch.einsum("nd,nkid->nki", x, w3[ids]).clamp(-10, 10)
    ref = torch.einsum("nk,nki,nkdi->nd", w, h, w2[ids])
    assert torch.allclose(big, ref.float(), rtol=1e-5, atol=1e-6)  # (the output is fp32, as Experts.forward)


@pytest.mark.parametrize("N, k, E, bm", [(1, 6, 128, 16), (3, 6, 128, 16), (32, 6, 128, 16), (7, 2, 4, 16),
                                         (300, 6, 16, 64), (5, 8, 256, 128)])
def test_only_the_first_active_blocks_hold_pairs(N, k, E, bm):
    """The grids stop at ``active_blocks``: every pair's row lies in the first min(m_pad / bm, pairs) row blocks
    and every later block is padding (-1), with other ranks' pairs (``keep``) laid out as one more expert too;
    each pair's routing weight sits at its row (0 on padding rows); the grouped MoE's twin cut there equals the
    einsum of the experts."""
    from dsv4.kernels.moe import active_blocks, align_torch, grouped_experts

    g = torch.Generator().manual_seed(N * E + k)
    ids = torch.rand(N, E, generator=g).topk(k, dim=1).indices
    keep = torch.rand(N, k, generator=g) < 0.5
    for experts, layout in ((E, ids), (E + 1, torch.where(keep, ids, E))):
        w = torch.rand(N, k, generator=g)
        rows, pair_pos, block_expert, row_weight = align_torch(layout, experts, bm, w)
        assert torch.equal(row_weight[pair_pos], w.flatten()) and (row_weight[rows < 0] == 0).all()
        n = active_blocks(rows.shape[0], bm, N * k)
        assert (block_expert[n:] == -1).all() and (rows[n * bm:] == -1).all() and (pair_pos < n * bm).all()
    if E > 64 and N > 3:
        return
    I, d = 32, 48
    w1, w3 = (torch.randn(E, I, d, generator=g, dtype=torch.float64) / d ** 0.5 for _ in range(2))
    w2 = torch.randn(E, d, I, generator=g, dtype=torch.float64) / I ** 0.5
    x = torch.randn(N, d, generator=g, dtype=torch.float64)
    w = torch.rand(N, k, generator=g, dtype=torch.float64)
    h = torch.nn.functional.silu((torch.einsum("nd,nkid->nki", x, w1[ids])).clamp(max=10))
    h = h * torch.einsum("nd,nkid->nki", x, w3[ids]).clamp(-10, 10)
    ref = torch.einsum("nk,nki,nkdi->nd", w, h, w2[ids])
    assert torch.allclose(grouped_experts(x, w, ids, w1, w2, w3, 10.0), ref.float(), rtol=1e-5, atol=1e-6)
    ref_keep = torch.einsum("nk,nki,nkdi->nd", w * keep, h, w2[ids])
    assert torch.allclose(grouped_experts(x, w, ids, w1, w2, w3, 10.0, keep=keep), ref_keep.float(), rtol=1e-5,
                          atol=1e-6)


@pytest.mark.parametrize("keep_some", [False, True])
def test_prefill_experts_on_the_library_grouped_mm_equal_the_triton_layouts_twin(monkeypatch, keep_some):
    """The prefill path on torch._grouped_mm (rows gathered into segments of 16, the segment ends counted on
    the device from the block table) gives the grouped twin's output (row blocks of 64) to bf16 rounding, with
    other ranks' pairs (``keep``) too. On CPU torch runs its own fallback of the same op; the GPU's CUTLASS
    kernel meets this twin in tests/test_kernels_cuda.py."""
    from dsv4.kernels import moe

    E, k, I, d, N = 8, 3, 64, 128, 200
    g = torch.Generator().manual_seed(11)
    w1, w3 = (torch.randn(E, I, d, generator=g).bfloat16() / d ** 0.5 for _ in range(2))
    w2 = torch.randn(E, d, I, generator=g).bfloat16() / I ** 0.5
    x = torch.randn(N, d, generator=g).bfloat16()
    ids = torch.rand(N, E, generator=g).topk(k, dim=1).indices
    w = torch.rand(N, k, generator=g)
    keep = (torch.rand(N, k, generator=g) < 0.6) if keep_some else None
    assert moe.block_m_for(N * k, E) == moe.PREFILL_BLOCK_M
    twin = moe.grouped_experts(x, w, ids, w1, w2, w3, 10.0, keep=keep)
    assert moe.GROUPED_MM and not moe.use_grouped_mm(x, N * k, E, False, False)  # on, but never off the GPU
    taken = []
    monkeypatch.setattr(moe, "use_grouped_mm",
                        lambda *a: taken.append(a) or moe.block_m_for(*a[1:3]) > moe.BLOCK_M)
    lib = moe.grouped_experts(x, w, ids, w1, w2, w3, 10.0, keep=keep)
    assert taken and lib.dtype == twin.dtype == torch.float32
    assert torch.allclose(lib, twin, rtol=2e-2, atol=2e-2 * twin.abs().max().item())
    gate = torch.nn.functional.silu(torch.einsum("nd,nkid->nki", x.double(), w1[ids].double()).clamp(max=10))
    up = torch.einsum("nd,nkid->nki", x.double(), w3[ids].double()).clamp(-10, 10)
    ref = torch.einsum("nk,nki,nkdi->nd", w.double() * (keep if keep is not None else 1), gate * up, w2[ids].double())
    assert (lib.double() - ref).abs().max() < 3e-2 * ref.abs().max()


def test_experts_take_the_shared_output_or_a_function_giving_it():
    """``add`` as a function (MoE.forward's join of the shared expert's side stream) is called once, just before
    the addition, and gives the bits of the tensor itself: the CPU loop and the grouped twin."""
    cfg = get_preset("tiny")
    g = torch.Generator().manual_seed(2)
    ex = Experts(cfg)
    ex.load_state_dict({n: torch.randn(getattr(ex, n).shape, generator=g) * 0.1 for n in ("w1", "w2", "w3")})
    x = torch.randn(5, cfg.hidden_size, generator=g)
    ids = torch.rand(5, cfg.n_routed_experts, generator=g).topk(cfg.n_experts_per_tok, dim=1).indices
    w = torch.rand(5, cfg.n_experts_per_tok, generator=g)
    shared = torch.randn(5, cfg.hidden_size, generator=g)
    calls = []
    late = lambda: calls.append(1) or shared  # noqa: E731
    assert torch.equal(ex(x, w, ids, add=late, out_dtype=torch.bfloat16),
                       ex(x, w, ids, add=shared, out_dtype=torch.bfloat16))
    assert torch.equal(moe.grouped_experts(x, w, ids, ex.w1, ex.w2, ex.w3, ex.limit, add=late),
                       moe.grouped_experts(x, w, ids, ex.w1, ex.w2, ex.w3, ex.limit, add=shared))
    assert len(calls) == 2
    assert not torch.equal(ex(x, w, ids, add=late), ex(x, w, ids))
