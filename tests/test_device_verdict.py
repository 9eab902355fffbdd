"""Acceptance on the device (``spec.accept_on_device``) and the MTP inputs drafted from it
(``runner.device_draft_inputs``) against their host twins (``accept_greedy``, ``draft_inputs``), and the engine
step that uses them against the same engine forced onto the host path: random workloads with chunked prefill,
preemption, aborts and sampled requests, the cache's integrity checked after every step."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.engine.proposer import rewrite_drafts
from dsv4.engine.request import Request
from dsv4.engine.runner import draft_inputs, device_draft_inputs
from dsv4.engine.scheduler import ScheduledSeq
from dsv4.engine.spec import accept_greedy, accept_on_device

from .drafters import oracle

V = 50


@dataclass
class Case:
    seqs: list[ScheduledSeq]
    num_computed: list[int]
    logits: torch.Tensor  # [R, V] the verify rows


def _case(rng: random.Random, B: int) -> Case:
    """B seqs of a random step: decode/verify seqs with 0..3 drafts, last prefill chunks (they sample one
    row) and middle chunks (they sample none). Logits make the drafts right about half the time."""
    seqs, C, rows = [], [], []
    for b in range(B):
        kind = rng.choice(["verify", "verify", "last_chunk", "mid_chunk"])
        prompt = [rng.randrange(V) for _ in range(rng.randint(3, 9))]
        req = Request(str(b), prompt, SamplingParams(max_tokens=8))
        if kind == "verify":
            req.output_ids = [rng.randrange(V) for _ in range(rng.randint(1, 4))]
            drafts = tuple(rng.randrange(V) for _ in range(rng.randint(0, 3)))
            c = req.num_tokens - 1
            toks = (req.token_at(c),) + drafts
            seqs.append(ScheduledSeq(req, toks, True, drafts))
            for j in range(len(drafts) + 1):  # argmax = the draft this row checks, or a random token
                want = drafts[j] if j < len(drafts) and rng.random() < 0.5 else rng.randrange(V)
                rows.append(want)
        else:
            c = rng.randrange(len(prompt) - 1)
            n = len(prompt) - c if kind == "last_chunk" else rng.randint(1, len(prompt) - 1 - c)
            seqs.append(ScheduledSeq(req, tuple(prompt[c:c + n]), kind == "last_chunk", ()))
            if kind == "last_chunk":
                rows.append(rng.randrange(V))
        C.append(c)
    logits = torch.randn(len(rows), V)
    for r, t in enumerate(rows):
        logits[r, t] = 10.0
    return Case(seqs, C, logits)


def _host(case: Case) -> tuple[list[int], list[list[int]]]:
    """accepted rows and emitted tokens per seq, as the engine's host path computes them."""
    ids = case.logits.argmax(-1).tolist()
    acc, toks, r = [], [], 0
    for s in case.seqs:
        if not s.sample:
            acc.append(s.num_new)
            toks.append([])
            continue
        n = len(s.drafts) + 1
        t = accept_greedy(ids[r:r + n], list(s.drafts))
        r += n
        acc.append(s.num_new - len(s.drafts) + len(t) - 1)
        toks.append(t)
    return acc, toks


@pytest.mark.parametrize("seed", range(40))
def test_device_acceptance_and_draft_inputs_equal_the_host_twins(seed):
    rng = random.Random(seed)
    case = _case(rng, rng.randint(1, 6))
    acc, toks = _host(case)
    verdict = accept_on_device(case.seqs, case.logits)
    ids, rows = verdict.read()
    assert rows == acc
    assert verdict.accepted_drafts.tolist() == [len(t) - 1 if s.sample else 0 for s, t in zip(case.seqs, toks)]
    assert [len(i) for i in ids] == [len(s.drafts) + 1 if s.sample else 0 for s in case.seqs]

    drafting = [s.sample and rng.random() < 0.8 for s in case.seqs]
    dev = device_draft_inputs(case.seqs, case.num_computed, verdict, drafting)
    for s, t in zip(case.seqs, toks):  # the host twin reads the tokens the step appended
        s.request.output_ids += t
    host = draft_inputs(case.seqs, case.num_computed, acc, drafting)
    assert dev.next_ids.tolist() == list(host.next_ids)
    assert dev.picks.tolist() == list(host.picks)
    assert dev.new_lens.tolist() == list(host.new_lens)
    assert dev.active == host.active


@pytest.mark.parametrize("seed", range(10))
def test_next_tokens_are_each_rows_token_at(seed):
    """``runner._next_tokens`` (list slices) against the definition row by row: the token after each position,
    pending ones as PENDING, 0 past the request's length (chunks reaching past it, starting past it)."""
    from dsv4.engine.runner import _next_tokens

    rng = random.Random(seed)
    req = Request("r", [rng.randrange(V) for _ in range(rng.randint(1, 9))], SamplingParams(max_tokens=8))
    req.output_ids = [rng.randrange(V) for _ in range(rng.randint(0, 4))]
    req.num_pending = rng.randint(0, 2)
    L = req.num_tokens
    for C in range(L + 2):
        for n in range(0, L - C + 4):
            want = [req.token_at(C + i + 1) if C + i + 1 < L else 0 for i in range(n)]
            assert _next_tokens(req, C, n) == want, (C, n)


SAMPLED = (1, 9)  # the sampled requests of a mixed workload


def _workload(n: int, seed: int, sampled: tuple[int, ...] = ()):
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 100))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in range(n)]
    for i in sampled:
        params[i] = SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True, temperature=0.8, top_k=20,
                                   seed=rng.randrange(1000))
    return prompts, params


def _run(k: int, verify_path: dict, on_device: bool, prompts, params, abort_at: dict[int, int]):
    """Drive the engine step by step (aborting request i at step abort_at[i]); returns every request's
    output, the stats, how many verify steps took each path and every draft the MTP proposed."""
    llm = LLM("tiny", max_batch_size=6, max_num_tokens=48, max_seq_len=160,
              kv_cache_config={"max_tokens": 384, "tokens_per_block": 16},  # room for ~2 growing sequences
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k,
                                  "pause_below_acceptance": 0},  # every step drafts: every verify compared
              warmup=False)
    eng = llm.engine
    verify_path.update(device=on_device, on_device=0, on_host=0)
    ref = LLM("tiny", max_batch_size=8, max_seq_len=160, warmup=False).generate(
        prompts, [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True) for p in params])
    answers = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, ref)}
    orc = oracle(answers, 0.6, seed=k, vocab=256)  # accept and reject both run

    def rewrite(req, drafts):  # the MTP's own drafts are recorded before the oracle replaces them
        proposed.append((req.request_id, len(req.output_ids), tuple(drafts)))
        return orc(req, drafts)

    proposed = []
    rewrite_drafts(eng, rewrite)
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    step = 0
    while eng.has_unfinished_requests():
        eng.step()
        step += 1
        for i, at in abort_at.items():
            if at == step:
                eng.abort_request(rids[i])
    outs = {r: (list(eng.requests[r].output_ids), eng.requests[r].finish_reason) for r in rids
            if r in eng.requests}
    assert eng.cache.num_free_blocks == eng.cache.num_blocks
    stats = llm.get_stats()
    return outs, stats, dict(verify_path), proposed, answers, rids


@pytest.mark.parametrize("k", [1, 3])
def test_engine_on_device_equals_host_path(k, verify_path):
    """Greedy requests: the same tokens, drafts, acceptance and preemptions either way."""
    prompts, params = _workload(10, seed=1)
    abort_at = {2: 3, 7: 6}
    dev, dev_stats, n_dev, dev_drafts, *_ = _run(k, verify_path, True, prompts, params, abort_at)
    host, host_stats, n_host, host_drafts, *_ = _run(k, verify_path, False, prompts, params, abort_at)
    assert n_dev["on_device"] > 0 and n_host["on_device"] == 0
    assert dev == host
    assert len(dev_drafts) > 20 and dev_drafts == host_drafts  # the MTP drafted the same from the device path
    assert dev_stats["speculative"] == host_stats["speculative"]
    assert dev_stats["speculative"]["num_accepted_tokens"] > 0  # the oracle's right drafts were accepted
    assert dev_stats["num_preemptions"] == host_stats["num_preemptions"] and dev_stats["num_preemptions"] > 0


@pytest.mark.parametrize("k", [1, 2])
def test_mixed_greedy_and_sampled_steps_verify_on_the_device(k, verify_path):
    """Sampled requests verify on the device too (their keyed draws, ``spec.accept_on_device``; their
    distribution and MTP off's tokens are tests/test_spec_sampling.py's): every drafting step takes the device
    path, greedy requests keep MTP off's tokens beside them, and a seeded request draws the same tokens again."""
    prompts, params = _workload(10, seed=1, sampled=SAMPLED)
    runs = [_run(k, verify_path, True, prompts, params, {}) for _ in range(2)]
    outs, stats, seen, _, answers, rids = runs[0]
    assert seen["on_device"] > 0 and seen["on_host"] == 0 and outs == runs[1][0]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        toks, _ = outs[rids[i]]
        assert len(toks) == sp.max_tokens
        if i not in SAMPLED:
            assert toks == answers[tuple(p)]
    assert stats["speculative"]["num_accepted_tokens"] > 0
