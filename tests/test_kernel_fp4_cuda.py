"""Packed FP4 experts on the GPU: both FP4 kernels (the tensor-core GEMM and the GEMV) on every code and scale byte
against their torch twin, the grouped MoE on packed weights against the same GEMMs on the decoded ones, the
engine with packed experts against its dequantised twin, and ``fp4_gemv``'s fused first half of the experts
(w1, w3 and the SwiGLU with the routing weight in one launch) against float64 products of the decoded weights and
against its torch twin ``moe.gate_up_torch``. Skipped without CUDA (run on the device machine: `pytest -m
cuda`)."""

import pytest
import torch

from .test_engine_cuda import _engine
from .test_kernels_cuda import rel_err

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_kernels_decode_every_code_and_scale(dtype):
    """Both FP4 kernels (the tensor-core GEMM and the GEMV, its tiles split or joined) on random code bytes (every nibble, the subnormal
    0.5 and -0 among them) and scale bytes 40..200 (2**-87 .. 2**73: past what one bfloat16 factor of 2**(b-1)
    holds), against their torch twin on the same sorted layout, per output column (each column's scales within
    a factor 8 of each other, so every group counts). float32 activations: the sums' order apart; bf16: the
    twin's own bf16 product. The same bytes clamped to 128: the tensor-core GEMM's one-product decode (FOLD)
    gives the bits of the two products'."""
    from dsv4.kernels import fp4_gemv, moe

    g = torch.Generator(device="cuda").manual_seed(3)
    E, n, K, P = 4, 96, 384, 7
    codes = torch.randint(0, 256, (E, n, K // 2), device="cuda", dtype=torch.uint8, generator=g)
    base = torch.randint(40, 198, (E, n, 1), device="cuda", generator=g)
    scale = (base + torch.randint(0, 4, (E, n, K // 32), device="cuda", generator=g)).to(torch.uint8)
    a = torch.randn(P, K, device="cuda", generator=g).to(dtype)
    ids = torch.randint(0, E, (P, 1), device="cuda", generator=g)
    for bm in (16, 64):
        rows, _, block_expert = moe.align(ids, E, bm)
        m_pad = rows.shape[0]
        twin = moe._grouped_gemm_torch(a.cpu(), rows.cpu(), codes.cpu(), block_expert.cpu(), True, m_pad,
                                       scale=scale.cpu(), block_m=bm)
        valid = (rows >= 0).cpu()
        tc = moe._grouped_gemm(a, rows, codes, block_expert, True, m_pad, scale=scale, block_m=bm)
        gemv = fp4_gemv.fp4_gemv(a, rows, codes, scale, block_expert, True, m_pad, bm, {"JOIN": False})
        joined = fp4_gemv.fp4_gemv(a, rows, codes, scale, block_expert, True, m_pad, bm,
                                   {"BLOCK_K": 128, "JOIN": True})
        for name, out in (("tensor-core GEMM", tc), ("GEMV", gemv), ("GEMV, tiles joined", joined)):
            got, ref = out.cpu()[valid].double(), twin[valid].double()
            err = ((got - ref).norm(dim=0) / ref.norm(dim=0)).max().item()  # per column: scales differ by 2**157
            assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (bm, name, err)
        # scale bytes up to FOLD_MAX_SCALE: the tensor-core GEMM's one-product decode, the same bits as two products
        small = scale.clamp(max=fp4_gemv.FOLD_MAX_SCALE)
        assert fp4_gemv.fold_scales(small) and not fp4_gemv.fold_scales(scale)
        two = moe._grouped_gemm(a, rows, codes, block_expert, True, m_pad, scale=small, block_m=bm)
        one = moe._grouped_gemm(a, rows, codes, block_expert, True, m_pad, scale=small, block_m=bm, fold=True)
        assert torch.equal(one.cpu()[valid], two.cpu()[valid]), bm
        ref = moe._grouped_gemm_torch(a.cpu(), rows.cpu(), codes.cpu(), block_expert.cpu(), True, m_pad,
                                      scale=small.cpu(), block_m=bm)[valid].double()
        err = ((one.cpu()[valid].double() - ref).norm(dim=0) / ref.norm(dim=0)).max().item()
        assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), (bm, "folded", err)
        for prefetch in (False, True):  # loads a chunk ahead or not: the same arithmetic, the same bits
            for cfg, out in (({"JOIN": False}, gemv), ({"BLOCK_K": 128, "JOIN": True}, joined)):
                again = fp4_gemv.fp4_gemv(a, rows, codes, scale, block_expert, True, m_pad, bm,
                                          dict(cfg, PREFETCH=prefetch))
                assert torch.equal(again.cpu()[valid], out.cpu()[valid]), (bm, prefetch, cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_moe_fp4_equals_its_decoded_weights(dtype, monkeypatch):
    """Packed FP4 experts decoded in the grouped GEMM's inner loop == the same GEMMs on the decoded weights
    (the decode is exact in bf16; the sums differ in order only: the packed GEMM scales each 32 inputs' sum),
    at Flash's dims, odd batch sizes and a width that is not a whole tile (K = 160); and the torch twin
    agrees. Cases of at most one pair per expert on average take the GEMV path (``fp4_gemv``: batch 1 of 32
    experts), the others the tensor-core GEMM; each case again with the GEMV path forced (blocks of many rows)."""
    from dsv4.kernels import fp4_gemv
    from dsv4.checkpoint.quant import pack_fp4_stacked
    from dsv4.kernels.fp4 import unpack_fp4
    from dsv4.kernels.moe import grouped_experts

    g = torch.Generator(device="cuda").manual_seed(1)
    calls = []
    real = fp4_gemv.fp4_gemv
    monkeypatch.setattr(fp4_gemv, "fp4_gemv", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for N, E, k, I, d in ((1, 32, 6, 2048, 4096), (33, 32, 6, 2048, 4096), (5, 8, 2, 96, 160),
                          (300, 8, 2, 256, 512), (32, 128, 6, 256, 512)):  # (300: row blocks of 64)
        gemv = fp4_gemv.use_gemv(N * k, E, False)
        before = len(calls)
        packed = [pack_fp4_stacked(torch.randn(E, r, c, device="cuda", generator=g) / c ** 0.5)
                  for r, c in ((I, d), (d, I), (I, d))]
        w1, w2, w3 = (unpack_fp4(p, s, dtype) for p, s in packed)
        x = torch.randn(N, d, device="cuda", generator=g).to(dtype)
        ids = torch.rand(N, E, device="cuda", generator=g).topk(k, dim=1).indices
        w = torch.rand(N, k, device="cuda", generator=g)
        out = grouped_experts(x, w, ids, *(p for p, _ in packed), 10.0, scales=tuple(s for _, s in packed))
        ref = grouped_experts(x, w, ids, w1, w2, w3, 10.0)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the hidden g, u, h round after other sums
        assert torch.isfinite(out).all() and rel_err(out, ref) < tol, (N, rel_err(out, ref))
        twin = grouped_experts(x.cpu(), w.cpu(), ids.cpu(), *(p.cpu() for p, _ in packed), 10.0,
                               scales=tuple(s.cpu() for _, s in packed))
        assert rel_err(out.cpu(), twin) < (2e-2 if dtype == torch.bfloat16 else 1e-5)
        assert (len(calls) > before) == gemv and gemv == (N * k <= fp4_gemv.GEMV_MAX_ROWS_PER_EXPERT * E)
        with monkeypatch.context() as m:  # the GEMV path on every case: blocks of many rows (pairs of rows)
            m.setattr(fp4_gemv, "use_gemv", lambda *a: True)
            forced = grouped_experts(x, w, ids, *(p for p, _ in packed), 10.0, scales=tuple(s for _, s in packed))
        assert torch.isfinite(forced).all() and rel_err(forced, ref) < tol, (N, "gemv", rel_err(forced, ref))


def test_engine_with_fp4_experts_on_cuda_equals_its_dequantised_twin():
    """fp32, CUDA graphs: tiny with packed FP4 experts gives the tokens of tiny whose experts are the same
    FP4-rounded weights, dequantised (so the packed kernels run inside the engine's graphs)."""
    from dsv4 import SamplingParams
    from dsv4.checkpoint.quant import pack_fp4_stacked
    from dsv4.kernels.fp4 import unpack_fp4

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 4, [7] * 3, list(range(2, 90))]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    packed = _engine("tiny", moe_config={"expert_format": "fp4"})
    assert packed.model.layers[0].ffn.experts.w1.dtype == torch.uint8
    twin = _engine("tiny")
    for blk in list(twin.model.layers) + list(twin.model.mtp):
        for n in ("w1", "w2", "w3"):
            t = getattr(blk.ffn.experts, n)
            t.copy_(unpack_fp4(*pack_fp4_stacked(t), t.dtype))
    out = [o.outputs[0].token_ids for o in packed.generate(prompts, sp)]
    assert packed.engine.runner.graphs.num_replays > 0
    assert out == [o.outputs[0].token_ids for o in twin.generate(prompts, sp)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("E, I, d, N, k, limit, config", [
    (128, 2048, 4096, 1, 6, 10.0, None),  # Flash's experts at batch 1 (flash-E128), the default tile
    (8, 96, 160, 5, 2, 0.0, None),        # I not a whole tile, K = 160 not a whole BLOCK_K, no clamp
    (4, 64, 512, 7, 3, 0.3, None),        # several pairs per expert (pairs of rows, an odd one), a clamp that bites
    (4, 64, 512, 7, 3, 0.3, {"BLOCK_N": 32, "BLOCK_K": 128}),
    (128, 2048, 4096, 1, 6, 10.0, {"BLOCK_N": 16, "BLOCK_K": 512, "JOIN": True}),  # the decoded tiles joined
    (4, 64, 512, 7, 3, 0.3, {"BLOCK_N": 32, "BLOCK_K": 256, "JOIN": True}),  # joined, pairs of rows, an odd one
    (8, 96, 160, 5, 2, 0.0, {"BLOCK_N": 8, "BLOCK_K": 128, "JOIN": True}),  # joined, K not a whole BLOCK_K
])
def test_fp4_gemv_gate_up_equals_float64_swiglu(dtype, E, I, d, N, k, limit, config):
    from dsv4.checkpoint.quant import pack_fp4_stacked
    from dsv4.kernels import fp4_gemv, moe
    from dsv4.kernels.fp4 import unpack_fp4

    g = torch.Generator(device="cuda").manual_seed(E + N)
    (w1, s1), (w3, s3) = (pack_fp4_stacked(torch.randn(E, I, d, device="cuda", generator=g) / d ** 0.5)
                          for _ in range(2))
    x = torch.randn(N, d, device="cuda", generator=g).to(dtype)
    ids = torch.rand(N, E, device="cuda", generator=g).topk(k, dim=1).indices
    weights = torch.rand(N, k, device="cuda", generator=g)
    rows, _, block_expert, row_w = moe.align(ids, E, moe.BLOCK_M, weights)
    m_pad, bm = rows.shape[0], moe.BLOCK_M
    blocks = moe.active_blocks(m_pad, bm, N * k)
    h = fp4_gemv.fp4_gemv_gate_up(x, rows, w1, s1, w3, s3, block_expert, m_pad, bm, limit, row_w, config, blocks)
    assert h.shape == (blocks * bm, I) and h.dtype == dtype

    valid = rows[:blocks * bm] >= 0
    src = rows[:blocks * bm][valid]
    e = block_expert[:blocks].repeat_interleave(bm)[valid]
    d1, d3 = (unpack_fp4(w, s, torch.float64) for w, s in ((w1, s1), (w3, s3)))
    xg = x[src].double()
    gate = torch.einsum("rd,rid->ri", xg, d1[e])
    up = torch.einsum("rd,rid->ri", xg, d3[e])
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    ref = torch.nn.functional.silu(gate) * up * row_w[:blocks * bm][valid].double()[:, None]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.isfinite(h[valid]).all() and rel_err(h[valid], ref) < tol
    twin = moe.gate_up_torch(x.cpu(), rows.cpu(), w1.cpu(), s1.cpu(), w3.cpu(), s3.cpu(), block_expert.cpu(),
                                  m_pad, bm, limit, row_w.cpu(), blocks)
    assert rel_err(h[valid].cpu(), twin[valid.cpu()]) < tol
    swapped = fp4_gemv.fp4_gemv_gate_up(x, rows, w3, s3, w1, s1, block_expert, m_pad, bm, limit, row_w, config,
                                        blocks)  # gate and up in each other's place: not the SwiGLU
    assert rel_err(swapped[valid], ref) > 10 * tol
    for prefetch in (False, True):  # the words a chunk ahead or not: the same bits
        cfg = dict(config or fp4_gemv.gate_up_config(blocks, E), PREFETCH=prefetch)
        again = fp4_gemv.fp4_gemv_gate_up(x, rows, w1, s1, w3, s3, block_expert, m_pad, bm, limit, row_w, cfg, blocks)
        assert torch.equal(again[valid], h[valid]), prefetch
