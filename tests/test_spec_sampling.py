"""With temperature > 0, MTP rejection sampling leaves the output distribution unchanged.

A tiny-vocabulary model (16 tokens) makes the exact distribution of the first generated tokens computable
with the dense reference model; thousands of seeded requests through the engine with MTP k=2 must match it
(chi-square), and a deliberately wrong acceptance rule must not.
"""

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
    single-device default) or on the host (``spec.accept_sampled``, what the multi-rank driver runs)."""
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
    monkeypatch.setattr(spec_mod, "draft_accepted", lambda u, q_d, p_d: torch.ones_like(u, dtype=torch.bool))
    exact = exact_marginals(small_vocab_dir)
    counts, stats = sampled_marginals(small_vocab_dir, path, verify_path)
    assert stats["acceptance_rate"] == 1.0
    assert chi2_pvalue(counts[0], exact[0]) > 1e-3  # token 1 is never speculative
    assert min(chi2_pvalue(counts[j], exact[j]) for j in (1, 2)) < 1e-3
