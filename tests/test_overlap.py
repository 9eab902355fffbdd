"""The overlap scheduler (a greedy step is launched before the previous step's tokens are read back) against
its twin, the same engine with ``disable_overlap_scheduler``: same tokens, same finish reasons, the cache
checked after every step, through chunked prefill, waiting admission, stop tokens, sampling, preemption and
aborts."""

import collections
import random

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.engine.request import PENDING, Request


def _llm(overlap: bool, **kw):
    kw.setdefault("max_batch_size", 4)
    kw.setdefault("max_num_tokens", 48)  # prompts over 48 tokens prefill in chunks
    kw.setdefault("max_seq_len", 256)
    kw.setdefault("kv_cache_config", {"max_tokens": 4096})
    return LLM("tiny", warmup=False, disable_overlap_scheduler=not overlap, **kw)


def _prompts(lens, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 256) for _ in range(L)] for L in lens]


def _run(llm, prompts, params):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]


def test_overlap_equals_sync(count_overlapped):
    prompts = _prompts([1, 9, 40, 130, 3, 77, 20])
    lengths = [12, 5, 17, 9, 1, 14, 11]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    ref = _run(_llm(False), prompts, params)
    assert not any(count_overlapped)
    # a stop token in the middle of three outputs: the overlapped engine has already launched the step
    # after it and must drop that step's token
    for i in (0, 2, 5):
        params[i] = SamplingParams(max_tokens=lengths[i], ignore_eos=True, stop_token_ids=[ref[i][0][4]])
    # sampled rows are drawn on the device in the overlapped step, keyed by the same seeds and positions
    params[3] = SamplingParams(max_tokens=9, temperature=0.8, seed=5)
    params[6] = SamplingParams(max_tokens=11, temperature=1.0, top_k=20, top_p=0.9, seed=9)
    ref = _run(_llm(False), prompts, params)
    assert [r[1] for r in ref].count("stop") >= 3
    llm = _llm(True)
    assert _run(llm, prompts, params) == ref
    assert sum(count_overlapped) > 0
    cache = llm.engine.cache
    assert cache.num_free_blocks == cache.num_blocks and cache.num_free_slots == cache.num_slots


def test_overlap_with_preemption_equals_sync(count_overlapped):
    prompts = _prompts([40, 60, 80, 30, 100, 50], seed=3)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    kw = dict(kv_cache_config={"max_tokens": 384, "tokens_per_block": 16}, max_seq_len=160, max_batch_size=8,
              max_num_tokens=96)
    ref = _run(_llm(False, **kw), prompts, sp)
    llm = _llm(True, **kw)
    assert _run(llm, prompts, sp) == ref
    assert llm.get_stats()["num_preemptions"] > 0 and sum(count_overlapped) > 0
    assert llm.engine.cache.num_free_blocks == llm.engine.cache.num_blocks


def test_abort_while_a_token_is_on_the_device():
    llm = _llm(True)
    eng = llm.engine
    a = eng.add_request([5, 6, 7] * 20, SamplingParams(max_tokens=30, ignore_eos=True))
    b = eng.add_request([9, 8] * 10, SamplingParams(max_tokens=10, ignore_eos=True))
    for _ in range(4):
        eng.step()
    req = eng.requests[a]
    assert req.num_pending == 1  # its newest token is still on the device
    kept = list(req.output_ids)
    eng.abort_request(a)
    while eng.has_unfinished_requests():
        eng.step()
    assert len(eng.requests[b].output_ids) == 10
    assert req.finish_reason == "abort" and req.output_ids == kept and req.num_pending == 0
    assert eng.cache.num_free_blocks == eng.cache.num_blocks and eng.cache.num_free_slots == eng.cache.num_slots
    eng.cache.check_integrity()


def test_each_call_returns_the_step_before():
    """A step's tokens come back from the next call; the last ones from a call that launches nothing."""
    eng = _llm(True).engine
    rid = eng.add_request([4, 5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    got = [len(o.outputs[0].token_ids) for _ in range(4) for o in eng.step()]
    assert got == [1, 2, 3] and eng.requests[rid].finished and not eng.has_unfinished_requests()
    assert eng.num_steps == 3  # the prefill and two decodes: the third token needed no fourth step


def test_pending_tokens_read_as_pending():
    r = Request("x", [1, 2, 3], SamplingParams(max_tokens=5))
    r.output_ids, r.num_pending = [4], 1
    assert r.num_tokens == 5 and r.token_at(3) == 4 and r.token_at(4) == PENDING
    assert r.token_range(2, 5) == (3, 4, PENDING) and r.token_range(4, 5) == (PENDING,)
    assert not r.awaiting_finish
    r.num_pending = 4
    assert r.awaiting_finish


def test_a_failing_step_ends_its_requests_and_the_overlapped_ones(monkeypatch):
    """A forward that raises while an overlapped step is in flight: the requests of both steps end with an
    error, the cache is whole and free, and the engine serves the next request."""
    eng = _llm(True).engine
    rids = [eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in _prompts([5, 30, 9])]
    reqs = [eng.requests[r] for r in rids]
    for _ in range(3):
        eng.step()
    assert eng._pending is not None
    real = eng.runner.forward
    monkeypatch.setattr(eng.runner, "forward", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("device fault")))
    with pytest.raises(RuntimeError, match="device fault"):
        eng.step()
    assert all(r.finish_reason == "error" and r.finished for r in reqs)
    assert eng.cache.num_free_blocks == eng.cache.num_blocks and eng.cache.num_free_slots == eng.cache.num_slots
    eng.cache.check_integrity()
    monkeypatch.setattr(eng.runner, "forward", real)
    rid = eng.add_request([4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert len(eng.requests[rid].output_ids) == 4


def test_warmup_runs_an_overlapped_step(count_overlapped):
    """Warmup's decode path takes an input from the device: the overlap scheduler is exercised before
    serving; with MTP its verify path takes the bonus token and the drafts from the device (1 + k inputs)."""
    llm = LLM("tiny", max_batch_size=4, max_num_tokens=48, max_seq_len=256, kv_cache_config={"max_tokens": 4096})
    assert sum(count_overlapped) > 0 and llm.engine.overlaps_steps
    count_overlapped.clear()
    mtp = LLM("tiny", max_batch_size=4, max_num_tokens=48, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 1})
    assert mtp.engine.overlaps_steps and any(n >= 2 * 4 for n in count_overlapped)  # 4 requests x (1 + 1)
    count_overlapped.clear()
    off = LLM("tiny", max_batch_size=4, max_num_tokens=48, max_seq_len=256, kv_cache_config={"max_tokens": 4096},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 1},
              disable_overlap_scheduler=True)
    assert sum(count_overlapped) == 0 and not off.engine.overlaps_steps


def _random_workload(seed: int, overlap: bool) -> tuple[dict, collections.Counter]:
    """One random mix (prompt lengths, output lengths, stop tokens, sampling, a cache small enough to preempt,
    an abort at a random step, requests added while others run) stepped by hand. Returns each request's
    (tokens, finish reason), the aborted one left out, and counts of what happened."""
    rng = random.Random(seed)
    n = 7
    prompts = _prompts([rng.choice([1, 2, 5, 17, 40, 70]) for _ in range(n)], seed=seed)
    params = []
    for i in range(n):
        kw = dict(max_tokens=rng.randrange(1, 14), ignore_eos=True)
        if rng.random() < 0.3:
            kw["stop_token_ids"] = [rng.randrange(2, 256) for _ in range(20)]  # likely to stop somewhere
        if rng.random() < 0.3:
            kw.update(temperature=0.9, top_k=rng.choice([0, 30]), seed=rng.randrange(100))
        params.append(SamplingParams(**kw))
    arrive = sorted(rng.randrange(0, 6) for _ in range(n))  # the step before which request i is added
    abort = (rng.randrange(n), rng.randrange(1, 8))  # (request, step)
    eng = _llm(overlap, kv_cache_config={"max_tokens": 128, "tokens_per_block": 16}, max_seq_len=100,
               max_batch_size=3, max_num_tokens=32).engine
    ids, done, seen, step = {}, {}, collections.Counter(), 0
    while len(ids) < n or eng.has_unfinished_requests():
        for i in range(n):
            if i not in ids and arrive[i] <= step:
                ids[i] = eng.add_request(prompts[i], params[i])
        if step == abort[1] and abort[0] in ids:
            req = eng.requests.get(ids[abort[0]])
            seen["abort with a token on the device"] += req is not None and req.num_pending > 0
            eng.abort_request(ids[abort[0]])
        for o in eng.step():
            if o.finished:
                done[o.request_id] = (o.outputs[0].token_ids, o.outputs[0].finish_reason)
                seen[o.outputs[0].finish_reason] += 1
        step += 1
    assert eng.cache.num_free_blocks == eng.cache.num_blocks and eng.cache.num_free_slots == eng.cache.num_slots
    seen["preemptions"] += eng.get_stats()["num_preemptions"]
    aborted = ids.get(abort[0])
    return {i: done.get(ids[i]) for i in range(n) if ids[i] != aborted}, seen


def test_random_workloads_equal_sync():
    """Twelve random mixes, overlap on and off: every request that was not aborted ends with the same tokens
    and reason; the cache is checked after every step and is empty at the end. The mixes reach preemption
    (a request preempted while its token is on the device included), stop tokens and aborts."""
    total = collections.Counter()
    for seed in range(1, 13):
        on, seen = _random_workload(seed, True)
        assert on == _random_workload(seed, False)[0], seed
        total += seen
    assert total["preemptions"] > 0 and total["stop"] > 0 and total["abort with a token on the device"] > 0
