"""The overlap scheduler with MTP (a verify step is launched before the previous step's acceptance and drafts
are read back: its positions, inputs and drafts come from the device) against its twin, the same engine with
``disable_overlap_scheduler`` (each MTP step reads its own verdict): the same tokens, finish reasons, drafts
accepted and logprobs, through random workloads with chunked prefill, preemption, aborts, stop tokens and
sampled requests, the cache's integrity checked after every step (conftest)."""

from __future__ import annotations

import random

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.engine import runner as runner_mod
from dsv4.engine.proposer import KnownAnswerProposer, use_known_answers

from .traces import run_with_aborts


def _llm(overlap: bool, k: int, **kw):
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("max_num_tokens", 48)  # prompts over 48 tokens prefill in chunks
    kw.setdefault("max_seq_len", 256)
    kw.setdefault("kv_cache_config", {"max_tokens": 4096})
    # (drafting never paused: overlapped and synchronous runs read acceptance back at different steps, so a pause
    # would start at different steps and their acceptance counts differ; tests/test_spec_pause.py pauses)
    return LLM("tiny", warmup=False, disable_overlap_scheduler=not overlap,
               speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k,
                                   "pause_below_acceptance": 0}, **kw)


def _workload(n: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randint(1, 110))] for _ in range(n)]
    lengths = [rng.randint(1, 30) for _ in range(n)]
    return prompts, lengths


@pytest.fixture(scope="module")
def answers():
    """Greedy MTP-off outputs of every workload below (the known answers the drafter draws from)."""
    cache: dict = {}

    def get(prompts, lengths):
        key = (tuple(map(tuple, prompts)), tuple(lengths))
        if key not in cache:
            llm = LLM("tiny", warmup=False, max_batch_size=8, max_seq_len=256)
            outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
            cache[key] = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}
        return cache[key]

    return get


@pytest.fixture
def overlapped_mtp(monkeypatch):
    """Counts the target passes that took more than one input per request from the device (an MTP step's
    bonus token and drafts: the overlapped MTP path)."""
    seen = []
    real = runner_mod.pending_inputs

    def counting(seqs, prev):
        dst, src = real(seqs, prev)
        seen.append(len(dst) > 0 and prev.mtp is not None)
        return dst, src

    monkeypatch.setattr(runner_mod, "pending_inputs", counting)
    return seen


def _run(llm, prompts, params, answers=None, p_right=0.0, abort_at=None):
    """Drive the engine step by step; returns (tokens, finish reason) per request, the speculative stats and
    the engine's stats. ``abort_at``: {request index: the number of its tokens after which it is aborted}."""
    eng = llm.engine
    if answers is not None:
        use_known_answers(eng, answers, p_right, seed=1)
        assert isinstance(eng.proposer, KnownAnswerProposer)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    run_with_aborts(eng, rids, abort_at or {})
    cache = eng.cache
    assert cache.num_free_blocks == cache.num_blocks and cache.num_free_slots == cache.num_slots
    outs = [(list(r.output_ids), r.finish_reason) for r in (eng.requests.get(rid) for rid in rids) if r is not None]
    return outs, llm.get_stats()


@pytest.mark.parametrize("k,seed", [(1, 0), (2, 1), (3, 2)])
def test_overlapped_mtp_equals_sync(k, seed, answers, overlapped_mtp):
    """Greedy requests, drafts right 60% of the time: every token, finish reason and acceptance count the
    same; the overlapped engine launched verify steps from the device."""
    prompts, lengths = _workload(9, seed)
    ans = answers(prompts, lengths)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    # stop tokens mid-output: the overlapped engine has launched the request's next step when it reads them
    for i in (1, 4):
        if lengths[i] > 6:
            params[i] = SamplingParams(max_tokens=lengths[i], ignore_eos=True, stop_token_ids=[ans[tuple(prompts[i])][5]])
    sync, sync_stats = _run(_llm(False, k), prompts, params, ans, 0.6)
    assert not any(overlapped_mtp)
    over, over_stats = _run(_llm(True, k), prompts, params, ans, 0.6)
    assert over == sync
    assert over_stats["speculative"] == sync_stats["speculative"]
    assert sync_stats["speculative"]["num_accepted_tokens"] > 0
    assert sum(overlapped_mtp) > 5
    for (toks, _), p, n in zip(over, prompts, lengths):  # greedy MTP on: MTP off's tokens
        assert toks == ans[tuple(p)][:len(toks)]


def test_overlapped_mtp_with_preemption_equals_sync(answers, overlapped_mtp):
    prompts, lengths = _workload(8, 5)
    prompts = [p + [7] * 40 for p in prompts]  # long enough to crowd the small cache
    lengths = [max(n, 20) for n in lengths]
    ans = answers(prompts, lengths)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    kw = dict(kv_cache_config={"max_tokens": 448, "tokens_per_block": 16}, max_seq_len=200, max_batch_size=8,
              max_num_tokens=96)
    sync, sync_stats = _run(_llm(False, 2, **kw), prompts, params, ans, 0.7)
    over, over_stats = _run(_llm(True, 2, **kw), prompts, params, ans, 0.7)
    assert over == sync
    assert over_stats["num_preemptions"] > 0 and sum(overlapped_mtp) > 0
    assert over_stats["speculative"]["num_accepted_tokens"] > 0


def test_abort_while_an_mtp_step_is_on_the_device(answers):
    """A request aborted between steps while its verify step runs: its tokens so far are its answer's prefix,
    its cache is freed at once, nothing leaks, and the others finish with their full answers."""
    prompts, lengths = _workload(6, 7)
    lengths = [30] * 6
    ans = answers(prompts, lengths)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    llm = _llm(True, 2)
    eng = llm.engine
    use_known_answers(eng, ans, 0.8)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    reqs = [eng.requests[r] for r in rids]
    aborted = set()
    while eng.has_unfinished_requests():
        eng.step()
        for i in (0, 3):
            req = reqs[i]
            if i not in aborted and len(req.output_ids) >= 8 and req.inflight is not None:
                free = eng.cache.num_free_slots
                eng.abort_request(rids[i])
                assert eng.cache.num_free_slots == free + 1  # freed while its step is still on the device
                aborted.add(i)
    assert aborted == {0, 3}
    for i, req in enumerate(reqs):
        toks = req.output_ids
        want = ans[tuple(prompts[i])]
        assert toks == (want[:len(toks)] if i in aborted else want)
    assert eng.cache.num_free_blocks == eng.cache.num_blocks


def test_sampled_and_logprob_requests_equal_sync(answers, overlapped_mtp):
    """Sampled requests verify against their keyed draws on the device either way: seeded requests draw the
    same tokens; logprobs of every emitted token match."""
    prompts, lengths = _workload(7, 11)
    ans = answers(prompts, lengths)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=2 if i % 3 == 0 else None)
              for i, n in enumerate(lengths)]
    params[2] = SamplingParams(max_tokens=lengths[2], temperature=0.8, seed=5, ignore_eos=True)
    params[5] = SamplingParams(max_tokens=lengths[5], temperature=1.0, top_k=20, top_p=0.9, seed=9,
                               ignore_eos=True, logprobs=1)
    outs = {}
    for overlap in (False, True):
        llm = _llm(overlap, 2)
        res = llm.generate(prompts, params)
        outs[overlap] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in res]
    assert sum(overlapped_mtp) > 0
    for (a, ra, la), (b, rb, lb) in zip(outs[False], outs[True]):
        assert (a, ra) == (b, rb)
        if la is None:
            assert lb is None
        else:
            assert len(la) == len(lb) == len(a)
            for x, y in zip(la, lb):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x)


def test_switching_overlap_off_between_steps(answers):
    """A benchmark may switch the overlap scheduler between steps: a launched MTP step is read back first."""
    prompts, lengths = _workload(5, 13)
    ans = answers(prompts, lengths)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    llm = _llm(True, 2)
    eng = llm.engine
    use_known_answers(eng, ans, 0.6)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    n = 0
    while eng.has_unfinished_requests():
        eng.overlap_scheduler = (n // 3) % 2 == 0
        eng.step()
        n += 1
    assert [eng.requests[r].output_ids for r in rids] == [ans[tuple(p)] for p in prompts]


def test_overlapped_mtp_on_the_graph_buffers_equals_sync(answers, overlapped_mtp, monkeypatch):
    """The kernel path's torch twins with the CUDA graphs' static buffers on the CPU (``DSV4_STATIC_GRAPHS_ON_CPU``):
    verify steps replay a bucket whose C column came from the device's shift; tokens equal the synchronous run."""
    monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    prompts, lengths = _workload(6, 17)
    ans = answers(prompts, lengths)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    runs = []
    for overlap in (False, True):
        llm = _llm(overlap, 2, cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4]})
        assert llm.engine.runner.graphs is not None
        runs.append(_run(llm, prompts, params, ans, 0.7))
        assert llm.engine.runner.graphs.num_replays > 0
    assert runs[0][0] == runs[1][0] and runs[0][1]["speculative"] == runs[1][1]["speculative"]
    assert sum(overlapped_mtp) > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_whole_step_graph_equals_separate_graphs(answers, overlap, monkeypatch):
    """The whole-step graph (target pass, greedy acceptance and the k draft passes in one) against the separate
    graphs with acceptance eager between them, on the graphs' static buffers on the CPU: the same tokens, the
    same MTP drafts after every step (the model's own, not rewritten), the same acceptance with known-answer
    drafts, overlapped or not; sampled and logprob requests in the batch take the separate graphs."""
    monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    prompts, lengths = _workload(7, 23)
    ans = answers(prompts, lengths)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    params[3] = SamplingParams(max_tokens=lengths[3], ignore_eos=True, logprobs=1)
    params[5] = SamplingParams(max_tokens=lengths[5], temperature=0.9, seed=3, ignore_eos=True)
    runs, traces, whole = [], [], []
    for on in (False, True):
        llm = _llm(overlap, 3, cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4]})
        graphs = llm.engine.runner.graphs
        graphs.whole_step = on
        eng, trace = llm.engine, []
        rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
        while eng.has_unfinished_requests():
            eng.step()
            trace.append([(tuple(eng.requests[r].drafts), list(eng.requests[r].output_ids)) for r in rids])
        traces.append(trace)
        n = graphs.num_whole_steps
        runs.append(_run(llm, prompts, params, ans, 0.7))
        whole.append(graphs.num_whole_steps - n)
    assert whole[0] == 0 and whole[1] > 5
    assert traces[0] == traces[1] and any(d for step in traces[0] for d, _ in step)
    assert runs[0][0] == runs[1][0] and runs[0][1]["speculative"] == runs[1][1]["speculative"]
    assert runs[1][1]["speculative"]["num_accepted_tokens"] > 0


def test_uniform_acceptance_equals_accept_on_device():
    """``spec.accept_uniform`` and ``runner.uniform_draft_inputs`` (a whole-step graph's static shapes) against
    ``accept_on_device`` and ``device_draft_inputs`` on random verdicts: the same accepted drafts, bonus tokens,
    checked drafts, catch-up inputs, draft rows and committed lengths."""
    import torch

    from dsv4.engine.request import Request
    from dsv4.engine.runner import device_draft_inputs, uniform_draft_inputs
    from dsv4.engine.scheduler import ScheduledSeq
    from dsv4.engine.spec import accept_on_device, accept_uniform

    g = torch.Generator().manual_seed(0)
    for k in (1, 2, 3):
        for B in (1, 3, 5):
            V = 6  # a small vocabulary: drafts often match
            ids = torch.randint(0, V, (B * (k + 1),), generator=g)
            logits = torch.randn(B * (k + 1), V, generator=g)
            seqs = [ScheduledSeq(Request(f"r{b}", [1, 2, 3], SamplingParams(max_tokens=8)),
                                 tuple(ids[b * (k + 1):(b + 1) * (k + 1)].tolist()), True,
                                 tuple(ids[b * (k + 1) + 1:(b + 1) * (k + 1)].tolist())) for b in range(B)]
            want = accept_on_device(seqs, logits, ids)
            a, last, checks = accept_uniform(logits.argmax(-1), ids, B, k)
            assert torch.equal(a, want.accepted_drafts) and torch.equal(1 + a, want.accepted_rows)
            assert torch.equal(last, want.last_ids)
            ids_host, rows_host, checked = want.read_all()
            assert checks[:, :k].tolist() == checked
            C = torch.randint(3, 50, (B,), generator=g)
            inp = device_draft_inputs(seqs, [0] * B, want, [True] * B, computed=C)
            got = uniform_draft_inputs(logits.argmax(-1).view(B, k + 1), a, C)
            for x, y in ((got.next_ids, inp.next_ids), (got.picks, inp.picks), (got.new_lens, inp.new_lens)):
                assert torch.equal(x, y)
            assert got.active == inp.active


def test_warmup_runs_whole_step_graphs_and_a_sampled_mtp_step(monkeypatch):
    """Warmup's MTP path runs both MTP step kinds before serving: greedy steps on the whole-step graph and steps
    of a sampled request (its keyed draws verified on the device, the separate graphs), and leaves nothing
    behind."""
    from dsv4.engine import spec

    monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    calls = []
    real = spec.sample_rows
    monkeypatch.setattr(spec, "sample_rows", lambda *a: calls.append(1) or real(*a))
    llm = LLM("tiny", max_batch_size=4, max_num_tokens=48, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4]},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    assert len(llm.warmup_paths) == 8  # (three with drafting paused, tests/test_spec_pause.py; the kept-rows passes)
    assert llm.engine.runner.graphs.num_whole_steps > 0 and calls
    assert not llm.engine.requests and llm.engine.cache.num_free_slots == llm.engine.cache.num_slots
