"""Logprobs (``SamplingParams.logprobs``) against the dense reference model: every output token's dict holds
log_softmax of the dense model's logits (``load_model``, the full sequence at once) at the position that
produced the token, for the token and the top n, in every engine path: the synchronous step and the overlap
scheduler (MTP off), and MTP steps with acceptance on the device and on the host, greedy and sampled, with
stop tokens and max_tokens cutting a step's tokens. A request that does not ask gets None."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.engine.proposer import rewrite_drafts
from dsv4.model import load_model

from .drafters import oracle

PRESET = "tiny"
TOL = 1e-4  # engine (paged, chunked) against dense, fp32 on the CPU


def _llm(**kw) -> LLM:
    return LLM(PRESET, warmup=False, max_batch_size=4, max_num_tokens=48, max_seq_len=160,
               kv_cache_config={"max_tokens": 2048}, **kw)


def _prompts(lens, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(2, 256) for _ in range(L)] for L in lens]


PROMPTS = _prompts([5, 70, 17, 3, 9])  # the 70-token prompt prefills in two chunks (max_num_tokens 48)


@pytest.fixture(scope="module")
def dense():
    return load_model(PRESET)


@pytest.fixture(scope="module")
def plain():
    """MTP off; its greedy answers are the oracle drafter's reference for the MTP runs."""
    return _llm()


@pytest.fixture(scope="module")
def answers(plain):
    out = plain.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, out)}


def check(dense, prompt: list[int], out, n: int | None) -> None:
    """``out``'s logprobs equal the dense model's at each output position: the chosen token's and the top n
    (a top-n set may differ only by tokens tied with the n-th within TOL)."""
    comp = out.outputs[0]
    if n is None:
        assert comp.logprobs is None
        return
    ids = comp.token_ids
    assert ids and len(comp.logprobs) == len(ids)
    with torch.no_grad():
        lp = torch.log_softmax(dense(torch.tensor([prompt + ids]))[0].float(), dim=-1)
    P = len(prompt)
    for i, (t, got) in enumerate(zip(ids, comp.logprobs)):
        row = lp[P - 1 + i]  # the logits that chose output token i
        top = row.topk(n) if n else None
        want = {t: row[t].item()}
        if n:
            want.update(zip(top.indices.tolist(), top.values.tolist()))
        assert t in got and len(got) == len(want), (i, got, want)
        for k in set(got) ^ set(want):  # a near tie at the n-th place
            assert abs(row[k].item() - top.values[-1].item()) < TOL, (i, got, want)
        for k, v in got.items():
            assert abs(v - row[k].item()) < TOL, (i, k, v, row[k].item())


def test_sampling_params_logprobs_validated():
    for ok in (None, 0, 1, 20):
        assert SamplingParams(logprobs=ok).logprobs == ok
    for bad in (-1, 21, 1.5, True, "2"):
        with pytest.raises(ValueError, match="logprobs must be None or an integer in"):
            SamplingParams(logprobs=bad)


PARAMS = [  # (params, its logprobs n): greedy and sampled, n = 0, top n, and none at all
    SamplingParams(max_tokens=9, ignore_eos=True, logprobs=0),
    SamplingParams(max_tokens=7, ignore_eos=True, logprobs=5),
    SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, top_k=20, seed=3, logprobs=2),
    SamplingParams(max_tokens=6, ignore_eos=True),
    SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, top_p=0.9, seed=5, logprobs=20),
]


@pytest.mark.parametrize("overlap", [False, True])
def test_logprobs_equal_the_dense_model(dense, plain, monkeypatch, count_overlapped, overlap):
    monkeypatch.setattr(plain.engine, "overlap_scheduler", overlap)
    outs = plain.generate(PROMPTS, PARAMS)
    assert (sum(count_overlapped) > 0) == overlap  # the overlapped steps ran (and only with overlap on)
    for p, sp, o in zip(PROMPTS, PARAMS, outs):
        check(dense, p, o, sp.logprobs)
    # a stop token cuts the output (the overlapped step after it has already launched its token)
    ids = outs[0].outputs[0].token_ids
    stop = SamplingParams(max_tokens=9, ignore_eos=True, logprobs=3, stop_token_ids=[ids[3]])
    cut = plain.generate([PROMPTS[0]], stop)[0]
    assert cut.outputs[0].finish_reason == "stop" and cut.outputs[0].token_ids == ids[:ids.index(ids[3]) + 1]
    check(dense, PROMPTS[0], cut, 3)


@pytest.fixture(scope="module", params=[1, 2], ids=["k1", "k2"])
def mtp(request):
    return request.param, _llm(speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": request.param})


@pytest.mark.parametrize("path", ["device", "host"])
def test_logprobs_with_mtp(dense, answers, mtp, verify_path, path):
    """Drafts right part of the time (the oracle), so verify steps emit up to k+1 tokens from their verify
    rows; stop tokens and max_tokens cut inside such steps."""
    k, llm = mtp
    verify_path["device"] = path == "device"
    orc = oracle(answers, 0.7, seed=k)
    rewrite_drafts(llm.engine, lambda req, drafts: orc(req, drafts) if req.params.greedy else drafts)
    llm.engine.reset_stats()
    ref = answers[tuple(PROMPTS[4])]
    params = PARAMS[:4] + [SamplingParams(max_tokens=20, ignore_eos=True, logprobs=4, stop_token_ids=[ref[11]])]
    try:
        outs = llm.generate(PROMPTS, params)
    finally:
        rewrite_drafts(llm.engine, None)
    for p, sp, o in zip(PROMPTS, params, outs):
        check(dense, p, o, sp.logprobs)
        if sp.greedy:
            assert o.outputs[0].token_ids == answers[tuple(p)][:len(o.outputs[0].token_ids)]
    assert outs[4].outputs[0].finish_reason == "stop" and outs[4].outputs[0].token_ids[-1] == ref[11]
    assert llm.get_stats()["speculative"]["num_accepted_tokens"] > 0  # verify steps emitted several tokens
    assert (verify_path["on_device"] > 0) == (path == "device")


def test_stats_report_live_use_and_first_scheduled_time(plain):
    eng = plain.engine
    rid = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=3))
    stats = eng.get_stats()
    assert (stats["num_running"], stats["num_waiting"]) == (0, 1)
    assert eng.requests[rid].first_scheduled_time is None
    eng.step()  # the first chunk of its prefill
    stats, req = eng.get_stats(), eng.requests[rid]
    assert (stats["num_running"], stats["num_waiting"]) == (1, 0)
    kv = stats["kv_cache_usage"]
    assert 0 < kv["used_blocks"] <= kv["num_blocks"] and kv["used_slots"] == 1
    assert req.arrival_time <= req.first_scheduled_time and req.first_token_time is None
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    m = outs[-1].metrics
    assert m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"] <= m["finish_time"]
    eng.abort_request(rid)
    stats = eng.get_stats()
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0)
    assert stats["kv_cache_usage"]["used_blocks"] == 0 and stats["kv_cache_usage"]["used_slots"] == 0
