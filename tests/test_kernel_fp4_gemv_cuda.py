"""dsv4.kernels.fp4_gemv's fused first half of the experts (w1, w3 and the SwiGLU with the routing weight in one
launch) against float64 products of the decoded weights and against its torch twin ``moe.gate_up_torch``. Skipped
without CUDA (run on the device machine: `pytest -m cuda`)."""

import pytest
import torch

from .test_kernels_cuda import rel_err

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("E, I, d, N, k, limit, config", [
    (128, 2048, 4096, 1, 6, 10.0, None),  # Flash's experts at batch 1 (flash-E128), the default tile
    (8, 96, 160, 5, 2, 0.0, None),        # I not a whole tile, K = 160 not a whole BLOCK_K, no clamp
    (4, 64, 512, 7, 3, 0.3, None),        # several pairs per expert (pairs of rows, an odd one), a clamp that bites
    (4, 64, 512, 7, 3, 0.3, {"BLOCK_N": 32, "BLOCK_K": 128}),
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
