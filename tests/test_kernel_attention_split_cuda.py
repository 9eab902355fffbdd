"""The split-KV (flash-decoding) path of dsv4.kernels.sparse_attention against its torch twin, next to the
single-pass kernel: float64 reference, poisoned allocator, empty chunks, tokens without a valid key, batch
invariance, CUDA-graph capture. Skipped without CUDA (run on the device machine: `pytest -m cuda`)."""

import pytest
import torch

from dsv4.kernels.sparse_attention import (_sparse_sink_attention, sparse_sink_attention,
                                           sparse_sink_attention_ref, split_for)

pytestmark = pytest.mark.cuda

PATHS = [None, 0, 32, 64, 128]  # the default choice, the single pass, the split path with chunks of 32/64/128 keys


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _poison_allocator(numel: int):
    """Leave NaN-filled blocks in the caching allocator, so an element a kernel never writes (output or scratch)
    is NaN. 0x7FC07FC0 is a NaN read as one fp32 or as two bf16s."""
    torch.cuda.empty_cache()
    for _ in range(3):
        torch.full((numel,), 0x7FC07FC0, device="cuda", dtype=torch.int32)


def _numel_touched(N, H, D, K1, K2, split):
    """4-byte words of the output plus the split path's scratch (a bound for the poison)."""
    c = -(-K1 // 32) + -(-K2 // 32)  # chunks at the smallest split: the most scratch
    return N * H * D + (N * c * H * (D + 2) if split != 0 else 0) + (1 << 20)


def _inputs(N, H, D, R1, K1, R2, K2, dtype, seed):
    """Random tables with: token 0 seeing no key (N > 1), token 1 with empty chunks inside both sources, token 2
    whose only valid key is the last column (of source 2, or of source 1 without one)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    q = torch.randn(N, H, D, device=dev, generator=g).to(dtype)
    kv1 = torch.randn(R1, D, device=dev, generator=g).to(dtype)
    kv2 = torch.randn(R2, D, device=dev, generator=g).to(dtype)
    i1 = torch.randint(0, R1, (N, K1), device=dev, generator=g)
    i2 = torch.randint(0, R2, (N, K2), device=dev, generator=g)
    v1 = torch.rand(N, K1, device=dev, generator=g) < 0.8
    v2 = torch.rand(N, K2, device=dev, generator=g) < 0.5
    if N > 1:
        v1[0] = False
        v2[0] = False
        v1[1, 32:128] = False  # whole chunks of 32 and 64 keys
        v2[1, 64:256] = False
    if N > 2:
        v1[2] = False
        v2[2] = False
        if K2:
            v2[2, -1] = True
        else:
            v1[2, -1] = True
    sink = torch.randn(H, device=dev, generator=g)
    src = [(kv1, i1, v1), (kv2, i2, v2)] if K2 else [(kv1, i1, v1)]
    return q, src, sink


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, H, D, R1, K1, R2, K2", [
    (1, 4, 32, 64, 5, 40, 7),            # tiny model dims
    (33, 4, 32, 300, 129, 1200, 1000),
    (33, 4, 32, 300, 5, 40, 0),
    (1, 64, 32, 300, 129, 1200, 512),
    (1, 64, 512, 300, 129, 2000, 512),   # Flash dims, batch 1 at long context
    (33, 64, 512, 300, 129, 2000, 512),
    (33, 64, 512, 300, 129, 10, 0),      # no compressed entries
    (1, 64, 512, 300, 5, 2000, 1000),
    (33, 64, 512, 300, 5, 40, 7),
])
def test_split_paths_match_torch(dtype, N, H, D, R1, K1, R2, K2):
    q, src, sink = _inputs(N, H, D, R1, K1, R2, K2, dtype, N * 131 + K2 + D)
    ref = sparse_sink_attention_ref(q.double(), [(k.double(), i, v) for k, i, v in src], sink.double(), D ** -0.5)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for split in PATHS:
        _poison_allocator(_numel_touched(N, H, D, K1, K2, split))
        out = _sparse_sink_attention(q, src, sink, D ** -0.5, split=split)
        assert torch.isfinite(out).all(), split
        if N > 1:
            assert out[0].abs().max() == 0, split  # all weight on the sink: no value
        assert rel_err(out, ref) < tol, split
        if N > 2:
            assert rel_err(out[1:3], ref[1:3]) < tol, split  # empty chunks; the last chunk alone
    _poison_allocator(_numel_touched(N, H, D, K1, K2, None))
    out = sparse_sink_attention(q, src, sink, D ** -0.5)  # the public entry: the default path
    assert torch.isfinite(out).all() and rel_err(out, ref) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H, D, K1, K2", [(4, 32, 129, 7), (64, 512, 129, 512), (64, 512, 5, 0)])
def test_token_without_keys_outputs_zero(dtype, H, D, K1, K2):
    """N = 1 and no valid key: exactly 0 on every path (m = -inf chunks merge to nothing)."""
    q, src, sink = _inputs(1, H, D, 300, K1, 2000, K2, dtype, 5)
    src = [(k, i, torch.zeros_like(v)) for k, i, v in src]
    for split in PATHS:
        _poison_allocator(_numel_touched(1, H, D, K1, K2, split))
        out = _sparse_sink_attention(q, src, sink, D ** -0.5, split=split)
        assert out.abs().max() == 0 and not out.isnan().any(), split


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H, D, K1, K2", [(64, 512, 129, 512), (64, 512, 129, 0), (4, 32, 5, 1000), (4, 32, 5, 7)])
def test_split_batch_invariance(dtype, H, D, K1, K2):
    """Token 0 computed in a batch of 33 equals token 0 computed alone (tables of the same column counts),
    bit for bit, on each path given explicitly (the default path depends on the batch size: split_for);
    within a path, padding the last source with invalid columns changes nothing."""
    q, src, sink = _inputs(33, H, D, 300, K1, 2000, K2, dtype, 11)
    g = torch.Generator(device="cuda").manual_seed(3)
    src = [(k, i, torch.rand(i.shape, device="cuda", generator=g) < 0.7) for k, i, v in src]  # token 0 sees keys
    one = [(k, i[:1].clone(), v[:1].clone()) for k, i, v in src]
    for split in [p for p in PATHS if p is not None]:
        _poison_allocator(_numel_touched(33, H, D, K1, K2, split))
        big = _sparse_sink_attention(q, src, sink, D ** -0.5, split=split)
        _poison_allocator(_numel_touched(1, H, D, K1, K2, split))
        alone = _sparse_sink_attention(q[:1].clone(), one, sink, D ** -0.5, split=split)
        assert torch.equal(big[:1], alone), split
        fixed = split_for(1, -(-H // 16), K1, K2) if split is None else split
        k, i, v = one[-1]  # the last source (the compressed entries) 77 columns wider, invalid for the token
        pad = one[:-1] + [(k, torch.cat([i, torch.zeros(1, 77, dtype=i.dtype, device="cuda")], 1),
                           torch.cat([v, torch.zeros(1, 77, dtype=v.dtype, device="cuda")], 1))]
        padded = _sparse_sink_attention(q[:1].clone(), pad, sink, D ** -0.5, split=fixed)
        assert torch.equal(padded, alone), split


def test_split_choice():
    """Chunks for few programs (small batches), the single pass from SPLIT_PROGRAMS on or for few keys."""
    assert split_for(1, 4, 129, 512) == 32 and split_for(8, 4, 129, 32) == 64
    assert split_for(16, 4, 129, 512) == 0 and split_for(32, 4, 129, 0) == 0 and split_for(1, 1, 5, 7) == 0


@pytest.mark.parametrize("split", [None, 0, 64])
def test_split_path_in_cuda_graph(split):
    """Captured once, replayed on new inputs copied into the same buffers: equal to the eager call."""
    H, D, K1, K2 = 64, 512, 129, 512
    q, src, sink = _inputs(8, H, D, 300, K1, 2000, K2, torch.bfloat16, 21)
    fn = lambda: _sparse_sink_attention(q, src, sink, D ** -0.5, split=split)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    q2, src2, sink2 = _inputs(8, H, D, 300, K1, 2000, K2, torch.bfloat16, 22)
    q.copy_(q2)
    sink.copy_(sink2)
    for (k, i, v), (k2, i2, v2) in zip(src, src2):
        k.copy_(k2)
        i.copy_(i2)
        v.copy_(v2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fn())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, H, D, K1, K2", [(1, 64, 512, 128, 512), (33, 64, 512, 128, 77), (3, 4, 32, 5, 7)])
def test_fp8_cache_rows_match_twin(dtype, N, H, D, K1, K2):
    """An FP8 cache (e4m3 bytes + a float32 scale per row and 64 values) read in place on every path: equal to
    the twin, which dequantises as CacheStorage's reads do. Every e4m3 byte value (but NaN) is decoded once
    where the first source has the columns for it (D = 512: all 254 in the first rows)."""
    from dsv4.cache.storage import FP8, quantize_fp8

    q, src, sink = _inputs(N, H, D, 300, K1, 2000, K2, dtype, 31)
    fp8 = []
    for rows, idx, valid in src:
        data, scale = quantize_fp8(rows.float() * 3)
        fp8.append((data, idx, valid, scale))
    codes = torch.arange(256, dtype=torch.int32, device="cuda")
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8).view(FP8)  # 254 byte values
    data, idx, valid, scale = fp8[0]
    rows = min(-(-codes.numel() // D), K1)  # as many code rows as the first source's columns hold
    for r in range(rows):
        part = codes[r * D:(r + 1) * D]
        data[r, : part.numel()] = part
    scale[:rows] = 1.0
    idx[:, :rows] = torch.arange(rows, device="cuda")
    valid[:, :rows] = True
    ref = sparse_sink_attention_ref(q.double(), [(d, i, v, s) for d, i, v, s in fp8], sink.double(), D ** -0.5)
    for split in PATHS:
        _poison_allocator(_numel_touched(N, H, D, K1, K2, split))
        out = _sparse_sink_attention(q, fp8, sink, D ** -0.5, split=split)
        assert torch.isfinite(out).all(), split
        assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5), split
