"""Batch invariance (``EngineConfig.batch_invariant``, ``dsv4/model/rows.py``): every projection runs on chunks of
exactly ``ROWS`` rows, so a row's result does not depend on what else the step holds; with it bf16 greedy
output with MTP on equals MTP off (the CUDA test; on the CPU fp32 is exact either way, so the CPU tests check
the mechanism: the row counts every GEMM sees, and that nothing else changes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4 import LLM, SamplingParams
from dsv4.builtin import heldout_prompts
from dsv4.model import rows


def test_linear_on_fixed_rows_equals_the_plain_product():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 16, generator=g)
    x = torch.randn(2, 11, 16, generator=g)
    wg = torch.randn(3, 5, 7, generator=g)
    xg = torch.randn(10, 3, 7, generator=g)
    with rows.fixed_rows(8):
        assert rows.active()
        got, got_g = rows.linear(x, w), rows.grouped_linear(xg, wg)
        first = rows.linear(x[:1, :3], w)  # the same rows in a smaller batch: the very same values
    assert not rows.active()
    torch.testing.assert_close(got, F.linear(x, w))
    torch.testing.assert_close(got_g, torch.einsum("ngi,goi->ngo", xg, wg))
    assert torch.equal(first, got[:1, :3])


def test_every_gemm_of_an_invariant_step_sees_the_same_row_count(monkeypatch):
    """The engine enters ``fixed_rows`` around its passes: every projection of every step (prefill chunks,
    verify and draft passes) multiplies exactly ROWS rows; without the setting they see the step's own sizes."""
    seen = []
    real = F.linear

    def spy(x, w, *a):
        seen.append(x.reshape(-1, x.shape[-1]).shape[0])
        return real(x, w, *a)

    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40] * 20]
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    mtp = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    ref = LLM("tiny", warmup=False, max_seq_len=64).generate(prompts, sp)
    outs = {}
    for invariant in (False, True):
        llm = LLM("tiny", warmup=False, max_seq_len=64, speculative_config=mtp, batch_invariant=invariant)
        monkeypatch.setattr(F, "linear", spy)
        seen.clear()
        outs[invariant] = llm.generate(prompts, sp)
        monkeypatch.setattr(F, "linear", real)
        assert seen
        if invariant:
            assert set(seen) == {rows.ROWS}, sorted(set(seen))
        else:
            assert rows.ROWS not in seen and len(set(seen)) > 2  # prefill, verify (3 rows each) and draft sizes
    for a, b, c in zip(ref, outs[False], outs[True]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids


def test_the_setting_is_validated():
    with pytest.raises(ValueError, match="batch_invariant"):
        LLM("tiny", warmup=False, batch_invariant="yes")


@pytest.mark.cuda
def test_bf16_mtp_on_equals_off_when_batch_invariant():
    """The trained mini at concurrency 32 in bf16: without the setting about a fifth of the tokens differ
    between MTP on and off (BENCHMARKS.md); with it every token is the same (each prompt prefilled alone, in
    chunks of 2048 tokens, then decode / verify steps only)."""
    prompts = heldout_prompts()[:32]
    sp = SamplingParams(max_tokens=48, ignore_eos=True)
    outs = []
    for k in (0, 2):
        spec = {"decoding_type": "MTP", "num_nextn_predict_layers": k} if k else None
        llm = LLM("mini", device="cuda", dtype="bf16", max_batch_size=32, max_seq_len=1024, max_num_tokens=2048,
                  speculative_config=spec, batch_invariant=True)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
        if k:
            assert llm.get_stats()["speculative"]["acceptance_rate"] > 0.5
        del llm
    same = sum(a == b for x, y in zip(*outs) for a, b in zip(x, y))
    assert outs[0] == outs[1], f"{same} of {32 * 48} tokens identical"


def test_the_kernel_path_keeps_one_attention_path(monkeypatch):
    """The decode-like kernel path (its torch twins and the graphs' static buffers on the CPU) takes the
    attention's single pass in every step under the setting, and the step's own choice without it."""
    from dsv4.engine import cuda_backend

    monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    splits = []
    real = cuda_backend.sparse_sink_attention

    def spy(q, sources, sink, scale, split=None, q_norm=None):
        splits.append(split)
        return real(q, sources, sink, scale, split, q_norm)

    monkeypatch.setattr(cuda_backend, "sparse_sink_attention", spy)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    mtp = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    outs = []
    for invariant in (False, True):
        splits.clear()
        llm = LLM("tiny", warmup=False, max_seq_len=64, speculative_config=mtp, batch_invariant=invariant)
        assert llm.engine.runner.use_kernels
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
        assert splits and set(splits) == ({0} if invariant else {None})
    assert outs[0] == outs[1]


def test_a_prefill_chunk_runs_alone_under_the_setting(monkeypatch):
    """Batch invariance schedules a prefill chunk alone (a prompt is chunked and computed the same whatever else
    runs) and decode / verify rows only with each other (they keep the decode kernels); tokens do not change."""
    from dsv4.engine.scheduler import Scheduler

    steps = []
    real = Scheduler.schedule

    def schedule(self):
        out = real(self)
        steps.append([not s.request.in_decode for s in out])  # a prefill chunk (not the newest token alone)
        return out

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    prompts = [[5 + i] * n for i, n in enumerate((5, 40, 12, 33, 7, 21))]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    mtp = {"decoding_type": "MTP", "num_nextn_predict_layers": 2}
    outs = []
    for invariant in (False, True):
        steps.clear()
        llm = LLM("tiny", warmup=False, max_seq_len=64, max_num_tokens=16, max_batch_size=4, speculative_config=mtp,
                  batch_invariant=invariant)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
        mixed = [s for s in steps if any(s) and (len(s) > 1)]
        if invariant:
            assert not mixed and sum(1 for s in steps if s and s[0]) >= len(prompts)
        else:
            assert mixed  # the default batches prefill chunks with each other and with decode rows
    assert outs[0] == outs[1]
