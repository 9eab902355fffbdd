"""The one-row bf16 GEMV (dsv4.kernels.bf16_gemv) against the product in float64 and cuBLAS, and which products
take it. Skipped without CUDA (run on the device machine: `pytest -m cuda`)."""

import pytest
import torch

from .test_kernels_cuda import rel_err

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("N, K", [(2624, 4096), (1024, 4096), (100, 512), (5, 1024), (129280, 1024)])
@pytest.mark.parametrize("bn", [None, 4, 16])
def test_bf16_row_kernel_matches_the_product(N, K, bn):
    """Fused compressor widths, a ratio-128 layer's, N not a multiple of BLOCK_N, N below it, the head's N:
    within cuBLAS's own error of the float64 product (both round the output to bf16)."""
    from dsv4.kernels import bf16_gemv

    g = torch.Generator(device="cuda").manual_seed(N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(1, K, device="cuda", generator=g).bfloat16()
    ref = x.double() @ w.double().t()
    out = bf16_gemv.launch(x, w, bn)
    assert out.shape == (1, N) and out.dtype == torch.bfloat16
    e_cublas = rel_err(torch.nn.functional.linear(x, w).double(), ref)
    assert rel_err(out.double(), ref) <= 1.5 * e_cublas + 1e-4


def test_bf16_row_kernel_takes_one_bf16_row_only(monkeypatch):
    """``model.rows.linear`` runs the kernel for one bf16 row (any leading shape), and cuBLAS for two rows, an
    fp32 weight, K not whole chunks, with ENABLED off, and under fixed_rows; a K that differs from the weight's
    gets F.linear's error."""
    from dsv4.kernels import bf16_gemv
    from dsv4.model import rows

    calls, real = [], bf16_gemv.launch
    monkeypatch.setattr(bf16_gemv, "launch", lambda x, w, bn=None: calls.append(w.shape) or real(x, w, bn))
    w = torch.randn(256, 1024, device="cuda").bfloat16()
    x = torch.randn(1, 1, 1024, device="cuda").bfloat16()
    assert torch.equal(rows.linear(x, w), real(x.view(1, -1), w).view(1, 1, -1)) and calls == [w.shape]
    calls.clear()
    rows.linear(torch.randn(2, 1024, device="cuda").bfloat16(), w)
    rows.linear(x.float(), w.float())
    rows.linear(x[..., :1000], w[:, :1000].contiguous())
    with rows.fixed_rows(4):
        rows.linear(x, w)
    with pytest.raises(RuntimeError):  # K of x and of the weight differ: torch's error, not a read past the row
        rows.linear(x[..., :512], w)
    monkeypatch.setattr(bf16_gemv, "ENABLED", False)
    rows.linear(x, w)
    assert calls == []
