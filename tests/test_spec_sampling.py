"""With temperature > 0, MTP leaves the output unchanged: a sampled request's tokens are MTP off's.

Every sampled token is a draw keyed by the request's seed and the token's position (``sampler.sample_keyed``),
and MTP accepts a draft only where it equals the target's own draw. So with the same seed MTP on (k = 1, 2, 3,
drafting paused or not, overlapped or not) emits MTP off's tokens; and the draws are distributed as the target:
a tiny-vocabulary model (16 tokens) makes the exact distribution of the first generated tokens computable with
the dense reference model, and thousands of seeded requests through the engine with MTP k=2 must match it
(chi-square), while a deliberately wrong acceptance rule must not.
"""

import random

import pytest
import torch

from dsv4 import LLM, SamplingParams
from dsv4.checkpoint.init_random import random_state_dict
from dsv4.checkpoint.io import write_checkpoint
from dsv4.config import get_preset
from dsv4.engine import spec as spec_mod
from dsv4.engine.sampler import probs_from_logits
from dsv4.model import load_model

V, PROMPT, N_REQ, TEMP = 16, [3, 7, 1, 12, 5], 2400, 1.5


@pytest.fixture(scope="module")
def small_vocab_dir(tmp_path_factory):
    cfg = get_preset("tiny").replace(vocab_size=V)
    d = str(tmp_path_factory.mktemp("v16"))
    write_checkpoint(d, cfg, random_state_dict(cfg, seed=2))
    return d


def exact_marginals(model_dir):
    """p(x1), p(x2), p(x3) of the first three sampled tokens, from the dense model by enumeration."""
    model = load_model(model_dir)
    sp = SamplingParams(temperature=TEMP)
    p1 = probs_from_logits(model(torch.tensor([PROMPT]))[0, -1], sp)  # [V]
    seq2 = torch.tensor([PROMPT + [a] for a in range(V)])
    p2_given = probs_from_logits(model(seq2)[:, -1], sp)  # [V, V]
    seq3 = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
    p3_given = probs_from_logits(model(seq3)[:, -1], sp).view(V, V, V)
    joint12 = p1[:, None] * p2_given
    return p1, joint12.sum(0), (joint12[..., None] * p3_given).sum((0, 1))


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs.double() * n
    keep = expected >= 5  # pool the rare cells
    obs = torch.cat([counts[keep].double(), counts[~keep].double().sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), chi2 / 2))


def sampled_marginals(model_dir, path: str, verify_path):
    """The first three tokens of N_REQ seeded requests, verified on the device (``spec.accept_on_device``, the
    single-device default) or on the host (``spec.accept_sampled``, what the multi-rank driver runs).
    Sampled requests draft with the target's noise, so drafts are accepted and rejected whatever the
    weights."""
    verify_path["device"] = path == "device"
    llm = LLM(model_dir, max_batch_size=128, max_num_tokens=1024, max_seq_len=64, warmup=False,
              kv_cache_config={"max_tokens": 16384},
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 2,
                                  "pause_below_acceptance": 0})  # (every step verifies drafts)
    outs = llm.generate([PROMPT] * N_REQ, [SamplingParams(max_tokens=3, temperature=TEMP, seed=i, ignore_eos=True)
                                           for i in range(N_REQ)])
    assert verify_path["on_" + path] > 0 and verify_path["on_host" if path == "device" else "on_device"] == 0
    toks = torch.tensor([o.outputs[0].token_ids for o in outs])  # [N, 3]
    stats = llm.get_stats()["speculative"]
    return [torch.bincount(toks[:, j], minlength=V) for j in range(3)], stats


@pytest.mark.parametrize("path", ["device", "host"])
def test_mtp_sampling_matches_the_target_distribution(small_vocab_dir, path, verify_path):
    exact = exact_marginals(small_vocab_dir)
    counts, stats = sampled_marginals(small_vocab_dir, path, verify_path)
    assert 0.05 < stats["acceptance_rate"] < 0.95  # drafts are both accepted and rejected
    for j in range(3):
        assert chi2_pvalue(counts[j], exact[j]) > 1e-3, f"token {j + 1} is not distributed as the target's"


@pytest.mark.parametrize("path", ["device", "host"])
def test_a_wrong_acceptance_rule_is_detected(small_vocab_dir, path, verify_path, monkeypatch):
    """Negative control: accepting every draft (no rejection) must fail the same check, on either path."""
    monkeypatch.setattr(spec_mod, "draft_accepted", lambda target, drafts: drafts >= 0)
    exact = exact_marginals(small_vocab_dir)
    counts, stats = sampled_marginals(small_vocab_dir, path, verify_path)
    assert stats["acceptance_rate"] == 1.0
    assert chi2_pvalue(counts[0], exact[0]) > 1e-3  # token 1 is never speculative
    assert min(chi2_pvalue(counts[j], exact[j]) for j in (1, 2)) < 1e-3


def _sampled_workload(n: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, 256) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(8, 30), ignore_eos=True, temperature=rng.choice([0.7, 1.0, 1.3]),
                             top_k=rng.choice([0, 20]), top_p=rng.choice([1.0, 0.9]), seed=rng.choice([None, i]))
              for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("k, overlap, pause, path", [(1, True, False, "device"), (2, False, False, "device"),
                                                     (3, True, True, "device"), (2, False, True, "host")])
def test_sampled_requests_emit_mtp_off_tokens(k, overlap, pause, path, verify_path):
    """Seeded sampled requests (temperatures, top-k, top-p), a greedy one beside them: MTP on emits MTP off's
    tokens for every one, with drafts accepted and rejected, overlapped or not, verified on the device or on
    the host (positions from the plan on the device, or the request's length), with drafting paused and resumed
    (forced often) or not."""
    verify_path["device"] = path == "device"
    from dsv4.engine.spec_pause import DraftPause

    prompts, params = _sampled_workload(10, k)
    params[3] = SamplingParams(max_tokens=20, ignore_eos=True)  # greedy beside them
    kw = dict(max_batch_size=8, max_num_tokens=64, max_seq_len=128, warmup=False)
    keyed = [i for i, sp in enumerate(params) if sp.seed is not None or sp.greedy]
    off = LLM("tiny", **kw).generate(prompts, params)
    llm = LLM("tiny", disable_overlap_scheduler=not overlap,
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": k}, **kw)
    if pause:
        llm.engine.pause = DraftPause(0.5, window=2, probe_every=3)
    on = llm.generate(prompts, params)
    for i in keyed:
        assert on[i].outputs[0].token_ids == off[i].outputs[0].token_ids, i
    st = llm.get_stats()["speculative"]
    assert 0 < st["num_accepted_tokens"] < st["num_draft_tokens"]
    if pause:
        assert llm.engine.pause.num_pauses > 0 and llm.engine.pause.num_paused_steps > 0
    assert verify_path["on_" + path] > 0 and verify_path["on_host" if path == "device" else "on_device"] == 0


def test_keyed_draws_follow_p_and_depend_only_on_key_and_position():
    """``sample_keyed``: over many keys one position's draws are distributed as p (chi-square; a token of p = 0
    never comes); the same (key, position, p) gives the same token in any batch; other positions or keys give
    other noise; seeds fold to 32-bit keys, and a request without a seed gets a random key."""
    from dsv4.engine.sampler import race_noise, request_key, sample_keyed

    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    n = 6000
    keys = torch.arange(n) * 7919 + 12345
    toks = sample_keyed(p.expand(n, -1), keys, torch.full((n,), 37))
    counts = torch.bincount(toks, minlength=6)
    assert counts[5] == 0 and chi2_pvalue(counts[:5], p[:5]) > 1e-3
    assert chi2_pvalue(torch.bincount(sample_keyed(p.expand(n, -1), torch.full((n,), 99), torch.arange(n)),
                                      minlength=6)[:5], p[:5]) > 1e-3  # one key over many positions too
    one = sample_keyed(p.expand(3, -1), keys[[5, 5, 9]], torch.tensor([37, 37, 37]))
    assert one[0] == one[1] == toks[5] and one[2] == toks[9]
    E = race_noise(torch.tensor([1, 1, 2]), torch.tensor([10, 11, 10]), 64)
    assert (E > 0).all() and torch.isfinite(E).all()
    assert not torch.equal(E[0], E[1]) and not torch.equal(E[0], E[2])
    assert request_key(7) == request_key(7) != request_key(8) and 0 <= request_key(2 ** 70 + 3) < 2 ** 32
    assert len({request_key(None) for _ in range(8)}) > 1
