"""GPU kernels against their plain-torch twins (the engine on CUDA: test_engine_cuda.py). Skipped without CUDA
(run on the device machine: `pytest -m cuda`)."""

import random

import pytest
import torch

pytestmark = pytest.mark.cuda


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("N, k, E", [(1, 6, 32), (32, 6, 32), (64, 6, 33), (5, 2, 8), (3, 6, 7), (4, 8, 256)])
def test_align_kernel_equals_twin(N, k, E):
    """dsv4.kernels.moe's one-program align (small batches on CUDA) against align_torch, exactly, with and
    without the routing weights' table."""
    from dsv4.kernels.moe import _align, align_torch

    g = torch.Generator().manual_seed(N * E + k)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    weights = torch.rand(N, k, generator=g).to(torch.bfloat16)
    for w in (None, weights):
        ref = align_torch(ids, E, 16, w)
        _poison_allocator(8192, torch.float32)  # NaN bit patterns: an unwritten int64 differs
        out = _align(ids.cuda(), E, 16, None if w is None else w.cuda())
        assert len(out) == len(ref) == (3 if w is None else 4)
        for a, b in zip(out, ref):
            assert torch.equal(a.cpu(), b)


@pytest.mark.parametrize("func", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("hashed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N", [133, 300])
def test_gate_kernels_match_twin(func, hashed, dtype, N):
    """dsv4.kernels.gate (Gate.forward on CUDA) against the torch lines on the CPU: the same experts in the
    same order, weights within fp32 rounding. 300 bf16 tokens take the tensor-core logits (``use_mma``), and
    under batch invariance (``fixed_rows``) the per-token kernel, whose bits a small step reproduces."""
    from dsv4.kernels.gate import use_mma
    from dsv4.model.rows import fixed_rows

    import dataclasses

    from dsv4.config import get_preset
    from dsv4.model.moe import Gate

    cfg = dataclasses.replace(get_preset("flash-L4-E32"), score_func=func)
    torch.manual_seed(len(func) + hashed)
    gate = Gate(cfg, hashed)
    with torch.no_grad():
        gate.weight.normal_(0, 0.05)
        if hashed:
            gate.tid2eid.copy_(torch.rand(cfg.vocab_size, cfg.n_routed_experts).argsort(1)[:, :cfg.n_experts_per_tok])
        else:
            gate.bias.normal_(0, 0.1)
    gate = gate.to(dtype)
    if not hashed:
        gate.bias.data = gate.bias.data.float()
    x = torch.randn(N, cfg.hidden_size).to(dtype)  # more than 64 tokens: 16 a program
    tok = torch.randint(0, cfg.vocab_size, (N,))
    w_ref, ids_ref = gate(x, tok)
    gate = gate.cuda()
    assert use_mma(x.cuda(), gate.weight, False) == (N >= 256 and dtype == torch.bfloat16)
    _poison_allocator(N * 64, torch.float32)
    w, ids = gate(x.cuda(), tok.cuda())
    assert torch.equal(ids.cpu(), ids_ref) and rel_err(w.cpu(), w_ref) < 1e-5
    with fixed_rows():
        wi, idsi = gate(x.cuda(), tok.cuda())  # the per-token kernel whatever N
    assert torch.equal(idsi.cpu(), ids_ref) and rel_err(wi.cpu(), w_ref) < 1e-5
    w5, ids5 = gate(x[:5].cuda(), tok[:5].cuda())  # one token a program: the same bits
    assert torch.equal(w5, wi[:5]) and torch.equal(ids5, idsi[:5])


def test_grouped_moe_matches_torch():
    """Decode sizes (row blocks of 16) and prefill-sized steps (400 tokens: blocks of 64; 2800: blocks of 128 with
    their 128 x 256 tiles) against fp64."""
    from dsv4.kernels.moe import LARGE_BLOCK_M, PREFILL_BLOCK_M, block_m_for, grouped_experts

    assert block_m_for(400 * 6, 32) == PREFILL_BLOCK_M and block_m_for(96 * 6, 32) < PREFILL_BLOCK_M
    assert block_m_for(2800 * 6, 32, large=True) == LARGE_BLOCK_M
    g = torch.Generator(device="cuda").manual_seed(0)
    for N, E, k, I, d in ((1, 32, 6, 2048, 4096), (96, 32, 6, 2048, 4096), (5, 8, 2, 32, 64),
                          (400, 32, 6, 512, 1024), (2800, 32, 6, 384, 512)):
        w1 = (torch.randn(E, I, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
        w3 = (torch.randn(E, I, d, device="cuda", generator=g) / d ** 0.5).bfloat16()
        w2 = (torch.randn(E, d, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
        x = torch.randn(N, d, device="cuda", generator=g).bfloat16()
        ids = torch.rand(N, E, device="cuda", generator=g).topk(k, dim=1).indices
        w = torch.rand(N, k, device="cuda", generator=g)
        out = grouped_experts(x, w, ids, w1, w2, w3, 10.0)
        ref = torch.zeros(N, d, dtype=torch.float64, device="cuda")
        for t in range(N):
            for j in range(k):
                e = int(ids[t, j])
                h = torch.nn.functional.silu((x[t].double() @ w1[e].double().t()).clamp(max=10))
                h = h * (x[t].double() @ w3[e].double().t()).clamp(-10, 10)
                ref[t] += w[t, j].double() * (h @ w2[e].double().t())
        assert torch.isfinite(out).all() and rel_err(out, ref) < 1e-2


def test_grouped_moe_on_the_library_grouped_mm_matches_the_kernel_and_replays_in_a_graph(monkeypatch):
    """moe.GROUPED_MM (torch._grouped_mm over segments of 16) at prefill sizes (400 and 2800 tokens; other
    ranks' pairs left out at 400) against the Triton grouped GEMM's output, and the same bits replayed from a
    CUDA graph (the segment ends are counted on the device)."""
    from dsv4.kernels import moe

    g = torch.Generator(device="cuda").manual_seed(1)
    for N, E, k, I, d, keep_some in ((400, 32, 6, 512, 1024, True), (2800, 32, 6, 384, 512, False)):
        w1, w3 = ((torch.randn(E, I, d, device="cuda", generator=g) / d ** 0.5).bfloat16() for _ in range(2))
        w2 = (torch.randn(E, d, I, device="cuda", generator=g) / I ** 0.5).bfloat16()
        x = torch.randn(N, d, device="cuda", generator=g).bfloat16()
        ids = torch.rand(N, E, device="cuda", generator=g).topk(k, dim=1).indices
        w = torch.rand(N, k, device="cuda", generator=g)
        keep = torch.rand(N, k, device="cuda", generator=g) < 0.7 if keep_some else None
        monkeypatch.setattr(moe, "GROUPED_MM", False)
        kernel = moe.grouped_experts(x, w, ids, w1, w2, w3, 10.0, keep=keep)
        monkeypatch.setattr(moe, "GROUPED_MM", True)
        assert moe.use_grouped_mm(x, N * k, E, False, False)
        lib = moe.grouped_experts(x, w, ids, w1, w2, w3, 10.0, keep=keep)
        assert torch.isfinite(lib).all() and rel_err(lib, kernel) < 1e-2
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = moe.grouped_experts(x, w, ids, w1, w2, w3, 10.0, keep=keep)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, lib)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("R, I, limit", [(6, 2048, 10.0), (130, 96, 0.0), (1, 7, 1.0)])
def test_swiglu_kernel_matches_twin(dtype, R, I, limit):
    """dsv4.kernels.swiglu (ops.swiglu_to on CUDA, here on a strided view) against the torch lines on the CPU."""
    from dsv4.model.ops import swiglu_to

    g = torch.Generator(device="cuda").manual_seed(R * I)
    gate = (torch.randn(R, 2 * I, device="cuda", generator=g) * 4).to(dtype)[:, I:]
    up = (torch.randn(R, I, device="cuda", generator=g) * 4).to(dtype)
    w = torch.rand(R, device="cuda", generator=g)
    for weight in (w, None):
        ref = swiglu_to(gate.cpu(), up.cpu(), limit, None if weight is None else weight.cpu(), dtype)
        _poison_allocator(R * I, dtype)
        out = swiglu_to(gate, up, limit, weight, dtype)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert rel_err(out.cpu(), ref) < (1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("ratio, coff, D, M", [(4, 2, 512, 37), (128, 1, 512, 3), (4, 2, 128, 1), (128, 1, 96, 0)])
def test_pool_kernel_matches_twin(ratio, coff, D, M):
    """dsv4.kernels.pool (CachedBackend.write_compressed on CUDA) against gather_combined + the halves +
    pool_windows on the CPU; the first window has no valid slot (a padded window pools to zeros)."""
    from dsv4.cache.ops import gather_combined
    from dsv4.kernels.pool import pool_rows
    from dsv4.model.ops import pool_windows

    g = torch.Generator(device="cuda").manual_seed(ratio + M)
    Rs, N = 700, 90
    state = torch.randn(Rs, 2 * coff * D, device="cuda", generator=g)
    step = torch.randn(N, 2 * coff * D, device="cuda", generator=g)
    idx = torch.randint(0, Rs + N, (M, coff * ratio), device="cuda", generator=g)
    valid = torch.rand(M, coff * ratio, device="cuda", generator=g) < 0.7
    valid[:1] = False
    idx = torch.where(valid, idx, 0)
    rows = gather_combined(state.cpu(), step.cpu(), idx.cpu(), valid.cpu())
    kv, sc = rows.chunk(2, dim=-1)
    if coff == 2:
        kv = torch.cat((kv[:, :ratio, :D], kv[:, ratio:, D:]), dim=1)
        sc = torch.cat((sc[:, :ratio, :D], sc[:, ratio:, D:]), dim=1)
    ref = pool_windows(kv, sc, valid.cpu())
    _poison_allocator(max(M, 1) * D, torch.float32)
    out = pool_rows(state, step, idx, valid, ratio, coff, D)
    assert out.shape == (M, D) and torch.isfinite(out).all()
    if M:
        assert out[0].abs().max() == 0 and rel_err(out.cpu(), ref) < 1e-6


def _poison_allocator(numel: int, dtype):
    """Leave NaN-filled blocks in the caching allocator, so an output element a kernel never writes is NaN."""
    torch.cuda.empty_cache()
    for _ in range(3):
        torch.full((numel,), float("nan"), device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(33, 7, 512), (5, 4096), (9, 1000), (1, 64)])
def test_rms_norm_kernel_matches_twin(dtype, shape):
    """dsv4.kernels.norm (what ops.rms_norm runs on CUDA) against the torch lines on the CPU."""
    from dsv4.model.ops import rms_norm

    g = torch.Generator(device="cuda").manual_seed(shape[-1])
    x = torch.randn(*shape, device="cuda", generator=g).to(dtype)
    w = (torch.rand(shape[-1], device="cuda", generator=g) + 0.5).to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    for weight in (w, None):
        ref = rms_norm(x.cpu(), None if weight is None else weight.cpu(), 1e-6)
        _poison_allocator(x.numel(), dtype)
        out = rms_norm(x, weight, 1e-6)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert rel_err(out.cpu(), ref) < tol


def test_rope_and_norm_on_empty_inputs():
    """A step that closes no compressor window ropes and norms zero rows."""
    from dsv4.model.ops import Rope, apply_rope, rms_norm, rms_norm_rope

    rope = Rope(torch.ones(32, device="cuda"), torch.zeros(0, dtype=torch.long, device="cuda"))
    for shape in [(0, 512), (0, 64, 512), (0, 4, 128)]:
        x = torch.zeros(*shape, device="cuda", dtype=torch.bfloat16)
        assert apply_rope(x, rope).shape == x.shape and rms_norm(x, None, 1e-6).shape == x.shape
        assert rms_norm_rope(x, None, 1e-6, rope).shape == x.shape


def _kernels_off(fn):
    """fn() with every kernel switched off: the torch lines on the same device (torch's CUDA cos and sin)."""
    from dsv4 import kernels

    kernels.set_enabled(False)
    try:
        return fn()
    finally:
        kernels.set_enabled(True)


def _rope_inputs(rows: int, R: int, g, big: bool = True):
    """Positions up to 10**6 (angles far past 2 pi: cos/sin's argument reduction) and a real table."""
    from dsv4.model.ops import Rope

    pos = torch.randint(0, 10 ** 6 if big else 4096, (rows,), device="cuda", generator=g)
    return Rope(1.0 / (10000 ** (torch.arange(0, R, 2, device="cuda").float() / R)), pos)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(7, 64, 512), (3, 512), (4, 2, 3, 128), (37, 64, 128), (2, 64)])
def test_rope_kernel_equals_twin(dtype, shape):
    """dsv4.kernels.rope (what ops.apply_rope runs on CUDA, the angles computed in the kernel) does the twin's
    fp32 arithmetic without fused multiply-adds: bit-identical to the torch lines on the GPU (torch's cos and
    sin), forward and inverse, and within float32 rounding of the CPU's (whose cos and sin are other code)."""
    from dsv4.kernels import rope as kernel
    from dsv4.model.ops import Rope, apply_rope

    g = torch.Generator(device="cuda").manual_seed(shape[-1] + len(shape))
    x = torch.randn(*shape, device="cuda", generator=g).to(dtype)
    rope = _rope_inputs(shape[0], 64, g)
    assert kernel.usable(x, rope.table, rope.positions)
    for inverse in (False, True):
        ref = _kernels_off(lambda: apply_rope(x, Rope(rope.table, rope.positions), inverse))
        _poison_allocator(x.numel(), dtype)
        out = apply_rope(x, rope, inverse)
        assert torch.isfinite(out).all()
        assert torch.equal(out, ref)
        mine = x.clone()  # in place: the same bits, in x's own storage
        got = apply_rope(mine, rope, inverse, in_place=True)
        assert torch.equal(got, ref) and got.data_ptr() == mine.data_ptr()
        cpu = apply_rope(x.cpu(), Rope(rope.table.cpu(), rope.positions.cpu()), inverse)
        assert rel_err(out.cpu(), cpu) < (1e-2 if dtype == torch.bfloat16 else 1e-6)
    if x.dim() == 3:  # the same values with non-contiguous strides (copied first)
        strided = x.transpose(0, 1).contiguous().transpose(0, 1)
        assert not strided.is_contiguous()
        assert torch.equal(apply_rope(strided, rope), apply_rope(x, rope))
        assert torch.equal(apply_rope(strided.clone(), rope, in_place=True), apply_rope(x, rope))


@pytest.mark.parametrize("preset, max_draft, tpb", [("tiny", 2, 16), ("flash-L4-E32", 1, 128), ("tiny-r128", 3, 128)])
def test_plan_expansion_kernels_equal_twin(preset, max_draft, tpb):
    """dsv4.kernels.expand (expand_rows on CUDA) against expand_rows_torch on the CPU, every table exactly:
    random batches with and without padding, long chunks, decode and verify rows, and an idle lane."""
    from dsv4.cache.layout import CacheLayout
    from dsv4.cache.plan import build_plan, expand_rows_torch
    from dsv4.config import get_preset
    from dsv4.kernels.expand import expand

    rng = random.Random(preset)
    lay = CacheLayout(get_preset(preset), max_draft, tpb)
    cases = []
    for trial in range(8):
        B = rng.choice([1, 3, 5, 32])
        n = [rng.choice([1, 1 + max_draft, rng.randint(1, 300)]) for _ in range(B)]
        C = [rng.randint(0, 3000) for _ in range(B)]
        pad = trial % 2 == 1
        cases.append(dict(req_ids=list(range(B)), num_computed=C, num_new=n, draft_lens=[0] * B,
                          slots=[rng.randint(1, 40) for _ in range(B)],
                          block_tables=[[rng.randint(1, 999) for _ in range(lay.num_blocks_for(c + k))]
                                        for c, k in zip(C, n)],
                          pad_tokens_to=sum(n) + 5 if pad else None, pad_batch_to=B + 3 if pad else None,
                          max_entries=1000 if pad else None))
    cases.append(dict(req_ids=(), num_computed=(), num_new=(), draft_lens=(), slots=(), block_tables=[],
                      pad_tokens_to=6, pad_batch_to=2, max_entries=30, max_blocks=4))
    for args in cases:
        plan = build_plan(lay, num_slots=40, owner=0, step_id=0, **args)
        ref = expand_rows_torch(lay, plan.shape, plan.rows, 40)
        _poison_allocator(1 << 20, torch.float32)
        got = expand(lay, plan.shape, plan.rows.cuda(), 40)
        assert [k for k in ref if not torch.equal(ref[k], got[k].cpu())] == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("ratio, C", [(4, 1024), (128, 512), (4, 96)])
def test_compressor_rows_kernel_matches_twin(dtype, ratio, C):
    """dsv4.kernels.project (Compressor.project on CUDA) against the torch lines on the CPU."""
    from dsv4.kernels.project import project_rows

    g = torch.Generator(device="cuda").manual_seed(ratio + C)
    N = 37
    kv = torch.randn(N, C, device="cuda", generator=g).to(dtype)
    gate = torch.randn(N, 2 * C, device="cuda", generator=g).to(dtype)[:, C:]
    ape = torch.randn(ratio, C, device="cuda", generator=g)
    pos = torch.randint(0, 5000, (N,), device="cuda", generator=g)
    ref = torch.cat((kv.cpu().float(), gate.cpu().float() + ape.cpu()[pos.cpu() % ratio]), dim=-1)
    _poison_allocator(N * 2 * C, torch.float32)
    out = project_rows(kv, gate, ape, pos, ratio)
    assert torch.equal(out.cpu(), ref)
    # the decode-like backend's case: the rows also stored into the state ring (padding repeats on row 0)
    state = torch.full((N + 20, 2 * C), 5.0, device="cuda")
    rows = torch.randperm(N + 19, device="cuda", generator=g)[:N] + 1
    rows[-4:] = 0
    assert torch.equal(project_rows(kv, gate, ape, pos, ratio, state, rows).cpu(), ref)
    want = torch.full_like(state, 5.0).cpu()
    want[rows[:-4].cpu()] = ref[:-4]
    # padding's programs race on the null row: each element is one of theirs (on the GPU not one whole row)
    assert torch.equal(state[1:].cpu(), want[1:]) and (state[0].cpu()[None] == ref[-4:]).any(0).all()


@pytest.mark.parametrize("N, k", [(1, 6), (33, 6), (7, 2)])
def test_expert_combine_kernel_matches_twin(N, k):
    """The grouped experts' combine (each token's sum over its pairs' rows, kept pairs only) against the
    torch lines on the CPU; the output buffer is poisoned first; with the shared expert's output added, the
    same bits as adding it after."""
    from dsv4.kernels.moe import _combine, align_torch

    E, d = 32, 4096
    gen = torch.Generator().manual_seed(N)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(N)])
    _, pair_pos, _ = align_torch(ids, E)
    y = torch.randn(int(pair_pos.max()) + 16, d, generator=gen).to(torch.bfloat16)
    keep = torch.rand(N, k, generator=gen) < 0.6
    for kp in (None, keep):
        ref = y[pair_pos] if kp is None else torch.where(kp.reshape(-1, 1), y[pair_pos], 0)
        ref = ref.view(N, k, -1).float().sum(dim=1)
        _poison_allocator(N * d, torch.float32)
        out = _combine(y.cuda(), pair_pos.cuda(), None if kp is None else kp.cuda(), N, k)
        assert torch.isfinite(out).all() and rel_err(out.cpu(), ref) < 1e-6
        # with the shared expert's output added and the result rounded in the same kernel: the bits of the
        # fp32 sum plus it, rounded after (what MoE.forward did in two torch ops)
        shared = torch.randn(N, d, generator=gen).to(torch.bfloat16)
        fused = _combine(y.cuda(), pair_pos.cuda(), None if kp is None else kp.cuda(), N, k, shared.cuda(),
                         torch.bfloat16)
        assert fused.dtype == torch.bfloat16 and torch.equal(fused, (out + shared.cuda()).to(torch.bfloat16))


@pytest.mark.parametrize("R, V", [(1, 129280), (33, 129280), (3, 640)])
def test_two_stage_argmax_equals_argmax(R, V):
    """sampler.greedy_tokens on CUDA against argmax on the CPU, ties (the first maximum wins) included."""
    from dsv4.engine.sampler import greedy_tokens

    g = torch.Generator().manual_seed(R)
    logits = torch.randn(R, V, generator=g)
    logits[0, V // 3] = logits[0, 2 * V // 3] = logits[0, V - 1] = 50.0  # a tie across chunks
    logits[-1, 5] = logits[-1, 6] = 60.0  # a tie inside a chunk
    ref = logits.argmax(-1)
    assert ref[-1] == 5 and (R == 1 or ref[0] == V // 3)
    assert torch.equal(greedy_tokens(logits.cuda()).cpu(), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, nI, dI, R, E, k", [(1, 64, 128, 3000, 2048, 512), (33, 64, 128, 900, 700, 512),
                                                (5, 16, 16, 60, 40, 3), (4, 4, 24, 30, 20, 25),
                                                (300, 64, 128, 3000, 2000, 512), (2, 16, 16, 60, 5000, 100)])
def test_indexer_kernels_match_twins(dtype, N, nI, dI, R, E, k):
    """dsv4.kernels.indexer: the scores kernels against the gathered torch scores (float64), and the top-k kernel
    against the stable-sort twin on the same scores, exactly (rows, order, validity), ties included. 300 tokens
    take the tiles of tokens x entries (each token its own rows here: every tile falls back to a token at a
    time) and, under batch invariance, the prefill's runs of blocks a program (token 0's first half, with nothing
    visible, skipped), whose scores are the bits a small step's one block a program gives; 5000 entries are more
    than one tile of the top-k kernel's passes."""
    from dsv4.kernels.indexer import index_scores_cuda, index_scores_torch, topk_rows_cuda, topk_rows_torch

    g = torch.Generator(device="cuda").manual_seed(N * 7 + E)
    q = torch.randn(N, nI, dI, device="cuda", generator=g).to(dtype)
    w = torch.randn(N, nI, device="cuda", generator=g).to(dtype)
    keys = torch.randn(R, dI, device="cuda", generator=g).to(dtype)
    rows = torch.randint(0, R, (N, E), device="cuda", generator=g)
    valid = torch.rand(N, E, device="cuda", generator=g) < 0.8
    valid[0, : E // 2] = False  # a token whose entries are all in the second half
    if N > 2:
        valid[2] = False
        valid[2, : min(k, E) - 1] = True  # fewer than k visible
    ref = index_scores_torch(q.double(), w.double(), keys.double(), rows, valid)
    _poison_allocator(N * E, torch.float32)
    scores = index_scores_cuda(q, w, keys, rows, valid)
    invariant = index_scores_cuda(q, w, keys, rows, valid, invariant=True)
    assert torch.equal(scores.isfinite(), valid)
    assert torch.equal(index_scores_cuda(q[:3], w[:3], keys, rows[:3], valid[:3]), invariant[:3])
    for got in (scores, invariant):
        assert rel_err(got[valid], ref[valid]) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
    quant = (scores * 4).round() / 4  # many ties, -0.0 among them
    for s in (scores, quant):
        _poison_allocator(2 * N * k, torch.float32)  # NaN bytes: a huge int64 row where nothing is written
        got_rows, got_valid = topk_rows_cuda(s, rows, k)
        want_rows, want_valid = topk_rows_torch(s, rows, k)
        assert torch.equal(got_valid, want_valid) and torch.equal(got_rows, want_rows)


@pytest.mark.parametrize("E, k", [(2048, 512), (3000, 512), (600, 64)])
def test_topk_rows_of_a_causal_prompt(E, k):
    """A prompt's tokens see a prefix of their entries' columns, of every length (none, fewer than k, exactly k,
    more, all): the top-k kernel's later passes and its selection stop at the token's last visible column, and a
    token with at most k visible entries skips the later passes; the same rows and validity as the stable-sort
    twin, ties included."""
    from dsv4.kernels.indexer import topk_rows_cuda, topk_rows_torch

    g = torch.Generator(device="cuda").manual_seed(E + k)
    N = 700
    visible = torch.randint(0, E + 1, (N,), device="cuda", generator=g)
    visible[:6] = torch.tensor([0, 1, k - 1, k, k + 1, E])
    scores = torch.randn(N, E, device="cuda", generator=g)
    scores = scores.masked_fill(torch.arange(E, device="cuda")[None, :] >= visible[:, None], float("-inf"))
    rows = torch.randint(0, 1 << 20, (N, E), device="cuda", generator=g)
    for s in (scores, (scores * 4).round() / 4):
        got_rows, got_valid = topk_rows_cuda(s, rows, k)
        want_rows, want_valid = topk_rows_torch(s, rows, k)
        assert torch.equal(got_valid, want_valid) and torch.equal(got_rows, want_rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, nI, dI, E", [(300, 64, 128, 200), (700, 16, 32, 300)])
def test_indexer_scores_in_tiles_of_a_prompts_tokens(dtype, N, nI, dI, E):
    """Prompts' tokens share their request's entry rows with a causal visibility: the tiles of tokens x entries
    take one load of the keys and a GEMM a head. Two requests whose boundary falls inside a tile (that tile takes
    a token at a time), against the float64 twin and against the scores a token at a time."""
    from dsv4.kernels import indexer

    g = torch.Generator(device="cuda").manual_seed(N + E)
    q = torch.randn(N, nI, dI, device="cuda", generator=g).to(dtype)
    w = torch.randn(N, nI, device="cuda", generator=g).to(dtype)
    keys = torch.randn(2 * E + 7, dI, device="cuda", generator=g).to(dtype)
    cut = N // 2 + 5  # not a multiple of the tile's tokens
    first = torch.randperm(2 * E + 7, device="cuda", generator=g)[:E]
    second = torch.randperm(2 * E + 7, device="cuda", generator=g)[:E]
    rows = torch.where(torch.arange(N, device="cuda")[:, None] < cut, first, second)
    pos = torch.cat([torch.arange(cut), torch.arange(N - cut) + 3 * E]).to("cuda")  # the second later in its sequence
    valid = torch.arange(E, device="cuda")[None, :] < ((pos + 1) // 4)[:, None]
    assert N >= indexer.SHARED_MIN_TOKENS
    ref = indexer.index_scores_torch(q.double(), w.double(), keys.double(), rows, valid)
    _poison_allocator(N * E, torch.float32)
    scores = indexer.index_scores_cuda(q, w, keys, rows, valid)
    one_at_a_time = indexer.index_scores_cuda(q, w, keys, rows, valid, invariant=True)
    assert torch.equal(scores.isfinite(), valid)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(scores[valid], ref[valid]) < tol
    assert rel_err(scores[valid], one_at_a_time[valid].double()) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape, R, weighted", [((7, 64, 512), 64, False), ((33, 512), 64, True),
                                                ((5, 128), 64, True), ((3, 4, 32), 16, False), ((1, 512), 64, True)])
def test_rms_norm_rope_kernel_matches_twin(dtype, shape, R, weighted):
    """The fused norm + rope (q per head, the K=V head, compressor entries; the angles computed in the kernel)
    against rope(norm(x)): the torch lines on the GPU (same cos and sin) and on the CPU."""
    from dsv4.model.ops import Rope, apply_rope, rms_norm, rms_norm_rope

    g = torch.Generator(device="cuda").manual_seed(shape[-1] + R)
    x = torch.randn(*shape, device="cuda", generator=g).to(dtype)
    w = (torch.rand(shape[-1], device="cuda", generator=g) + 0.5).to(dtype) if weighted else None
    rope = _rope_inputs(shape[0], R, g, big=shape[0] % 2 == 1)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    ref = apply_rope(rms_norm(x.cpu(), None if w is None else w.cpu(), 1e-6), Rope(rope.table.cpu(),
                                                                                  rope.positions.cpu()))
    gpu = _kernels_off(lambda: rms_norm_rope(x, w, 1e-6, Rope(rope.table, rope.positions)))
    _poison_allocator(x.numel(), dtype)
    out = rms_norm_rope(x, w, 1e-6, rope)
    assert out.dtype == dtype and out.shape == x.shape and torch.isfinite(out).all()
    assert rel_err(out.cpu(), ref) < tol
    assert rel_err(out, gpu) < tol  # the norm's rsqrt differs (F.rms_norm there), the rope's cos and sin do not


@pytest.mark.parametrize("x_dtype, out_dtype, D, R", [(torch.float32, torch.bfloat16, 512, 64),
                                                      (torch.float32, torch.bfloat16, 128, 64),
                                                      (torch.bfloat16, torch.bfloat16, 512, 64),
                                                      (torch.float32, torch.float32, 512, 64),
                                                      (torch.bfloat16, torch.float32, 128, 64),
                                                      (torch.bfloat16, "fp8", 512, 64),
                                                      (torch.float32, "fp8", 512, 64)])
def test_rms_norm_rope_stores_into_cache_rows(x_dtype, out_dtype, D, R):
    """The norm-rope kernel storing its rows into a cache (compressor entries, index keys, the window ring;
    FP8 caches quantised with their scales): the same bits as its own rows stored by ``store_rows`` (index_copy_
    in the cache's dtype, or quantize_fp8), rows not named untouched, and the torch twin (kernels off, same
    cos and sin) within rounding."""
    from dsv4.kernels.fp8 import FP8, dequantize_fp8, store_rows
    from dsv4.model.ops import Rope, rms_norm_rope

    g = torch.Generator(device="cuda").manual_seed(D + R)
    N, cap, fp8 = 9, 40, out_dtype == "fp8"
    x = (3 * torch.randn(N, D, device="cuda", generator=g)).to(x_dtype)
    x[2, 64:128] = 0  # an FP8 block of zeros: scale 0
    w = torch.rand(D, device="cuda", generator=g) + 0.5
    rope = _rope_inputs(N, R, g)
    rows = torch.randperm(cap - 1, device="cuda", generator=g)[:N] + 1
    rows[-3:] = 0  # padding: repeats on the null row

    def cache():
        data = torch.zeros(cap, D, device="cuda", dtype=FP8 if fp8 else out_dtype)
        return data, (torch.full((cap, D // 64), 3.0, device="cuda") if fp8 else None)

    def read(c):  # a cache's rows as float (FP8: dequantised)
        return dequantize_fp8(c[0], c[1], torch.float32) if fp8 else c[0].float()

    got, want, twin = cache(), cache(), cache()
    assert rms_norm_rope(x, w, 1e-6, rope, got[0], rows, got[1]) is None
    mine = rms_norm_rope(x, w, 1e-6, rope)
    store_rows(want[0], want[1], rows[:-3], mine[:-3])
    bits = lambda t: t[1:].view(torch.uint8) if t.dtype == FP8 else t[1:]  # noqa: E731 (no FP8 torch.equal)
    assert torch.equal(bits(got[0]), bits(want[0])) and (not fp8 or torch.equal(got[1][1:], want[1][1:]))
    one = [cache() for _ in range(3)]
    for c, i in zip(one, range(N - 3, N)):
        store_rows(c[0], c[1], rows[i:i + 1], mine[i:i + 1])
    # padding's programs race on the null row: each stored element (value, FP8 scale) is one of theirs
    raw = lambda t: t[0].view(torch.uint8) if t.dtype == FP8 else t[0]  # noqa: E731
    for k in (0, 1) if fp8 else (0,):
        assert (raw(got[k])[None] == torch.stack([raw(c[k]) for c in one])).any(0).all()
    _kernels_off(lambda: rms_norm_rope(x, w, 1e-6, Rope(rope.table, rope.positions), twin[0], rows, twin[1]))
    tol = 7e-2 if fp8 else 1e-2 if torch.bfloat16 in (x_dtype, out_dtype) else 1e-6
    assert rel_err(read(got)[1:], read(twin)[1:]) < tol
