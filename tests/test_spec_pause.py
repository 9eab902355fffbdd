"""Drafting paused while it does not pay (``engine/spec_pause.py``): the policy's bookkeeping on its own, then
the engine with pauses, probes and resumes forced often, against MTP off's greedy tokens (the known answers),
overlapped or not, eager or on the CUDA graphs' static buffers (the keep-up runner's buckets), the cache's
integrity checked after every step (conftest)."""

from __future__ import annotations

import random

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.engine.config import EngineConfigError, SpeculativeConfig
from dsv4.engine.proposer import use_known_answers
from dsv4.engine.spec_pause import DraftPause

from .traces import assert_same_current_rows, assert_same_steps, ring_spans, run_traced, run_with_aborts


def test_pauses_below_the_threshold_and_probes():
    p = DraftPause(0.5, window=4, probe_every=3)
    assert p.drafts_now()  # nothing read back yet
    for _ in range(3):
        p.record(1, 0)
    assert p.drafts_now()  # 3 drafts: under the window
    p.record(1, 1)  # 1 of 4 accepted
    assert not p.drafts_now() and p.paused and p.num_pauses == 1
    assert [p.drafts_now() for _ in range(6)] == [False, True, False, False, True, False]  # probes
    p.record(2, 0)  # a probe rejected: still paused, its samples dropped
    assert not p.drafts_now() and p.paused
    p.record(2, 1)  # a probe at the threshold: resumes
    assert p.drafts_now() and not p.paused and p.num_resumes == 1
    assert p.rate == 0.5  # the probe stays in the window


def test_each_failed_probe_doubles_the_wait_for_the_next_up_to_the_most():
    p = DraftPause(0.5, window=2, probe_every=2, max_probe_every=5)
    p.record(2, 0)
    assert not p.drafts_now() and p.probe_interval == 2
    seen = []
    for _ in range(16):
        probe = p.drafts_now()
        seen.append(probe)
        if probe:
            p.record(2, 0)  # every probe rejected
    # (the pausing step was the first paused one) a probe after 2 paused steps, then after 4, then 5 (the most)
    # and again 5: each rejection is judged at the decision after its probe
    assert [i for i, probe in enumerate(seen) if probe] == [0, 4, 9, 14]
    assert p.probe_interval == 5 and p.paused
    while not p.drafts_now():
        pass
    p.record(2, 2)  # a probe accepted: resumes, and a later pause waits the first interval again
    assert p.drafts_now() and not p.paused
    p.record(2, 0)
    p.record(2, 0)
    assert not p.drafts_now() and p.probe_interval == 2
    assert p.as_dict()["probe_interval"] == 2


def test_the_window_slides_and_good_acceptance_never_pauses():
    p = DraftPause(0.2, window=4, probe_every=2)
    for i in range(40):
        p.record(2, 1 if i % 3 else 0)  # a window (2 reads) holds 1 or 2 of its 4 drafts accepted
        assert p.drafts_now()
    assert p._drafts <= 4 + 2  # the oldest dropped once the rest hold a window
    for _ in range(3):
        p.record(2, 0)
    assert not p.drafts_now()  # the last 4 drafts: none accepted
    assert p.as_dict()["num_pauses"] == 1
    p.reset()
    assert not p.paused and p.rate is None and p.num_pauses == 0


def test_the_engine_backs_off_its_probes_as_configured():
    """The random MTP layer is never right: with probes backing off (pause_max_probe_interval 16) the engine
    verifies fewer drafts than when every probe comes after pause_probe_interval, with the same tokens."""
    prompts, lengths = _workload(3, 5)
    runs = []
    for most in (2, 16):
        llm = LLM("tiny", warmup=False, max_batch_size=4, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
                  speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 1,
                                      "pause_below_acceptance": 0.5, "pause_probe_interval": 2,
                                      "pause_max_probe_interval": most})
        outs = llm.generate(prompts, [SamplingParams(max_tokens=60, ignore_eos=True)] * len(prompts))
        spec = llm.get_stats()["speculative"]
        runs.append(([o.outputs[0].token_ids for o in outs], spec["num_verify_steps"], spec["pause"]))
    (toks, verifies, pause), (toks_b, verifies_b, pause_b) = runs
    assert toks == toks_b and pause["probe_interval"] == 2 and pause_b["probe_interval"] == 16
    assert verifies_b < verifies


@pytest.mark.parametrize("kw", [{"pause_below_acceptance": 1.5}, {"pause_below_acceptance": -0.1},
                                {"pause_probe_interval": 0},
                                {"pause_probe_interval": 64, "pause_max_probe_interval": 32}])
def test_bad_pause_settings_are_refused(kw):
    with pytest.raises(EngineConfigError, match="pause_"):
        SpeculativeConfig(**kw)


def _workload(n: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    return prompts, [rng.randint(12, 40) for _ in range(n)]


def _chunked_mtp2_engine(max_batch_size: int, overlap: bool, **kw):
    """tiny with MTP k = 2, prompts in chunks of 64 tokens, without warmup."""
    return LLM("tiny", warmup=False, max_batch_size=max_batch_size, max_num_tokens=64, max_seq_len=256,
               kv_cache_config={"max_tokens": 4096}, disable_overlap_scheduler=not overlap,
               speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2}, **kw).engine


def _answers(prompts, lengths):
    llm = LLM("tiny", warmup=False, max_batch_size=8, max_seq_len=256)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outs)}


@pytest.mark.parametrize("overlap,graphs,k", [(True, False, 2), (False, False, 1), (True, True, 2),
                                              (False, True, 3)])
def test_pauses_probes_and_resumes_keep_mtp_off_tokens(overlap, graphs, k, monkeypatch):
    """Drafts wrong until a third of the steps have run, then always right: drafting pauses (steps of one row,
    the MTP layer's keep-up pass), probes, resumes; every token is MTP off's. On the graphs' static buffers the
    paused steps replay the keep-up runner's buckets: its whole-step graph (overlapped), its separate target and
    keep-up graphs (the synchronous run, its whole-step graph switched off)."""
    if graphs:
        monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    prompts, lengths = _workload(5, k)
    ans = _answers(prompts, lengths)
    kw = {"cuda_graph_config": {"enable_padding": True, "batch_sizes": [1, 2, 4, 8]}} if graphs else {}
    llm = LLM("tiny", warmup=False, max_batch_size=8, max_num_tokens=64, max_seq_len=256,
              kv_cache_config={"max_tokens": 4096}, disable_overlap_scheduler=not overlap,
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k}, **kw)
    eng = llm.engine
    assert eng.pause is not None and eng.pause.below == 0.3  # on by default
    eng.pause = DraftPause(0.5, window=3, probe_every=3)
    use_known_answers(eng, ans, 0.0, seed=1)
    keep = eng.runner.keep_graphs
    assert (keep is not None) == graphs
    kept = []
    if graphs:
        keep.whole_step = overlap
        real = keep.keep
        keep.keep = lambda plan, ids: kept.append(plan.num_seqs) or real(plan, ids)
    rids = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
    rows, steps = [], 0
    while eng.has_unfinished_requests():
        if steps == 12:
            eng.proposer.p_right = 1.0
        eng.step()
        steps += 1
        rows.append(eng.last_step["num_tokens"])
    for rid, p in zip(rids, prompts):
        assert eng.requests[rid].output_ids == ans[tuple(p)]
    st = eng.pause.as_dict()
    assert st["num_pauses"] >= 1 and st["num_resumes"] >= 1 and st["num_paused_steps"] >= 2
    spec = llm.get_stats()["speculative"]
    assert spec["num_accepted_tokens"] > 0 and spec["pause"] == st
    if graphs:
        assert keep.num_replays > 0 and eng.runner.graphs.num_replays > 0
        assert (keep.num_whole_steps > 0, bool(kept)) == (overlap, not overlap)
    cache = eng.cache
    assert cache.num_free_blocks == cache.num_blocks and cache.num_free_slots == cache.num_slots


def test_paused_steps_are_decode_steps_of_one_row():
    """With every draft wrong, drafting pauses: the steps between probes carry one row a request (as MTP off's),
    and the probes' drafts are verified in the step after them."""
    prompts, lengths = _workload(3, 7)
    ans = _answers(prompts, lengths)
    llm = LLM("tiny", warmup=False, max_batch_size=4, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    eng = llm.engine
    eng.pause = DraftPause(0.5, window=2, probe_every=4)
    use_known_answers(eng, ans, 0.0, seed=1)
    for p, n in zip(prompts, lengths):
        eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
    seen = []
    while eng.has_unfinished_requests():
        eng.step()
        seen.append((eng.last_step["num_seqs"], eng.last_step["num_tokens"]))
    decode = [(b, t) for b, t in seen[4:] if b == 3]  # after the prompts
    assert decode and sum(t == b for b, t in decode) > sum(t == 3 * b for b, t in decode)  # mostly one row
    assert any(t == 3 * b for b, t in decode)  # a probe's drafts verified
    assert eng.pause.num_pauses >= 1 and eng.pause.num_resumes == 0


def test_warmup_runs_the_paused_path(monkeypatch):
    """Warmup runs drafting paused with probes, and paused from the start with a prompt longer than the MTP ring's
    span (the keep-up pass over its kept rows, ``mtp_rows``) and steps that skip the keep-up pass (bare graphs),
    and paused far from a probe from the first step (prompt rows without the keep-up pass)."""
    from dsv4.cache.manager import KVCacheManager
    from dsv4.engine.mtp_rows import MtpRows
    from dsv4.model.model import DeepseekV4

    monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    subsets, kept_up = [], []  # the kept rows' streams; keep-up passes run over one of them
    rows, keep_up = MtpRows.rows, DeepseekV4.mtp_keep_up
    monkeypatch.setattr(MtpRows, "rows", lambda self, X: subsets.append(rows(self, X)) or subsets[-1])
    monkeypatch.setattr(DeepseekV4, "mtp_keep_up", lambda self, X, *a: kept_up.append(
        any(X is x for x in subsets)) or keep_up(self, X, *a))
    prompt_steps = []  # (a step with prompt rows: whether it kept the MTP ring up)
    begin = KVCacheManager.begin_step
    monkeypatch.setattr(KVCacheManager, "begin_step", lambda self, seqs, **kw: (
        prompt_steps.append(kw.get("mtp_keep_up", True)) if max(s.num_new for s in seqs) > 1 else None)
        or begin(self, seqs, **kw))
    llm = LLM("tiny", max_batch_size=4, max_num_tokens=48, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4]},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
    assert any(n.startswith("MTP with drafting paused (") for n in llm.warmup_paths)
    assert any(n.startswith("MTP with drafting paused far from a probe") for n in llm.warmup_paths)
    eng = llm.engine
    assert eng.runner.keep_graphs.num_replays > 0 and eng.runner.keep_graphs.num_bare_steps > 0
    assert any(kept_up)  # a paused prompt's kept rows kept up
    assert not all(prompt_steps)  # and prompt rows left stale far from a probe
    assert isinstance(eng.pause, DraftPause) and eng.pause.below == 0.3 and not eng.pause.paused
    assert not eng.requests and eng.cache.num_free_slots == eng.cache.num_slots


def test_no_pause_when_switched_off():
    llm = LLM("tiny", warmup=False, max_batch_size=2, max_seq_len=64, kv_cache_config={"max_tokens": 512},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 1,
                                  "pause_below_acceptance": 0})
    assert llm.engine.pause is None and llm.get_stats()["speculative"]["pause"] is None


@pytest.mark.parametrize("overlap,slim", [(True, True), (False, True), (True, False)])
def test_paused_whole_step_graph_equals_separate_graphs(overlap, slim, monkeypatch):
    """The keep-up runner's whole-step graph (target pass, argmax, the MTP layer's keep-up pass) against its
    separate target and keep-up graphs, on the static buffers on the CPU, with the model's own drafts (random
    weights: drafting pauses at once) and a probe every third step: the same tokens and the same drafts at every
    step, and every window ring (the MTP layer's included) bit for bit after every step. The whole step as it runs
    (``slim_keep_step``: no acceptance kernels) and with a drafting step's acceptance kernels."""
    from dsv4.engine.graphs import GraphRunner

    monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    monkeypatch.setattr(GraphRunner, "slim_keep_step", slim)
    prompts, lengths = _workload(4, 11)
    traces, whole_steps = [], []
    for whole in (True, False):
        llm = LLM("tiny", warmup=False, max_batch_size=4, max_num_tokens=64, max_seq_len=256,
                  kv_cache_config={"max_tokens": 4096}, disable_overlap_scheduler=not overlap,
                  cuda_graph_config={"enable_padding": True, "batch_sizes": [1, 2, 4]},
                  speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2})
        eng = llm.engine
        eng.pause = DraftPause(1.0, window=1, probe_every=3)
        keep = eng.runner.keep_graphs
        keep.whole_step = whole
        rids = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
        traces.append(run_traced(eng, rids, rings=True))
        whole_steps.append(keep.num_whole_steps)
    assert whole_steps[0] > 3 and whole_steps[1] == 0
    assert_same_steps(*traces)
    assert any(d for seen, _ in traces[0] for d, _ in seen)


@pytest.mark.parametrize("graphs", [False, True])
def test_keep_up_pass_stores_the_whole_passs_window_rows(graphs, monkeypatch):
    """The keep-up pass (``DeepseekV4.mtp_keep_up``: the MTP layer's input projections, its attention's collapse,
    kv projection and norm-rope, nothing after) against the whole MTP pass it stands for: through prompts
    prefilled in chunks that sample nothing, paused steps and probes, every window row of every layer after every
    step is the same bit for bit, and so are the tokens and the drafts. Eagerly, and on the graphs' static
    buffers (the keep-up runner's buckets, its whole-step graph)."""
    from dsv4.model.model import DeepseekV4

    if graphs:
        monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    prompts, lengths = _workload(4, 13)
    prompts[0] = prompts[0] + [9] * 70  # prefilled in chunks of 32
    kw = {"cuda_graph_config": {"enable_padding": True, "batch_sizes": [1, 2, 4]}} if graphs else {}
    runs = []
    for whole_pass in (False, True):
        if whole_pass:
            monkeypatch.setattr(DeepseekV4, "mtp_keep_up",
                                lambda self, X, ids, backend: self.mtp_streams(X, ids, backend))
        llm = LLM("tiny", warmup=False, max_batch_size=4, max_num_tokens=32, max_seq_len=256,
                  kv_cache_config={"max_tokens": 4096},
                  speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2}, **kw)
        eng = llm.engine
        eng.pause = DraftPause(1.0, window=1, probe_every=3)
        rids = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
        runs.append(run_traced(eng, rids, rings=True))
        assert eng.pause.num_paused_steps > 3
    assert_same_steps(*runs)


@pytest.mark.parametrize("overlap", [True, False])
def test_random_workload_with_pauses_preemption_aborts_and_sampling(overlap):
    """Drafting paused, probed and resumed often (the known answer's drafts right a third of the time against a
    threshold of a half) through a random workload in a cache small enough to preempt, with prompts in chunks,
    stop tokens, two aborts, a logprobs request and a sampled one: every greedy request emits MTP off's tokens
    (the aborted ones a prefix) with MTP off's logprobs, the sampled one finishes, nothing leaks; the cache's
    integrity is checked after every step (conftest)."""
    prompts, lengths = _workload(8, 31)
    prompts = [p + [7] * 40 for p in prompts]  # long enough to crowd the small cache
    lengths = [max(n, 24) for n in lengths]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, logprobs=2 if i == 1 else None)
              for i, n in enumerate(lengths)]
    kw = dict(max_batch_size=8, max_num_tokens=64, max_seq_len=200,
              kv_cache_config={"max_tokens": 400, "tokens_per_block": 16})
    ref_llm = LLM("tiny", warmup=False, **kw)
    ref = ref_llm.generate(prompts, params)
    stop = {4: ref[4].outputs[0].token_ids[6]}
    for i, t in stop.items():
        params[i] = SamplingParams(max_tokens=lengths[i], ignore_eos=True, stop_token_ids=[t])
    params[6] = SamplingParams(max_tokens=lengths[6], temperature=0.9, seed=2, ignore_eos=True)
    ref = ref_llm.generate(prompts, params)
    ans = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, ref)}
    llm = LLM("tiny", warmup=False, disable_overlap_scheduler=not overlap,
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2}, **kw)
    eng = llm.engine
    eng.pause = DraftPause(0.5, window=4, probe_every=3)
    use_known_answers(eng, ans, 0.35, seed=4)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    assert not run_with_aborts(eng, rids, {0: 9, 5: 4}) and eng.get_stats()["num_preemptions"] > 0
    st = eng.pause.as_dict()
    assert st["num_pauses"] >= 1 and st["num_resumes"] >= 1 and st["num_paused_steps"] > 0
    for i, (rid, r) in enumerate(zip(rids, ref)):
        req = eng.requests.get(rid)
        if req is None:  # (aborted: the engine forgot it)
            continue
        want = r.outputs[0]
        if i == 6:
            assert req.finish_reason == "length" and len(req.output_ids) == lengths[6]
            continue
        assert req.output_ids == want.token_ids and req.finish_reason == want.finish_reason, i
        if i == 1:
            assert len(req.logprobs) == len(want.logprobs)
            for x, y in zip(req.logprobs, want.logprobs):
                assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-5 for t in x)
    cache = eng.cache
    assert cache.num_free_blocks == cache.num_blocks and cache.num_free_slots == cache.num_slots


@pytest.mark.parametrize("overlap,graphs,whole", [(True, True, True), (False, True, True), (True, True, False),
                                                 (True, False, False), (False, False, False)])
def test_paused_steps_far_from_the_next_probe_leave_the_mtp_ring(overlap, graphs, whole, monkeypatch):
    """A paused step more than the ring's span (swa_cap steps) before the next probe skips the MTP layer's
    keep-up pass (eagerly, on the separate graphs, on the keep-up runner's bare whole-step graph). Against a run that keeps up at
    every paused step: the same tokens, steps and (read back on the host) drafts at every step, and
    after every step the same ring rows wherever the cache calls them current (``mtp_stale_to``). Prompt rows
    are no exception (the fourth request arrives while drafting is paused)."""
    if graphs:
        monkeypatch.setenv("DSV4_STATIC_GRAPHS_ON_CPU", "1")
    prompts, lengths = _workload(4, 19)
    lengths = [n + 40 for n in lengths]  # several probe intervals
    prompts[3] = prompts[3] + [11] * 150  # prefilled in chunks while drafting is paused
    kw = {"cuda_graph_config": {"enable_padding": True, "batch_sizes": [1, 2, 4]}} if graphs else {}
    runs, skipped = [], []
    for skip in (True, False):
        if not skip:
            monkeypatch.setattr(DraftPause, "keep_rows", lambda self, margin: margin)
        eng = _chunked_mtp2_engine(3, overlap, **kw)
        S = eng.cache.layout.swa_cap
        eng.pause = DraftPause(1.0, window=1, probe_every=S + 16)  # paused steps 3..15 after a probe skip
        # (3 at a time: the fourth prompt is prefilled while drafting is paused)
        plans, begin = [], eng.cache.begin_step

        def recorded(seqs, **kw):  # (keeps up, prompt rows, a paused step far from the next probe)
            plans.append((kw.get("mtp_keep_up", True), max(s.num_new for s in seqs) > 1,
                          eng.pause.paused and eng.pause.keep_rows(S) == 0))
            return begin(seqs, **kw)
        eng.cache.begin_step = recorded
        if graphs:
            eng.runner.keep_graphs.whole_step = whole
        calls = []
        real = eng.model.mtp_keep_up
        eng.model.mtp_keep_up = lambda X, ids, backend: calls.append(1) or real(X, ids, backend)
        rids = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, lengths)]
        trace = []
        while eng.has_unfinished_requests():
            eng.step()
            trace.append(([(tuple(eng.requests[r].drafts), tuple(eng.requests[r].output_ids)) for r in rids]
                          + [(eng.last_step["num_seqs"], eng.last_step["num_tokens"])], ring_spans(eng, rids)))
        assert eng.pause.num_paused_steps > 2 * S
        if skip:  # a step with prompt rows far from a probe skips the keep-up pass too
            assert any(far and prompt for _, prompt, far in plans)
            assert not any(keep for keep, prompt, far in plans if far and prompt)
        skipped.append((len(calls), eng.runner.keep_graphs.num_bare_steps if graphs else None))
        runs.append(trace)
    (calls_skip, bare), (calls_all, bare_all) = skipped
    assert calls_skip < calls_all  # keep-up passes left out (graphed: replays of the bare graph instead)
    if graphs:
        assert (bare > 0) == whole and not bare_all
    a, b = runs
    stale_rows = assert_same_current_rows(a, b)
    verifies = sum(seen[-1][1] == 3 * seen[-1][0] for seen, _ in a)  # steps of 1 + 2 drafts a request
    assert stale_rows > 0 and verifies >= 3  # rows were stale; probes drafted (and were verified)


@pytest.mark.parametrize("overlap", [True, False])
def test_paused_steps_near_a_probe_keep_a_prompts_last_rows_only(overlap, monkeypatch):
    """A paused step d <= swa_cap steps before the next probe writes only each request's last swa_cap - d + 1
    rows to the MTP layer's ring (``DraftPause.keep_rows``): a prompt arriving there keeps a few of its rows, and
    the probe still drafts (the cache calls every ring current then). Against a run that keeps every row at each
    paused step: the same tokens, steps and drafts, and after every step the same ring rows wherever the cache
    calls them current."""
    prompts, lengths = _workload(3, 29)
    prompts[2] = prompts[2] + [7] * 40  # arrives 5 steps before a probe
    runs, partial = [], []
    for partial_keep in (True, False):
        if not partial_keep:
            monkeypatch.setattr(DraftPause, "keep_rows", lambda self, margin: margin)
        eng = _chunked_mtp2_engine(4, overlap)
        S = eng.cache.layout.swa_cap
        eng.pause = DraftPause(1.0, window=1, probe_every=S + 16)
        kept, begin = [], eng.cache.begin_step

        def recorded(seqs, **kw):
            kept.append((kw.get("mtp_keep_last"), max(s.num_new for s in seqs)))
            return begin(seqs, **kw)
        eng.cache.begin_step = recorded
        sp = [SamplingParams(max_tokens=n + 40, ignore_eos=True) for n in lengths]
        rids = [eng.add_request(p, s) for p, s in zip(prompts[:2], sp[:2])]
        trace, added = [], False
        while eng.has_unfinished_requests():
            if not added and eng.pause.paused and eng.pause.probe_interval - eng.pause._since_probe == 6:
                rids.append(eng.add_request(prompts[2], sp[2]))  # its prompt step is 5 steps before the probe
                added = True
            eng.step()
            trace.append(([(tuple(eng.requests[r].drafts), tuple(eng.requests[r].output_ids)) for r in rids]
                          + [(eng.last_step["num_seqs"], eng.last_step["num_tokens"])], ring_spans(eng, rids)))
        assert added
        partial.append([(k, n) for k, n in kept if k is not None and k < n])
        runs.append(trace)
    assert partial[0] and not partial[1]  # the prompt step kept its last rows only (S - 5 + 1 of them)
    assert any(k == S - 4 and n >= 40 for k, n in partial[0])
    a, b = runs
    assert len(a) == len(b)
    assert_same_current_rows(a, b)
    i = next(i for i, (seen, _) in enumerate(a) if len(seen) == 4 and seen[-1][1] >= 40)  # the prompt step
    assert any(seen[-1][1] == 3 * seen[-1][0] for seen, _ in a[i + 1:i + 12])  # its probe drafted and verified


def test_drafting_waits_until_the_mtp_ring_is_current():
    """A pause reset while the ring is stale (steps that skipped the keep-up pass): the engine would draft at
    once, but holds back (steps of one row, the keep-up pass) until no request's ring span holds a stale row."""
    prompts, lengths = _workload(2, 23)
    llm = LLM("tiny", warmup=False, max_batch_size=4, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 1})
    eng = llm.engine
    S = eng.cache.layout.swa_cap
    eng.pause = DraftPause(1.0, window=1, probe_every=10 ** 6)  # paused for good, every paused step far off
    rids = [eng.add_request(p, SamplingParams(max_tokens=S + 30, ignore_eos=True)) for p in prompts]
    for _ in range(8):
        eng.step()
    assert not eng.cache.mtp_current(rids)
    eng.pause.reset()  # drafting resumes: not before the rings are current again
    held = 0
    while not eng.cache.mtp_current(rids):
        eng.step()
        assert eng.last_step["num_tokens"] == len(rids)  # one row a request: nothing verified, nothing drafted
        held += 1
    assert 0 < held <= S + 2
    eng.step()  # current now: this step drafts, the next verifies
    eng.step()
    assert eng.last_step["num_tokens"] == 2 * len(rids)  # each request verifies its 1 draft
