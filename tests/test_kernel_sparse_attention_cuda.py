"""dsv4.kernels.sparse_attention's single pass against its float64 torch twin: Flash's dims and tiny ones, tokens
that see no key, every tile the launcher takes (the wide tile of prefill chunks, its fp32 code, fewer heads than
the tile), FP8 cache rows, every output written. The split-KV path: test_kernel_attention_split_cuda.py. Skipped
without CUDA (run on the device machine: `pytest -m cuda`)."""

import pytest
import torch

from dsv4.kernels.sparse_attention import sparse_sink_attention, sparse_sink_attention_ref

from .test_kernels_cuda import rel_err

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, H, D, R1, K1, R2, K2", [
    (1, 4, 32, 64, 8, 40, 5),        # tiny dims
    (7, 64, 512, 300, 128, 900, 77),  # Flash dims, odd key counts
    (33, 64, 512, 2000, 131, 4000, 512),
    (5, 64, 512, 300, 128, 10, 0),    # no compressed entries
])
def test_sparse_sink_attention_matches_torch(dtype, N, H, D, R1, K1, R2, K2):
    q, src, sink, ref = _attention_case(dtype, N, H, D, R1, K1, R2, K2)
    out = sparse_sink_attention(q, src, sink, D ** -0.5)
    assert torch.isfinite(out).all()
    assert out[0].abs().max() == 0  # all weight on the sink: no value
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert rel_err(out, ref) < tol


def _attention_case(dtype, N, H, D, R1, K1, R2, K2):
    """Random q, two key sources (token 0 sees no key), the sink and the float64 twin's output."""
    g = torch.Generator(device="cuda").manual_seed(N * 131 + K2)
    dev = "cuda"
    q = torch.randn(N, H, D, device=dev, generator=g).to(dtype)
    kv1 = torch.randn(R1, D, device=dev, generator=g).to(dtype)
    kv2 = torch.randn(R2, D, device=dev, generator=g).to(dtype)
    i1 = torch.randint(0, R1, (N, K1), device=dev, generator=g)
    i2 = torch.randint(0, R2, (N, K2), device=dev, generator=g)
    v1 = torch.rand(N, K1, device=dev, generator=g) < 0.8
    v2 = torch.rand(N, K2, device=dev, generator=g) < 0.5
    v1[0] = False  # a query that sees nothing but its sink
    v2[0] = False
    sink = torch.randn(H, device=dev, generator=g)
    src = [(kv1, i1, v1), (kv2, i2, v2)]
    ref = sparse_sink_attention_ref(q.double(), [(k.double(), i, v) for k, i, v in src], sink.double(), D ** -0.5)
    return q, src, sink, ref


@pytest.mark.parametrize("dtype, tile, N, H, D, K2", [
    (torch.bfloat16, None, 200, 64, 512, 512),  # the wide tile, taken from WIDE_TOKENS tokens on
    (torch.bfloat16, None, 64, 64, 512, 77),
    (torch.float32, (64, 16, 8, 1), 70, 64, 512, 130),  # the wide tile's code in fp32 (exact dots)
    (torch.float32, (16, 64, 4, 2), 90, 4, 32, 40),  # fewer heads than the tile holds
])
def test_sparse_sink_attention_tiles_match_torch(dtype, tile, N, H, D, K2):
    from dsv4.kernels import sparse_attention as sa

    q, src, sink, ref = _attention_case(dtype, N, H, D, 300, 129, 2000, K2)
    if tile is None:
        assert N >= sa.WIDE_TOKENS and dtype != torch.float32  # sparse_sink_attention takes the wide tile
        out = sparse_sink_attention(q, src, sink, D ** -0.5)
        assert torch.equal(out, sa._sparse_sink_attention(q, src, sink, D ** -0.5, 0, sa.wide_tile(H)))
    else:
        out = sa._sparse_sink_attention(q, src, sink, D ** -0.5, 0, tile)
    assert out[0].abs().max() == 0
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("split_scores", [False, True])
@pytest.mark.parametrize("tile", [None, (64, 64, 8, 1)])
def test_sparse_sink_attention_fp8_rows_wide_tile(monkeypatch, tile, split_scores):
    """An FP8 cache's rows (e4m3 and a scale per 64 values) through the wide tile equal the twin, which
    dequantises them as the cache reads them; with the scores' product split between the warpgroups too
    (SPLIT_SCORES)."""
    from dsv4.kernels import sparse_attention as sa
    from dsv4.kernels.fp8 import quantize_fp8

    monkeypatch.setattr(sa, "SPLIT_SCORES", split_scores)

    q, src, sink, _ = _attention_case(torch.bfloat16, 96, 64, 512, 300, 129, 2000, 512)
    fp8 = [(*quantize_fp8(kv), i, v) for kv, i, v in src]
    fp8 = [(r, i, v, sc) for r, sc, i, v in fp8]
    ref = sparse_sink_attention_ref(q.double(), fp8, sink.double(), 512 ** -0.5)
    out = sparse_sink_attention(q, fp8, sink, 512 ** -0.5) if tile is None else \
        sa._sparse_sink_attention(q, fp8, sink, 512 ** -0.5, 0, tile)
    assert rel_err(out, ref) < 1e-2


def test_sparse_attention_writes_every_output():
    """Poisoned output buffer: the kernel must write every element (checked through the allocator)."""
    dev = "cuda"
    torch.cuda.empty_cache()
    for _ in range(3):  # fill the caching allocator's free blocks with NaNs first
        torch.full((64, 64, 512), float("nan"), device=dev, dtype=torch.bfloat16)
    q = torch.randn(64, 64, 512, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(500, 512, device=dev, dtype=torch.bfloat16)
    idx = torch.randint(0, 500, (64, 128), device=dev)
    ok = torch.ones(64, 128, dtype=torch.bool, device=dev)
    out = sparse_sink_attention(q, [(kv, idx, ok)], torch.zeros(64, device=dev), 512 ** -0.5)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype, N, H, D, K2, split", [
    (torch.bfloat16, 200, 64, 512, 512, None),  # the wide tile
    (torch.bfloat16, 40, 64, 512, 77, 0),  # the default tile
    (torch.bfloat16, 3, 64, 512, 77, None),  # the split path: the norm's own kernel first
    (torch.float32, 70, 64, 512, 130, 0),
    (torch.float32, 9, 8, 64, 20, 0),  # a rope as wide as half the row
])
def test_sparse_sink_attention_norms_raw_q(dtype, N, H, D, K2, split):
    """``q_norm``: a raw q RMS-normed per head and roped in the single pass's prologue (FUSE_Q_NORM), and the output
    rotated back in its epilogue, against the norm's and the rope's own kernels around the attention (every path),
    and both against the float64 twin of norm, rope, attention and inverse rope."""
    from dsv4.kernels import sparse_attention as sa
    from dsv4.model.ops import Rope, apply_rope, rms_norm

    q, src, sink, _ = _attention_case(dtype, N, H, D, 300, 129, 2000, K2)
    q = q * 3  # not unit-scaled: the norm does something
    R = min(64, D // 2)
    table = 1.0 / (10000 ** (torch.arange(0, R, 2, device="cuda").float() / R))
    positions = torch.randint(0, 9000, (N,), device="cuda")
    rope = Rope(table, positions)
    rope64 = Rope(table.double().cpu(), positions.cpu())
    qn = apply_rope(rms_norm(q.double().cpu(), None, 1e-6), rope64).cuda()
    ref = sparse_sink_attention_ref(qn, [(k.double(), i, v) for k, i, v in src], sink.double(), D ** -0.5)
    ref = apply_rope(ref.cpu(), rope64, inverse=True).cuda()  # the output rotated back too
    fused = sa._sparse_sink_attention(q, src, sink, D ** -0.5, split, q_norm=(1e-6, rope), fuse=True)
    apart = sa._sparse_sink_attention(q, src, sink, D ** -0.5, split, q_norm=(1e-6, rope), fuse=False)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert torch.isfinite(fused).all() and rel_err(fused, ref) < tol and rel_err(apart, ref) < tol
    assert rel_err(fused, apart) < tol


_OFF = dict(EXP2=False, SPLIT_SCORES=False)  # the plain single pass (both on by default)


@pytest.mark.parametrize("variant", [_OFF, dict(_OFF, RESCALE_TAU=8.0), dict(_OFF, EXP2=True),
                                     dict(_OFF, RESCALE_TAU=8.0, EXP2=True), dict(_OFF, SPLIT_SCORES=True),
                                     dict(SPLIT_SCORES=True, EXP2=True), dict(SPLIT_SCORES=True, EXP2=True,
                                                                              RESCALE_TAU=8.0)])
@pytest.mark.parametrize("dtype, N, qscale", [
    (torch.bfloat16, 200, 1.0),  # the wide tile, scores near the sink's: the max rarely moves past the margin
    (torch.bfloat16, 200, 8.0),  # scores far apart: rescales
    (torch.bfloat16, 40, 8.0),  # the default tile
    (torch.float32, 70, 8.0),
])
def test_sparse_sink_attention_softmax_variants(monkeypatch, dtype, N, qscale, variant):
    """The single pass's softmax variants against the float64 twin, with small and with large scores: RESCALE_TAU
    (the running max moved, and the sums rescaled, only where a row's max would grow past the margin), EXP2 (the
    weights as 2**x by one ex2.approx.ftz, the scores in units of log2) and SPLIT_SCORES (the wide tile's scores
    computed once, their columns split between the warpgroups)."""
    from dsv4.kernels import sparse_attention as sa

    q, src, sink, _ = _attention_case(dtype, N, 64, 512, 300, 129, 2000, 512)
    q = (q.float() * qscale).to(dtype)
    ref = sparse_sink_attention_ref(q.double(), [(k.double(), i, v) for k, i, v in src], sink.double(), 512 ** -0.5)
    for name, value in variant.items():
        monkeypatch.setattr(sa, name, value)
    out = sa._sparse_sink_attention(q, src, sink, 512 ** -0.5, 0)
    assert torch.isfinite(out).all() and out[0].abs().max() == 0
    assert rel_err(out, ref) < (1e-2 if dtype == torch.bfloat16 else 1e-5)
