"""The few-row bf16 GEMV (dsv4.kernels.bf16_gemv) against the product in float64 and cuBLAS, each row against the
row alone, and which products take it. Skipped without CUDA (run on the device machine: `pytest -m cuda`)."""

import pytest
import torch

from .test_kernels_cuda import rel_err

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("N, K", [(2624, 4096), (1024, 4096), (100, 512), (5, 1024), (129280, 1024), (256, 96),
                                  (100, 384)])
@pytest.mark.parametrize("bn", [None, 4, 16])
@pytest.mark.parametrize("M", [1, 2, 3, 4])
def test_bf16_row_kernel_matches_the_product(N, K, bn, M):
    """Fused compressor widths, a ratio-128 layer's, N not a multiple of BLOCK_N, N below it, the head's N, mini's
    widths (K 96 and 384: chunks of 32 and 128 inputs), at 1 to
    4 rows: within cuBLAS's own error of the float64 product (both round the output to bf16), and each row bit for
    bit the row alone (an MTP verify step's rows round as MTP off's one row does)."""
    from dsv4.kernels import bf16_gemv

    g = torch.Generator(device="cuda").manual_seed(N + K)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    ref = x.double() @ w.double().t()
    out = bf16_gemv.launch(x, w, bn)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    e_cublas = rel_err(torch.nn.functional.linear(x, w).double(), ref)
    assert rel_err(out.double(), ref) <= 1.5 * e_cublas + 1e-4
    if M > 1:
        assert torch.equal(out, torch.cat([bf16_gemv.launch(x[r:r + 1], w, bn) for r in range(M)]))


@pytest.mark.parametrize("G, N, K", [(8, 1024, 4096), (3, 100, 512)])
def test_bf16_row_kernel_grouped_matches_the_product(G, N, K):
    """Grouped products (the attention's wo_a with bf16 weights: Flash's 8 groups, and groups of N not a multiple
    of BLOCK_N) at 1 to 4 rows: within cuBLAS's own error of the float64 product, each row bit for bit the row
    alone; ``rows.grouped_linear`` takes the kernel there, and from 5 rows one batched GEMM that stores into the
    [M, G, N] layout itself (contiguous: no copy after it), within cuBLAS's error as einsum."""
    from dsv4.kernels import bf16_gemv
    from dsv4.model import rows

    g = torch.Generator(device="cuda").manual_seed(G + N)
    w = (torch.randn(G, N, K, device="cuda", generator=g) * 0.02).bfloat16()
    x = torch.randn(5, G, K, device="cuda", generator=g).bfloat16()
    alone = torch.cat([bf16_gemv.grouped_linear(x[r:r + 1], w) for r in range(4)])
    for M in range(1, 5):
        assert bf16_gemv.grouped_usable(x[:M], w)
        out = rows.grouped_linear(x[:M], w)
        ref = torch.einsum("mgk,gnk->mgn", x[:M].double(), w.double())
        assert out.shape == (M, G, N) and out.dtype == torch.bfloat16
        e_cublas = rel_err(torch.einsum("mgk,gnk->mgn", x[:M], w).double(), ref)
        assert rel_err(out.double(), ref) <= 1.5 * e_cublas + 1e-4
        assert torch.equal(out, alone[:M]), M
    assert not bf16_gemv.grouped_usable(x, w)  # five rows: the batched GEMM
    assert rel_err(rows.grouped_linear(x, w).double(), torch.einsum("mgk,gnk->mgn", x.double(), w.double())) < 1e-2
    big = torch.randn(300, G, K, device="cuda", generator=g).bfloat16()
    out = rows.grouped_linear(big, w)
    ref = torch.einsum("mgk,gnk->mgn", big.double(), w.double())
    e_cublas = rel_err(torch.einsum("mgk,gnk->mgn", big, w).double(), ref)
    assert out.is_contiguous() and rel_err(out.double(), ref) <= 1.5 * e_cublas + 1e-4


def test_bf16_row_kernel_takes_one_to_four_bf16_rows_only(monkeypatch):
    """``model.rows.linear`` runs the kernel for one to four bf16 rows (any leading shape), and cuBLAS for five
    rows, an fp32 weight, K not whole chunks, with ENABLED off, and under fixed_rows of more than four rows; a K
    that differs from the weight's gets F.linear's error."""
    from dsv4.kernels import bf16_gemv
    from dsv4.model import rows

    calls, real = [], bf16_gemv.launch
    monkeypatch.setattr(bf16_gemv, "launch", lambda x, w, bn=None: calls.append(w.shape) or real(x, w, bn))
    w = torch.randn(256, 1024, device="cuda").bfloat16()
    x = torch.randn(1, 1, 1024, device="cuda").bfloat16()
    assert torch.equal(rows.linear(x, w), real(x.view(1, -1), w).view(1, 1, -1)) and calls == [w.shape]
    x4 = torch.randn(2, 2, 1024, device="cuda").bfloat16()
    assert torch.equal(rows.linear(x4, w), real(x4.view(4, -1), w).view(2, 2, -1)) and len(calls) == 2
    calls.clear()
    rows.linear(torch.randn(5, 1024, device="cuda").bfloat16(), w)
    rows.linear(x.float(), w.float())
    rows.linear(x[..., :1000], w[:, :1000].contiguous())
    with rows.fixed_rows(8):
        rows.linear(x, w)
    with pytest.raises(RuntimeError):  # K of x and of the weight differ: torch's error, not a read past the row
        rows.linear(x[..., :512], w)
    monkeypatch.setattr(bf16_gemv, "ENABLED", False)
    rows.linear(x, w)
    assert calls == []
