"""dsv4.kernels.mhc (collapse, head, write-back, and the write-back that computes the next collapse's mixing
partials) against the torch lines of dsv4.model.mhc. Skipped without CUDA (run on the device machine:
`pytest -m cuda`)."""

import pytest
import torch

from .test_kernels_cuda import _poison_allocator, rel_err

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, d", [(1, 4096), (37, 64), (5, 1000), (300, 4096), (300, 1000)])
def test_mhc_kernels_match_twins(dtype, N, d, monkeypatch):
    """dsv4.kernels.mhc (hc_pre, hc_head, hc_post on CUDA, the collapses with and without the norm folded in)
    against the torch lines of model.mhc on the CPU, the mixing partials one chunk a program and in runs of
    chunks (``mix_loop``)."""
    from dsv4.model import mhc

    g = torch.Generator(device="cuda").manual_seed(N + d)
    n = 4
    X = torch.randn(N, n, d, device="cuda", generator=g).to(dtype)
    fn = torch.randn((2 + n) * n, n * d, device="cuda", generator=g) * 0.1
    base = torch.randn((2 + n) * n, device="cuda", generator=g)
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    fh, bh = fn[:n] * 2, base[:n]
    y = torch.randn(N, d, device="cuda", generator=g).to(dtype)
    cpu = lambda *ts: [t.cpu() for t in ts]  # noqa: E731
    u_ref, post_ref, comb_ref = mhc.hc_pre(*cpu(X, fn, base, scale), 20, 1e-6, 1e-6)
    head_ref = mhc.hc_head(*cpu(X, fh, bh, scale[:1]), 1e-6, 1e-6)
    out_ref = mhc.hc_post(*cpu(y, X, post_ref, comb_ref))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    _poison_allocator(N * n * d * 4, dtype)
    u, post, comb = mhc.hc_pre(X, fn, base, scale, 20, 1e-6, 1e-6)
    assert u.dtype == dtype and torch.isfinite(u).all() and torch.isfinite(comb).all()
    assert rel_err(post.cpu(), post_ref) < 1e-5 and rel_err(comb.cpu(), comb_ref) < 1e-5  # fp32 weights
    assert rel_err(u.cpu(), u_ref) < tol
    from dsv4.kernels import mhc as kernel
    from dsv4.model.rows import fixed_rows

    with fixed_rows():  # batch invariance: a token's result whatever the batch size
        inv = mhc.hc_pre(X, fn, base, scale, 20, 1e-6, 1e-6)
        few = mhc.hc_pre(X[:3], fn, base, scale, 20, 1e-6, 1e-6)
    assert all(torch.equal(a[:3], b) for a, b in zip(inv, few))
    assert kernel.mix_loop(N, n * d, True) == 1
    if kernel.mix_loop(N, n * d, False) == 1:  # few programs: the partials' layout is the invariant one
        assert all(torch.equal(a, b) for a, b in zip((u, post, comb), inv))
    with monkeypatch.context() as m:  # runs of MIX_LOOP chunks a program (a prefill chunk's thousands of tokens)
        m.setattr(kernel, "MIX_PROGRAMS", 1)
        assert kernel.mix_loop(N, n * d, False) > 1
        runs = mhc.hc_pre(X, fn, base, scale, 20, 1e-6, 1e-6)
        head_runs = mhc.hc_head(X, fh, bh, scale[:1], 1e-6, 1e-6)
    # within rounding of the invariant layout's
    assert rel_err(runs[0], inv[0]) < tol and rel_err(runs[1], inv[1]) < 1e-5 and rel_err(runs[2], inv[2]) < 1e-5
    with monkeypatch.context() as m:  # a bfloat16 X's products in 3xTF32 instead: float32's accuracy alike
        m.setattr(kernel, "MIX_BF16", False)
        tf32 = mhc.hc_pre(X, fn, base, scale, 20, 1e-6, 1e-6)
    assert rel_err(tf32[0], u) < tol and rel_err(tf32[1], post) < 1e-5 and rel_err(tf32[2], comb) < 1e-5
    assert rel_err(head_runs.cpu(), head_ref) < tol
    _poison_allocator(N * n * d * 4, dtype)
    head = mhc.hc_head(X, fh, bh, scale[:1], 1e-6, 1e-6)
    assert torch.isfinite(head).all() and rel_err(head.cpu(), head_ref) < tol
    _poison_allocator(N * n * d * 4, dtype)
    out = mhc.hc_post(y, X, post_ref.cuda(), comb_ref.cuda())
    assert out.dtype == dtype and torch.isfinite(out).all() and rel_err(out.cpu(), out_ref) < tol
    for wide in (1, N + 1):  # the write-back's two tiles (by N): the same bits
        with monkeypatch.context() as m:
            m.setattr(kernel, "POST_WIDE_TOKENS", wide)
            assert torch.equal(mhc.hc_post(y, X, post_ref.cuda(), comb_ref.cuda()), out)
    # with the sub-block's norm folded in: the twin's collapse then RMSNorm, and on the GPU the collapse followed
    # by the RMSNorm kernel (its own reduction order: within the tolerance)
    from dsv4.kernels.norm import rms_norm

    w = torch.rand(d, device="cuda", generator=g).to(dtype) + 0.5
    normed, post_n, comb_n = mhc.hc_pre(X, fn, base, scale, 20, 1e-6, 1e-6, w)
    normed_ref = mhc.hc_pre(*cpu(X, fn, base, scale), 20, 1e-6, 1e-6, w.cpu())[0]
    assert rel_err(normed.cpu(), normed_ref) < tol and torch.equal(post_n, post) and torch.equal(comb_n, comb)
    assert rel_err(normed, rms_norm(u, w, 1e-6)) < tol
    head_n = mhc.hc_head(X, fh, bh, scale[:1], 1e-6, 1e-6, w)
    assert rel_err(head_n.cpu(), mhc.hc_head(*cpu(X, fh, bh, scale[:1]), 1e-6, 1e-6, w.cpu())) < tol
    assert rel_err(head_n, rms_norm(head, w, 1e-6)) < tol


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N, d", [(1, 4096), (3, 64), (70, 1000), (300, 4096)])
@pytest.mark.parametrize("block", [64, 32])
def test_mhc_write_back_with_partials_matches_apart(dtype, N, d, block, monkeypatch):
    """kernels.mhc.hc_post_mix (the write-back computing the next collapse's mixing partials, POST_MIX) against
    the write-back's torch twin on the CPU and, fed to hc_pre, against hc_pre reading the streams it wrote; with
    one chunk a program and in runs (``mix_loop``), both chunk widths (``POST_MIX_BLOCK``); a token's bits
    whatever N under batch invariance."""
    from dsv4.kernels import mhc as kernel
    from dsv4.model import mhc
    from dsv4.model.rows import fixed_rows

    monkeypatch.setattr(kernel, "POST_MIX_BLOCK", block)
    g = torch.Generator(device="cuda").manual_seed(N + d)
    n = 4
    X = torch.randn(N, n, d, device="cuda", generator=g).to(dtype)
    y = torch.randn(N, d, device="cuda", generator=g).to(dtype)
    fn = torch.randn((2 + n) * n, n * d, device="cuda", generator=g) * 0.1
    base = torch.randn((2 + n) * n, device="cuda", generator=g)
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    w = torch.rand(d, device="cuda", generator=g).to(dtype) + 0.5
    post = torch.rand(N, n, device="cuda", generator=g) * 2
    comb = torch.rand(N, n, n, device="cuda", generator=g)
    comb = comb / comb.sum(dim=1, keepdim=True)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    out_ref = mhc.hc_post(*[t.cpu() for t in (y, X, post, comb)])
    for runs in (False, True):
        with monkeypatch.context() as m:
            if runs:  # runs of MIX_LOOP chunks a program (a prefill chunk's thousands of tokens)
                m.setattr(kernel, "MIX_PROGRAMS", 1)
            _poison_allocator(N * n * d * 4, dtype)
            out, P = kernel.hc_post_mix(y, X, post, comb, fn)
            assert out.dtype == dtype and rel_err(out.cpu(), out_ref) < tol
            assert P.shape[1] == n * -(-d // (block * kernel.mix_loop(N, n * d, False)))
            fused = mhc.hc_pre(out, fn, base, scale, 20, 1e-6, 1e-6, w, mix=mhc.Mix(fn, P))
            apart = mhc.hc_pre(out, fn, base, scale, 20, 1e-6, 1e-6, w)
        assert rel_err(fused[0], apart[0]) < tol and rel_err(fused[1], apart[1]) < 1e-5
        assert rel_err(fused[2], apart[2]) < 1e-5
    twin = mhc.hc_pre(*[t.cpu() for t in (out, fn, base, scale)], 20, 1e-6, 1e-6, w.cpu())
    assert all(rel_err(a.cpu(), b) < (tol if i == 0 else 1e-5) for i, (a, b) in enumerate(zip(fused, twin)))
    with pytest.raises(ValueError, match="other mixing rows"):
        mhc.hc_pre(out, fn.clone(), base, scale, 20, 1e-6, 1e-6, w, mix=mhc.Mix(fn, P))
    with fixed_rows():  # batch invariance: a token's bits whatever N
        few = min(N, 3)
        a = kernel.hc_post_mix(y, X, post, comb, fn, invariant=True)
        b = kernel.hc_post_mix(y[:few], X[:few], post[:few], comb[:few], fn, invariant=True)
    assert torch.equal(a[0][:few], b[0]) and torch.equal(a[1][:few], b[1])
