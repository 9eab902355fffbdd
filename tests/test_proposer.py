"""Speculation's propose stage is a plug-in: the engine verifies and accepts whatever a ``Proposer`` drafts, so
greedy output never depends on the drafts, only the acceptance does. A proposer that never touches the MTP
layer (prompt lookup, as a block or n-gram drafter would) plugs in the same way as the MTP's."""

from __future__ import annotations

from dsv4 import LLM, SamplingParams
from dsv4.engine.proposer import MtpProposer, Proposal, Proposer, RewrittenProposer, rewrite_drafts

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [11, 12, 13, 11, 12, 13, 11, 12, 13, 11], [40] * 20]
SP = SamplingParams(max_tokens=12, ignore_eos=True)


class PromptLookup(Proposer):
    """Drafts the k tokens that followed the newest token's last earlier occurrence (zeros when none)."""

    def __init__(self, draft_len: int):
        self.draft_len, self.calls = draft_len, 0

    def propose(self, seqs, plan, target, accepted, drafting):
        self.calls += 1
        out = []
        for s, d in zip(seqs, drafting):
            toks = s.request.tokens
            last = toks[-1]
            i = max((j for j in range(len(toks) - 1) if toks[j] == last), default=None)
            follow = toks[i + 1:i + 1 + self.draft_len] if i is not None else []
            out.append(Proposal(tuple(follow) + (0,) * (self.draft_len - len(follow))) if d else None)
        return out


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _llm(k):
    # (drafting never paused: prompt lookup's few accepted drafts are what the first test counts)
    spec = {"decoding_type": "MTP", "num_nextn_predict_layers": k, "pause_below_acceptance": 0} if k else None
    return LLM("tiny", max_batch_size=4, max_seq_len=64, kv_cache_config={"max_tokens": 512},
               speculative_config=spec, warmup=False)


def test_any_proposer_keeps_greedy_output_and_is_measured():
    ref = _tokens(_llm(0).generate(PROMPTS, SP))
    llm = _llm(2)
    assert isinstance(llm.engine.proposer, MtpProposer)
    lookup = llm.engine.proposer = PromptLookup(2)
    assert _tokens(llm.generate(PROMPTS, SP)) == ref
    st = llm.get_stats()["speculative"]
    assert lookup.calls > 0 and st["num_draft_tokens"] > 0
    # the repeating prompts make prompt lookup right often; random MTP weights almost never are
    assert st["num_accepted_tokens"] > 0


def test_rewritten_proposer_wraps_and_unwraps():
    llm = _llm(1)
    base = llm.engine.proposer
    rewrite_drafts(llm.engine, lambda req, d: d)
    rewrite_drafts(llm.engine, lambda req, d: [0] * len(d))  # replaces, does not stack
    assert isinstance(llm.engine.proposer, RewrittenProposer) and llm.engine.proposer.inner is base
    rewrite_drafts(llm.engine, None)
    assert llm.engine.proposer is base
    assert _llm(0).engine.proposer is None
