"""dsv4.kernels.linear (skinny GEMMs at decode sizes) against torch.nn.functional.linear and the grouped einsum
in float64 on the CPU: odd shapes and the DeepSeek-V4-Flash projections, every configuration, split K and a
single pass, poisoned allocator, batch invariance, CUDA-graph capture, ``usable``. Skipped without CUDA (run on
the device machine: `pytest -m cuda`)."""

import pytest
import torch
import torch.nn.functional as F

from dsv4.kernels.linear import CONFIGS, MAX_M, MIN_SPLIT_K, plan, skinny_grouped_linear, skinny_linear, usable

pytestmark = pytest.mark.cuda

FLASH = [(1024, 4096), (32768, 1024), (512, 4096), (8192, 4096), (4096, 8192), (2048, 4096), (4096, 2048),
         (8192, 1024), (64, 4096), (256, 4096)]  # (N, K): wq_a, wq_b, wkv, ..., indexer, compressor
ODD = [(1000, 777), (17, 33), (100, 300), (4097, 129)]
MS = [1, 2, 7, 16, 32]
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _poison_allocator(nbytes: int):
    """Leave NaN-filled blocks of the output's size in the caching allocator, so an output element the kernel
    never writes is NaN. 0x7FC07FC0 is a NaN read as one fp32 or as two bf16s."""
    torch.cuda.empty_cache()
    for _ in range(3):
        torch.full((-(-nbytes // 4),), 0x7FC07FC0, device="cuda", dtype=torch.int32)


def _randn(*shape, dtype, g, scale=1.0):
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype)


def _check(y, ref, dtype):
    assert y.dtype == dtype and y.shape == ref.shape
    assert torch.isfinite(y).all()  # every element written
    assert rel_err(y.cpu(), ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, K", ODD + FLASH)
def test_linear_matches_torch(dtype, N, K):
    g = torch.Generator(device="cuda").manual_seed(N * 7 + K)
    w = _randn(N, K, dtype=dtype, g=g, scale=K ** -0.5)
    w64 = w.cpu().double()
    for M in MS:
        x = _randn(M, K, dtype=dtype, g=g)
        assert usable(x, w)
        ref = F.linear(x.cpu().double(), w64)
        _poison_allocator(M * N * x.element_size())
        _check(skinny_linear(x, w), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("N, K", [(1000, 777), (1024, 4096), (64, 4096), (130, 1100)])
def test_every_config_and_split(dtype, config, N, K):
    """Each configuration the bench compares, with the split rule's choice, no split, and an odd split."""
    g = torch.Generator(device="cuda").manual_seed(N + K)
    w = _randn(N, K, dtype=dtype, g=g, scale=K ** -0.5)
    w64 = w.cpu().double()
    for split_k in (None, 1, 3):
        for M in (1, 7, 32):
            x = _randn(M, K, dtype=dtype, g=g)
            ref = F.linear(x.cpu().double(), w64)
            _poison_allocator(M * N * x.element_size())
            _check(skinny_linear(x, w, config=config, split_k=split_k), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("G, N, K", [(8, 1024, 4096), (3, 100, 333), (2, 64, 4096)])
def test_grouped_matches_einsum(dtype, G, N, K):
    """x [M, G, K] as the attention makes it (contiguous), with padded rows, and transposed from [G, M, K]."""
    g = torch.Generator(device="cuda").manual_seed(G * N + K)
    w = _randn(G, N, K, dtype=dtype, g=g, scale=K ** -0.5)
    w64 = w.cpu().double()
    for M in MS:
        xs = [_randn(M, G, K, dtype=dtype, g=g),
              _randn(M, G, K + 8, dtype=dtype, g=g)[..., :K],
              _randn(G, M, K, dtype=dtype, g=g).transpose(0, 1)]
        for x in xs:
            assert usable(x, w)
            ref = torch.einsum("mgk,gnk->mgn", x.cpu().double(), w64)
            _poison_allocator(M * G * N * x.element_size())
            _check(skinny_grouped_linear(x, w), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", [None, *CONFIGS])
@pytest.mark.parametrize("N, K", [(1000, 777), (1024, 4096), (64, 4096), (32768, 1024)])
def test_batch_invariance(dtype, config, N, K):
    """A row's result does not depend on M or on the other rows: rows of M = 32 equal, bitwise, the row
    alone (as a view and as a copy) and the first 7 rows alone."""
    g = torch.Generator(device="cuda").manual_seed(N - K)
    w = _randn(N, K, dtype=dtype, g=g, scale=K ** -0.5)
    x = _randn(32, K, dtype=dtype, g=g)
    y = skinny_linear(x, w, config=config)
    for m in range(32):
        assert torch.equal(y[m], skinny_linear(x[m:m + 1], w, config=config)[0]), m
        assert torch.equal(y[m], skinny_linear(x[m].clone(), w, config=config)), m
    assert torch.equal(y[:7], skinny_linear(x[:7], w, config=config))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_batch_invariance(dtype):
    g = torch.Generator(device="cuda").manual_seed(5)
    w = _randn(8, 1024, 4096, dtype=dtype, g=g, scale=4096 ** -0.5)
    x = _randn(32, 8, 4096, dtype=dtype, g=g)
    y = skinny_grouped_linear(x, w)
    for m in range(32):
        assert torch.equal(y[m], skinny_grouped_linear(x[m:m + 1], w)[0]), m


@pytest.mark.parametrize("N, K", [(1024, 4096), (32768, 1024)])
def test_cuda_graph_capture(N, K):
    """Captured once (split K and a single pass), replayed on new inputs copied into the same buffer: equal
    to the eager call."""
    g = torch.Generator(device="cuda").manual_seed(N)
    w = _randn(N, K, dtype=torch.bfloat16, g=g, scale=K ** -0.5)
    wg = _randn(8, 1024, 4096, dtype=torch.bfloat16, g=g, scale=4096 ** -0.5)
    x = _randn(3, K, dtype=torch.bfloat16, g=g)
    xg = _randn(3, 8, 4096, dtype=torch.bfloat16, g=g)
    fn = lambda: (skinny_linear(x, w), skinny_grouped_linear(xg, wg))  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    x.copy_(_randn(3, K, dtype=torch.bfloat16, g=g))
    xg.copy_(_randn(3, 8, 4096, dtype=torch.bfloat16, g=g))
    graph.replay()
    torch.cuda.synchronize()
    ref = fn()
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


def test_split_plan():
    """Splits are whole BLOCK_K steps, none empty; the Flash shapes get a program per SM (132) where splits of
    at least MIN_SPLIT_K columns allow it."""
    for N, K in ODD + FLASH:
        for cfg in CONFIGS.values():
            for split_k in (None, 1, 3, 64):
                S, iters, even = plan(N, K, 1, cfg, split_k)
                steps = -(-K // cfg["BLOCK_K"])
                assert S >= 1 and (S - 1) * iters < steps <= S * iters
                assert even == (K % cfg["BLOCK_K"] == 0 and steps == S * iters)
    for N, K in FLASH:
        cfg = CONFIGS["n64k128"]
        S, _, _ = plan(N, K, 1, cfg, sm_count=132)
        assert -(-N // cfg["BLOCK_N"]) * S >= min(132, K // MIN_SPLIT_K * -(-N // cfg["BLOCK_N"]))


def test_usable():
    w = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(MAX_M, 256, device="cuda", dtype=torch.bfloat16)
    assert usable(x, w) and usable(x[:1], w) and usable(x.view(2, MAX_M // 2, 256), w)
    assert not usable(x.cpu(), w.cpu())
    assert not usable(torch.randn(MAX_M + 1, 256, device="cuda", dtype=torch.bfloat16), w)
    assert not usable(x.float(), w) and not usable(x.half(), w.half())
    assert not usable(torch.randn(256, MAX_M, device="cuda", dtype=torch.bfloat16).t(), w)  # K not unit stride
    assert not usable(x[:, :128], w)
    wg = torch.randn(8, 64, 256, device="cuda", dtype=torch.bfloat16)
    xg = torch.randn(4, 8, 256, device="cuda", dtype=torch.bfloat16)
    assert usable(xg, wg) and not usable(xg[:, :4], wg) and not usable(xg.cpu(), wg.cpu())
    assert not usable(torch.randn(MAX_M + 1, 8, 256, device="cuda", dtype=torch.bfloat16), wg)
    assert skinny_linear(x[:0], w).shape == (0, 64)
