"""Weight-only FP8 linears on the GPU (dsv4.kernels.fp8_linear): the tensor-core kernel and the GEMV against
dequantise-then-GEMM in float64, and the engine with FP8 linears against its dequantised twin. Skipped without
CUDA (run on the device machine: `pytest -m cuda`)."""

import pytest
import torch

from .test_engine_cuda import _engine
from .test_kernels_cuda import rel_err

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M, G, N, K, split", [
    (1, 1, 1024, 4096, None),   # Flash's wq_a at batch 1: split-K
    (32, 1, 4096, 8192, None),  # wo_b at batch 32
    (5, 8, 1024, 4096, None),   # wo_a: 8 groups
    (32, 8, 1024, 4096, None),  # wo_a at batch 32: 256 rows x groups, 32 rows of the product (the kernel's)
    (3, 3, 64, 300, None),      # groups of 64 rows: a scale block spans two groups; K ends inside a block
    (128, 1, 200, 1000, 3),     # fixed_rows' chunk, forced split, N and K not multiples of a tile
    (17, 1, 32768, 1024, 1),
    (2, 1, 200, 1000, None),    # the GEMV: N not a multiple of its tile, K ending inside a block
    (4, 8, 1024, 4096, None),   # wo_a at MTP k = 3's verify, concurrency 1 (the GEMV, grouped)
    (3, 1, 4096, 8192, 2),      # the GEMV with a forced split
    (1, 1, 32768, 1024, None),  # wq_b at batch 1: the GEMV with 32 outputs a program (gemv_block_n)
    (1, 8, 1024, 4096, None),   # wo_a at batch 1: 16 a program, inside one scale block row
    (1, 1, 200, 1000, None),    # one row (the GEMV's scale-block loop), K ending inside a block
    (1, 1, 300, 1000, 2),       # one row, a forced split whose second part ends inside a block
    (1, 1, 1536, 4096, 2),      # the one-row kernel with a forced split (wq_a + wkv)
    (1, 1, 4096, 8192, None),   # wo_b at batch 1: the one-row kernel, N a multiple of its tile
    (2, 1, 32768, 1024, None),  # wq_b at MTP k = 1's verify, concurrency 1: the row kernel, two rows
    (3, 1, 1536, 4096, 2),      # three rows with a forced split (wq_a + wkv, k = 2)
])
def test_fp8_linear_kernel_matches_twin(dtype, M, G, N, K, split):
    """The weight-only FP8 kernels (tensor cores, and the GEMV where it fits; split-K or not, grouped or not)
    against dequantise-then-GEMM in fp64; a wrong scale fails each."""
    from dsv4.checkpoint.quant import e8m0_to_float, quant_fp8_block
    from dsv4.kernels import fp8_linear as f8

    g = torch.Generator(device="cuda").manual_seed(M * 7 + N)
    q, s = quant_fp8_block(torch.randn(G * N, K, device="cuda", generator=g) * 0.05)
    s = e8m0_to_float(s)
    w = q.view(G, N, K)
    x = torch.randn(M, G, K, device="cuda", generator=g).to(dtype)
    ref = torch.einsum("mgk,gnk->mgn", x.double(), f8.dequantize(w, s, torch.float64))
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    wrong = s.clone()
    wrong[-1, -1] *= 4  # the last block: the last group's last outputs, its last inputs
    r = min(N, G * N - (G * N - 1) // 128 * 128)
    paths = [(False, None)]  # (gemv, config): the tensor cores, the GEMV (forced past its rows), the row kernel
    if M <= 4 and f8.gemv_shape(G, N):
        paths.append((True, None))
    if f8.row_kernel_fits(M, G, N, K, w):
        paths += [("row", None), ("row", {"PREFETCH": False}), ("row", {"BLOCK_N": 8, "BLOCK_K": 1024})]
    for gemv, cfg in paths:
        out = f8._launch(x, w, s, config=cfg, split=split, gemv=gemv)
        assert out.dtype == dtype and out.shape == (M, G, N)
        assert rel_err(out, ref) < tol, (gemv, cfg, rel_err(out, ref))
        bad = f8._launch(x, w, wrong, config=cfg, split=split, gemv=gemv)
        assert rel_err(bad[:, -1, -r:], ref[:, -1, -r:]) > 10 * tol, (gemv, cfg)
    if G == 1:  # the engine's calls: the GEMV where it fits (one row)
        assert rel_err(f8.fp8_linear(x[:, 0], q, s), ref[:, 0]) < tol
    else:
        assert f8.usable(x, w, M)  # a grouped product's rows are x's rows, not rows x groups
        assert rel_err(f8.grouped_fp8_linear(x, w, s), ref) < tol


@pytest.mark.parametrize("G, N, K, split", [(1, 4096, 8192, None), (8, 1024, 4096, None), (1, 1536, 4096, 2)])
def test_fp8_row_kernel_gives_each_row_the_bits_it_gets_alone(G, N, K, split):
    """The row kernel on 2, 3 and 4 rows (an MTP verify step of one request): each row's outputs are bit for bit
    those of the row alone (one accumulator a row, the same operations whatever the rows), so MTP on and off
    round its products alike; and within the twin's tolerance."""
    from dsv4.checkpoint.quant import e8m0_to_float, quant_fp8_block
    from dsv4.kernels import fp8_linear as f8

    g = torch.Generator(device="cuda").manual_seed(N + K + G)
    q, s = quant_fp8_block(torch.randn(G * N, K, device="cuda", generator=g) * 0.05)
    s = e8m0_to_float(s)
    w = q.view(G, N, K)
    x = torch.randn(f8.ROW_MAX_ROWS, G, K, device="cuda", generator=g).bfloat16()
    alone = torch.cat([f8._launch(x[r:r + 1], w, s, split=split) for r in range(len(x))])
    ref = torch.einsum("mgk,gnk->mgn", x.double(), f8.dequantize(w, s, torch.float64))
    assert rel_err(alone, ref) < 1e-2
    for M in range(2, f8.ROW_MAX_ROWS + 1):
        assert f8.row_kernel_fits(M, G, N, K, w)
        assert torch.equal(f8._launch(x[:M], w, s, split=split), alone[:M]), M


def test_engine_with_fp8_linears_on_cuda_equals_its_dequantised_twin():
    """fp32, CUDA graphs, MTP 2: tiny with FP8 linears gives the tokens of tiny whose linears are the same
    FP8-rounded weights, dequantised (so the FP8 kernel runs inside the engine's graphs and fused groups)."""
    from dsv4 import SamplingParams

    from .fp8_twin import round_fp8_linears

    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 4, [7] * 3, list(range(2, 90))]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    f8 = _engine("tiny", linear_format="fp8", speculative_config=spec)
    assert f8.model.layers[0].attn.wq_a.weight.dtype == torch.float8_e4m3fn
    twin = _engine("tiny", speculative_config=spec)
    round_fp8_linears(twin.model)
    out = [o.outputs[0].token_ids for o in f8.generate(prompts, sp)]
    assert f8.engine.runner.graphs.num_replays > 0
    assert out == [o.outputs[0].token_ids for o in twin.generate(prompts, sp)]


def test_engine_at_flash_widths_takes_the_one_row_kernel_and_equals_its_dequantised_twin(monkeypatch):
    """fp32, CUDA graphs, one request at a time on flash-L2-E8 (Flash's widths: each decode step's FP8 products
    are one row with K in whole 512-input chunks, so they take ``_fp8_row_kernel`` inside the captured graphs):
    the greedy tokens of the same FP8-rounded weights dequantised, and the one-row kernel ran."""
    from dsv4 import SamplingParams
    from dsv4.kernels import fp8_linear

    from .fp8_twin import round_fp8_linears

    launches, real = [], fp8_linear._launch_row
    monkeypatch.setattr(fp8_linear, "_launch_row", lambda *a: launches.append(a[1].shape) or real(*a))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 4, list(range(2, 90))]
    sp = SamplingParams(max_tokens=12, ignore_eos=True)
    f8 = _engine("flash-L2-E8", linear_format="fp8")
    out = [f8.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    assert f8.engine.runner.graphs.num_replays > 0 and launches
    del f8
    twin = _engine("flash-L2-E8")
    round_fp8_linears(twin.model)
    assert out == [twin.generate([p], sp)[0].outputs[0].token_ids for p in prompts]


def test_early_release_with_weights_read_before_the_wait_gives_the_same_bits(monkeypatch):
    """bf16, CUDA graphs, one request at a time on flash-L2-E8 with FP8 linears (Flash's widths: the one-row FP8
    and bf16 GEMVs take every one-row product): with early release (``kernels.pdl``; the default in one-row
    passes: each kernel releases its successor right after its wait, the two GEMVs read their first chunk of
    weight before theirs) the tokens and logprobs of the same engine without (``pdl.set_release(False)``), bit for
    bit; both GEMVs ran releasing inside the graphs. Fails if an early read touched anything a predecessor
    writes."""
    from dsv4 import LLM, SamplingParams
    from dsv4.kernels import bf16_gemv, fp8_linear, pdl

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper")
    ran, row, b16 = [], fp8_linear._launch_row, bf16_gemv.launch
    monkeypatch.setattr(fp8_linear, "_launch_row", lambda *a: ran.append(("fp8", pdl.releasing())) or row(*a))
    monkeypatch.setattr(bf16_gemv, "launch",
                        lambda *a, **k: ran.append(("bf16", pdl.releasing())) or b16(*a, **k))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 4, list(range(2, 90))]
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    outs = []
    for release in (False, None):
        pdl.set_release(release)
        try:
            with pdl.pass_rows(1):
                assert pdl.args()["PDL"] == (pdl.RELEASE if release is None else pdl.WAIT)
            llm = LLM("flash-L2-E8", device="cuda", dtype="bf16", max_batch_size=8, max_num_tokens=128,
                      max_seq_len=512, kv_cache_config={"max_tokens": 8192}, linear_format="fp8")
            outs.append([(o.outputs[0].token_ids, o.outputs[0].logprobs)
                         for p in prompts for o in llm.generate([p], sp)])
            assert llm.engine.runner.graphs.num_replays > 0
            del llm
        finally:
            pdl.set_release(None)
    assert {("fp8", True), ("bf16", True), ("fp8", False), ("bf16", False)} <= set(ran)
    assert outs[0] == outs[1]
