"""The MTP catch-up pass over the rows its window keeps (``engine/mtp_rows.py``) against the pass over every row
of the step it stands for: the same drafts and tokens at every step, and the same window rows of every layer
(bit for bit under batch invariance, where a row's products do not depend on how many rows the pass has; close
otherwise), through long prompts prefilled in chunks, paused steps with their keep-up passes, probes, eagerly
and on the CUDA graphs' static buffers (prefill buckets longer and shorter than the kept rows)."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.engine import mtp_rows
from dsv4.engine.mtp_rows import host_keep, one_request_keep, padded, row_counts
from dsv4.engine.runner import ModelRunner
from dsv4.engine.spec_pause import DraftPause

from .traces import assert_same_steps, run_traced


def test_the_kept_rows_are_each_requests_last_swa_cap():
    assert host_keep([3, 1, 2], 4) is None  # no request adds more than the ring keeps: the whole step
    assert host_keep([6, 1, 5], 4) == [2, 3, 4, 5, 6, 8, 9, 10, 11]
    assert one_request_keep(torch.tensor([6, 0]), 4).tolist() == [2, 3, 4, 5]
    assert one_request_keep(torch.tensor([2, 0]), 4).tolist() == [0, 1, -1, -1]  # short chunk: inert rows


def test_kept_rows_are_padded_to_the_row_counts_warmup_runs(monkeypatch):
    """A kept-rows pass runs at a power of two from 64 rows (inert rows after the kept ones), or at the most rows a
    step can keep where that is less; warmup runs the keep-up and the whole MTP pass once at each of those counts,
    over inert rows as wide as a step's window tables."""
    assert padded([4, 5, 6]) == [4, 5, 6] + [-1] * 61
    assert len(padded(list(range(65)))) == 128 and len(padded(list(range(128)))) == 128
    # never past the most rows a step can keep (then that count itself)
    assert len(padded(list(range(129)), 200)) == 200 and len(padded([1, 2], 40)) == 40
    assert len(padded(list(range(129)), 256)) == 256
    assert row_counts(40) == [40] and row_counts(200) == [64, 128, 200] and row_counts(256) == [64, 128, 256]
    for largest in (40, 64, 200, 256):  # every padded count is one warmup runs
        assert {len(padded(list(range(n)), largest)) for n in range(1, largest + 1)} == set(row_counts(largest))
    widths = []
    real = mtp_rows.select
    monkeypatch.setattr("dsv4.engine.runner.select", lambda t, keep, base: widths.append(t.swa_read.shape[1]) or
                        real(t, keep, base))
    seen = []
    inert = mtp_rows.inert
    monkeypatch.setattr("dsv4.engine.runner.inert", lambda M, W, dev: seen.append((M, W)) or inert(M, W, dev))
    llm = LLM("tiny", max_batch_size=16, max_num_tokens=200, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    # (at most 16 requests x swa_cap = 10 kept rows a step)
    assert "MTP passes over kept rows, 64 to 160 rows" in llm.warmup_paths
    assert [M for M, _ in seen] == [64, 128, 160]
    assert widths and {W for _, W in seen} == set(widths)  # (the warmup's requests' kept-rows passes)
    calls = []
    eng = llm.engine
    keep_up = eng.model.mtp_keep_up
    eng.model.mtp_keep_up = lambda X, *a: calls.append(X.shape[0]) or keep_up(X, *a)
    eng.pause = DraftPause(1.0, window=1, probe_every=3)
    eng.pause.pause_now()
    rng = random.Random(1)
    out = llm.generate([[rng.randrange(2, 256) for _ in range(n)] for n in (90, 30)],
                       SamplingParams(max_tokens=3, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 3 for o in out)
    assert calls and calls[0] == 64  # (one prompt step: each prompt's last swa_cap rows, padded)


def _run(tail: bool, invariant: bool, graphs: bool, pause: bool, monkeypatch):
    monkeypatch.setattr(ModelRunner, "mtp_tail_rows", tail)
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (70, 23, 5, 41, 12)]
    kw = {"cuda_graph_config": {"enable_padding": True, "batch_sizes": [1, 2, 4],
                                "prefill_token_sizes": [8, 16, 32]}} if graphs else {}
    llm = LLM("tiny", warmup=False, max_batch_size=4, max_num_tokens=32, max_seq_len=256,
              kv_cache_config={"max_tokens": 4096}, batch_invariant=invariant,
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2}, **kw)
    eng = llm.engine
    if pause:
        eng.pause = DraftPause(1.0, window=1, probe_every=3)
    rids = [eng.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    trace = run_traced(eng, rids, rings=True)
    replays = eng.runner.graphs.num_prefill_replays if eng.runner.graphs is not None else 0
    return trace, replays


@pytest.mark.parametrize("graphs,pause", [(False, False), (False, True), (True, False), (True, True)])
def test_kept_rows_pass_equals_the_whole_steps_pass_when_batch_invariant(graphs, pause, monkeypatch):
    if graphs:
        monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    (tail, replays), (whole, _) = (_run(t, True, graphs, pause, monkeypatch) for t in (True, False))
    assert_same_steps(tail, whole)
    assert any(d for seen, _ in tail for d, _ in seen)  # it drafted
    if graphs:
        assert replays > 0  # prefill buckets replayed (chunks of 32 > swa_cap, and shorter ones)


def test_kept_rows_pass_is_close_to_the_whole_steps_pass(monkeypatch):
    """Without batch invariance the subset's GEMMs have other row counts: the rings agree to rounding, and the
    drafts and tokens (fp32) are the same."""
    (tail, _), (whole, _) = (_run(t, False, False, False, monkeypatch) for t in (True, False))
    assert len(tail) == len(whole)
    for (seen, rings), (seen_b, rings_b) in zip(tail, whole):
        assert seen == seen_b
        for x, y in zip(rings, rings_b):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
