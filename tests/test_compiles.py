"""dsv4.kernels.compiles: Triton compiles after warmup are recorded and logged, through Triton's own hooks.

On the CPU (no Triton) a stand-in ``triton.knobs`` module plays Triton's part, calling the hooks as
``JITFunction._do_compile`` does; on CUDA a real kernel compiles."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from dsv4.bench.report import format_report
from dsv4.kernels.compiles import Compile, CompileWatch


@pytest.fixture
def fake_triton(monkeypatch):
    """A ``triton`` module with ``knobs.runtime`` hooks, and a compile that calls them as Triton does."""
    seen = []
    runtime = types.SimpleNamespace(jit_cache_hook=None,
                                    jit_post_compile_hook=lambda **kw: seen.append(kw["key"]))  # a hook set earlier
    knobs = types.SimpleNamespace(runtime=runtime)
    monkeypatch.setitem(sys.modules, "triton", types.SimpleNamespace(knobs=knobs))
    monkeypatch.setitem(sys.modules, "triton.knobs", knobs)

    def compile_(name: str, key: str):
        fn = types.SimpleNamespace(name=name)
        if runtime.jit_cache_hook is not None and runtime.jit_cache_hook(key=key, repr=f"{name}[{key}]", fn=fn):
            return
        if runtime.jit_post_compile_hook is not None:
            runtime.jit_post_compile_hook(key=key, repr=f"{name}[{key}]", fn=fn)

    return compile_, seen


def test_compiles_after_the_mark_are_recorded_and_logged(fake_triton, caplog):
    compile_, seen = fake_triton
    w = CompileWatch()
    w.quiet()  # a warmup starts: installs the hooks, no warnings
    with caplog.at_level(logging.WARNING, logger="dsv4"):
        compile_("_warm_kernel", "a")
        mark = w.mark()
        compile_("_late_kernel", "b")
        w.quiet()
        compile_("_next_warmup_kernel", "c")
    assert [c.kernel for c in w.compiles] == ["_warm_kernel", "_late_kernel", "_next_warmup_kernel"]
    assert [c.kernel for c in w.since(mark)][:1] == ["_late_kernel"] and w.compiles[1].specialization == "_late_kernel[b]"
    assert all(c.ms >= 0 for c in w.compiles)
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "_late_kernel compiled after warmup" in warned[0]
    assert seen == ["a", "b", "c"]  # the hook set before ours still runs
    assert w.install() and len(w.compiles) == 3  # installed once: a second install adds no second hook
    compile_("_again", "d")
    assert len(w.compiles) == 4 and seen[-1] == "d"
    compile_("_x.<locals>.nested_kernel", "e")  # Triton names a nested function by its qualified name
    assert w.compiles[-1].kernel == "nested_kernel"


def test_without_triton_nothing_is_watched(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    w = CompileWatch()
    assert not w.install()
    assert w.mark() == 0 and w.since(0) == []


def test_the_bench_report_names_kernels_compiled_in_the_run():
    """dsv4-bench's text report: the run's compiles, their time and kernels, in the request section."""
    from dsv4.bench import report

    rep = {"requests": {"kernels_compiled": [{"kernel": "_k1", "ms": 120.0, "specialization": "x"},
                                             {"kernel": "_k1", "ms": 30.0, "specialization": "y"}]}}
    line = [x for x in _request_lines(report, rep) if "Kernels compiled" in x]
    assert len(line) == 1 and "2 (150 ms" in line[0] and "_k1" in line[0]
    rep["requests"]["kernels_compiled"] = []
    assert not [x for x in _request_lines(report, rep) if "Kernels compiled" in x]


def _request_lines(report, rep) -> list[str]:
    """format_report's lines for a report whose other sections are filled with a real run's shape."""
    full = _stub_report()
    full["requests"].update(rep["requests"])
    return format_report(full).splitlines()


def _stub_report() -> dict:
    dist = {"avg": 1.0, "min": 1.0, "p50": 1.0, "p90": 1.0, "p95": 1.0, "p99": 1.0, "max": 1.0}
    kv = {"dtype": "fp8", "tokens_per_block": 128, "free_gpu_memory_fraction": 0.9,
          "free_gpu_memory_fraction_from": "yaml", "total_bytes": 1, "slots_bytes": 1, "num_slots": 1,
          "blocks_bytes": 1, "num_blocks": 1, "token_capacity": 128, "summary": "KV cache: -"}
    return {"engine": {"model": "m", "model_path": "p", "model_kind": "k", "device": "cpu", "dtype": "fp32",
                       "cpu_threads": 1, "max_batch_size": 1, "max_num_tokens": 1, "max_seq_len": 2,
                       "parallel": {"tp": 1, "pp": 1, "ep": 1, "enable_attention_dp": False, "world_size": 1},
                       "speculative": None, "cuda_graphs": None, "overlap_scheduler": "on", "kv_cache": kv},
            "requests": {"dataset": "d", "num_requests": 1, "num_completed": 1, "num_failed": 0,
                         "stopped_early": None, "num_warmup": 0, "concurrency": 1, "input_len": dist,
                         "output_len": dist, "num_engine_steps": 1, "num_preemptions": 0},
            "performance": {"request_throughput_req_s": 1.0, "output_throughput_tok_s": 1.0,
                            "total_token_throughput_tok_s": 1.0, "per_user_output_speed_tok_s": 1.0,
                            "per_user_output_throughput_with_ctx_tok_s": 1.0,
                            "per_gpu_output_throughput_tok_s": 1.0, "total_time_s": 1.0, "request_latency_ms": dist,
                            "ttft_ms": dist, "tpot_ms": dist, "per_user_output_speed_dist_tok_s": dist},
            "timing_note": "-", "speculative": None, "notes": [], "errors": []}


@pytest.mark.cuda
def test_a_real_triton_compile_is_recorded():
    """Triton's own hooks: a kernel specialization never compiled before in this process is recorded by name
    (a fresh constexpr value makes it new), and its second launch is not."""
    import torch
    import triton
    import triton.language as tl

    from dsv4.kernels.compiles import COMPILES

    @triton.jit
    def _compiles_probe_kernel(x_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1)

    COMPILES.install()
    before = len(COMPILES.compiles)
    x = torch.zeros(64, device="cuda")
    _compiles_probe_kernel[(1,)](x, 64)
    _compiles_probe_kernel[(1,)](x, 64)
    torch.cuda.synchronize()
    new = COMPILES.since(before)
    assert [c.kernel for c in new] == ["_compiles_probe_kernel"] and isinstance(new[0], Compile)
    assert new[0].ms > 0 and x[0].item() == 2
