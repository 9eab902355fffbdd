"""The dense reference path: DeepSeek's golden outputs, transformers' DeepseekV4ForCausalLM, both namings."""

import os
import warnings

import pytest
import torch
from safetensors.torch import load_file

from dsv4.checkpoint.init_random import random_state_dict
from dsv4.checkpoint.io import write_checkpoint
from dsv4.config import get_preset
from dsv4.model import build_model, load_model
from dsv4.model.dense import DenseBackend
from dsv4.model.model import MTPUnavailableError

from .hf_oracle import hf_model


def _golden(fixtures_dir, name):
    d = os.path.join(fixtures_dir, name)
    return load_model(os.path.join(d, "checkpoint")), load_file(os.path.join(d, "golden.safetensors"))


@pytest.mark.parametrize("name", ["dsv4-tiny-official-r16", "dsv4-tiny-official-r128"])
def test_golden_logits_and_mtp_logits(fixtures_dir, name):
    model, g = _golden(fixtures_dir, name)
    ids = g["input_ids"]
    assert (model(ids) - g["logits"]).abs().max().item() < 2e-5
    assert (model.mtp_logits(ids) - g["mtp_logits"]).abs().max().item() < 2e-5


def test_mtp_wiring_fails_when_inputs_are_swapped(fixtures_dir):
    """Row t must use the main streams at t (before hc_head) and the token at t+1 (model doc section 8).
    Mis-wired variants are computed by hand and must NOT match the golden MTP logits."""
    model, g = _golden(fixtures_dir, "dsv4-tiny-official-r16")
    ids, gold = g["input_ids"], g["mtp_logits"]
    B, T = ids.shape
    n, d = model.cfg.hc_mult, model.cfg.hidden_size
    X = model._dense_streams(ids).view(B, T, n, d)

    def mtp(streams, next_ids):
        backend = DenseBackend(B, T - 1, model.cfg.window_size, ids.device)
        Xm = model.mtp_streams(streams.reshape(-1, n, d), next_ids.reshape(-1), backend)
        return model.mtp_logits_from_streams(Xm).view(B, T - 1, -1)

    right = mtp(X[:, :-1], ids[:, 1:])
    assert (right - gold).abs().max() < 2e-5
    for wrong in (mtp(X[:, :-1], ids[:, :-1]),   # token t instead of t+1
                  mtp(X[:, 1:], ids[:, 1:])):    # streams of t+1 instead of t
        assert (wrong - gold).abs().max() > 1e-2


@pytest.mark.parametrize("preset, seqlen", [("tiny", 55), ("tiny-r128", 300)])
def test_dense_path_equals_transformers(preset, seqlen):
    # transformers clamps the shared expert too (model doc gotcha 4): compare with the clamp made identical
    cfg = get_preset(preset).replace(shared_expert_clamp=True)
    sd = random_state_dict(cfg, seed=3)
    ours = build_model(cfg, sd, has_mtp=True)
    hf = hf_model(cfg, sd)
    ids = torch.randint(0, cfg.vocab_size, (2, seqlen), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids).logits
    assert (ours(ids) - ref).abs().max().item() <= 1e-5


def test_shared_expert_clamp_switch_matters():
    cfg = get_preset("tiny")
    sd = random_state_dict(cfg, seed=3)
    sd = {k: v * 20 if "shared_experts.w1" in k else v for k, v in sd.items()}  # make the clamp bite
    ids = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    a = build_model(cfg, sd, True)(ids)
    b = build_model(cfg.replace(shared_expert_clamp=True), sd, True)(ids)
    assert (a - b).abs().max() > 1e-3


def test_golden_r128_in_transformers_agrees_with_us(fixtures_dir):
    from transformers import DeepseekV4ForCausalLM

    d = os.path.join(fixtures_dir, "dsv4-tiny-official-r128")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = DeepseekV4ForCausalLM.from_pretrained(os.path.join(d, "checkpoint"), torch_dtype=torch.float32,
                                                   attn_implementation="eager").eval()
    ours, g = _golden(fixtures_dir, "dsv4-tiny-official-r128")
    with torch.no_grad():
        ref = hf(g["input_ids"]).logits
    assert (ours(g["input_ids"]) - ref).abs().max().item() <= 1e-5


def test_both_namings_load_to_the_same_model(tmp_path):
    cfg = get_preset("tiny")
    sd = random_state_dict(cfg, seed=5)
    write_checkpoint(str(tmp_path / "ds"), cfg, sd, naming="deepseek")
    write_checkpoint(str(tmp_path / "hf"), cfg, sd, naming="hf")
    a, b = load_model(str(tmp_path / "ds")), load_model(str(tmp_path / "hf"))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(a(ids), b(ids)) and torch.equal(a.mtp_logits(ids), b.mtp_logits(ids))


def test_checkpoint_without_mtp_loads_and_refuses_mtp(tmp_path):
    cfg = get_preset("tiny")
    sd = {k: v for k, v in random_state_dict(cfg, seed=1).items() if not k.startswith("mtp.")}
    write_checkpoint(str(tmp_path / "nomtp"), cfg, sd)
    model = load_model(str(tmp_path / "nomtp"))
    assert not model.has_mtp
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    assert model(ids).shape == (1, 12, cfg.vocab_size)
    with pytest.raises(MTPUnavailableError, match="no MTP weights"):
        model.mtp_logits(ids)


def test_indexer_with_at_most_topk_entries_selects_every_visible_one():
    """Indexer.select skips its scores when the step has at most index_topk entries; the long way (scores,
    then top-k of the visible ones) gives the same selection."""
    from dsv4.model.ops import Rope, apply_rope, index_scores, topk_mask

    torch.manual_seed(0)
    cfg = get_preset("tiny")
    model = build_model(cfg, random_state_dict(cfg, seed=3), has_mtp=True)
    blk = next(b for b in model.layers if b.attn.indexer is not None)
    idx, B, T = blk.attn.indexer, 2, 24
    x = torch.randn(B * T, cfg.hidden_size)
    xs = blk.attn.project_input(x)
    c_q = torch.randn(B * T, cfg.q_lora_rank)
    backend = DenseBackend(B, T, cfg.window_size, "cpu")
    rope = Rope(blk.attn.inv_freq, backend.positions)
    E = T // 4
    visible = torch.rand(B, T, E) < 0.6
    for topk in (E, E + 5):  # the skip is taken
        idx.topk = topk
        entries = torch.randn(B, E, cfg.head_dim)
        got_entries, got = idx.select(xs, c_q, rope, (entries, visible), backend, blk.attn.layer_id)
        assert got_entries is entries
        rows = idx.compressor.project(xs["idx_kv"], xs["idx_gate"], backend.positions)
        keys, _ = backend.compressed(blk.attn.layer_id, "indexer", idx.compressor, rows)
        q = idx.wq_b(c_q).unflatten(-1, (idx.n_heads, idx.head_dim))
        scores = index_scores(backend.group(apply_rope(q, rope)), backend.group(idx.weights_proj(x)), keys,
                              idx.n_heads, idx.head_dim)
        assert torch.equal(got, topk_mask(scores, visible, topk)) and torch.equal(got, visible)
    idx.topk = 2  # fewer than E: the scores decide, and only 2 per query survive
    _, got = idx.select(xs, c_q, rope, (entries, visible), backend, blk.attn.layer_id)
    assert (got.sum(-1) <= 2).all() and not (got & ~visible).any() and got.sum() < visible.sum()


def test_topk_rows_twin_selects_what_the_mask_selects():
    """The CUDA backend's compacted selection (rows of the top-k in column order; the kernels' twin) names the
    same entries as ``topk_mask``; ties go to the lowest column, and short rows leave invalid slots."""
    from dsv4.kernels.indexer import index_scores_torch, topk_rows_torch
    from dsv4.model.ops import index_scores, topk_mask

    g = torch.Generator().manual_seed(1)
    N, E, nI, dI, R = 6, 40, 4, 8, 50
    q, w, keys = torch.randn(N, nI, dI, generator=g), torch.randn(N, nI, generator=g), torch.randn(R, dI, generator=g)
    rows = torch.randint(1, R, (N, E), generator=g)
    valid = torch.rand(N, E, generator=g) < 0.7
    valid[0] = False
    valid[1] = False
    valid[1, [3, 17]] = True  # fewer than k visible
    scores = index_scores_torch(q, w, keys, rows, valid)
    ref = index_scores(q.unsqueeze(1), w.unsqueeze(1), keys[rows], nI, dI).squeeze(1)
    assert torch.equal(scores.isfinite(), valid) and torch.allclose(scores[valid], ref[valid])
    for k in (1, 5, E):
        got_rows, got_valid = topk_rows_torch(scores, rows, k)
        mask = topk_mask(scores.unsqueeze(1), valid.unsqueeze(1), k).squeeze(1)
        assert got_valid.shape == (N, min(k, E)) and torch.equal(got_valid.sum(1), mask.sum(1))
        for n in range(N):
            cols = mask[n].nonzero().flatten()
            assert torch.equal(got_rows[n, : len(cols)], rows[n, cols])  # column order
            assert not got_valid[n, len(cols):].any() and not got_rows[n, len(cols):].any()
    tied = torch.tensor([[1.0, 2.0, 2.0, 0.0, -0.0, 2.0, float("-inf"), 0.0]])
    cols = torch.arange(8).unsqueeze(0)
    assert topk_rows_torch(tied, cols, 2)[0].tolist() == [[1, 2]]
    assert topk_rows_torch(tied, cols, 5)[0].tolist() == [[0, 1, 2, 3, 5]]
    assert topk_rows_torch(tied, cols, 8)[1].tolist() == [[True] * 7 + [False]]


def test_fused_projections_equal_the_modules():
    """fuse_projections (what build_model does on CUDA): one GEMM per shared input gives the modules' outputs,
    the modules' weights become views of the fused weight (no second copy), and the state dict is unchanged."""
    cfg = get_preset("tiny")
    sd = random_state_dict(cfg, seed=5)
    plain = build_model(cfg, sd, has_mtp=True)
    fused = build_model(cfg, {k: v.clone() for k, v in sd.items()}, has_mtp=True)
    fused.fuse_projections()
    for blk in list(fused.layers) + list(fused.mtp):
        f = blk.attn.fused_input
        assert f is not None and len(f.groups) == 1  # one format: one GEMM
        assert all(m.weight.untyped_storage().data_ptr() == f.groups[0].weight.untyped_storage().data_ptr()
                   for _, m in blk.attn.input_linears())
    assert {k: v.shape for k, v in fused.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}
    assert all(torch.equal(fused.state_dict()[k], v) for k, v in plain.state_dict().items())
    x = torch.randn(7, cfg.hidden_size)
    i = next(i for i, blk in enumerate(plain.layers) if blk.attn.indexer is not None)  # a CSA layer: 7 of them
    a, b = plain.layers[i].attn.project_input(x), fused.layers[i].attn.project_input(x)
    assert a.keys() == b.keys() and len(a) == 7 and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)
    ids = torch.randint(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        assert torch.allclose(plain(ids), fused(ids), atol=1e-4, rtol=1e-4)
        assert torch.allclose(plain.mtp_logits(ids), fused.mtp_logits(ids), atol=1e-4, rtol=1e-4)


def test_fused_linears_refuse_modules_with_their_own_forward():
    """One F.linear replaces the modules' forwards, so a linear with a bias or a subclass with its own forward
    (e.g. the row-parallel wo_b, which all-reduces) is refused rather than silently skipped."""
    from torch import nn

    from dsv4.model.fused import FusedLinears

    class Reducing(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    for bad in (nn.Linear(4, 3, bias=True), Reducing(4, 3, bias=False)):
        with pytest.raises(TypeError, match="plain bias-free nn.Linear"):
            FusedLinears([("a", nn.Linear(4, 2, bias=False)), ("b", bad)])


def test_kernels_release_early_in_passes_of_few_rows_only(monkeypatch):
    """PDL early release (``kernels.pdl``) is on by default only inside passes of at most RELEASE_MAX_ROWS (4)
    token rows, those the row kernels take: every block and the head of such a pass (target and MTP) see it, those
    of a pass of more rows do not, nor code outside a pass; ``set_release`` forces it either way."""
    from dsv4.kernels import pdl
    from dsv4.model.block import Block
    from dsv4.model.rows import Linear

    seen = []
    blk, lin = Block.forward, Linear.forward
    monkeypatch.setattr(Block, "forward", lambda self, *a: seen.append(("block", pdl.releasing())) or blk(self, *a))
    monkeypatch.setattr(Linear, "forward", lambda self, x: seen.append(("linear", pdl.releasing())) or lin(self, x))
    cfg = get_preset("tiny")
    model = build_model(cfg, random_state_dict(cfg, seed=0), True)
    assert pdl.RELEASE_MAX_ROWS == 4
    for T, want in ((1, True), (4, True), (5, False)):
        seen.clear()
        model(torch.arange(T)[None])
        assert {s for s in seen if s[0] == "block"} == {("block", want)}
        assert ("linear", want) in seen and ("linear", not want) not in seen
    for T, target in ((5, False), (2, True)):  # a target pass of T rows, then an MTP pass of T - 1
        seen.clear()
        model.mtp_logits(torch.arange(T)[None])
        blocks = [r for k, r in seen if k == "block"]
        assert blocks == [target] * cfg.num_layers + [True]
    assert not pdl.releasing()
    for forced in (True, False):
        pdl.set_release(forced)
        try:
            assert pdl.releasing() == forced
            with pdl.pass_rows(1):
                assert pdl.releasing() == forced
        finally:
            pdl.set_release(None)
