"""Speculation's first stage: a proposer turns a verified step into the next step's draft tokens.

The engine's speculative step is ``propose -> verify -> accept``: the target pass verifies the drafts a step
carries (``spec.accept_greedy`` / ``accept_sampled`` accept a prefix), then the proposer drafts the next
step's tokens from what was accepted. ``Proposer`` is the interface; ``MtpProposer`` drafts with the model's
MTP layer through the model runner's passes (a catch-up pass over the step's rows, then passes 2..k, one token
per request). A block drafter would implement the same interface. Test and benchmark drafters (an oracle that
knows the answer part of the time) wrap a proposer; the engine has no hook for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from .sampler import greedy_tokens, probs_from_logits, sample
from .scheduler import ScheduledSeq


@dataclass(frozen=True)
class Proposal:
    """One request's drafts for its next step; ``probs`` [k, V] the distributions sampled drafts were drawn
    from (None for greedy requests): rejection sampling needs them at verification."""

    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    draft_len: int

    def propose(self, seqs: list[ScheduledSeq], plan, target, accepted: list[int],
                drafting: list[bool]) -> list[Proposal | None]:
        """The drafts of every seq with ``drafting`` set (None for the others), after this step's target pass
        ``target`` and acceptance (``accepted[b]``: the rows of seq b that stay in the cache)."""
        ...


class MtpProposer:
    """Drafts from the MTP layer. The draft tokens of every pass stay on the device (greedy rows by argmax,
    sampled rows drawn on the device with their request's generator) and feed the next pass there; the host
    reads all k of them once, after the last pass."""

    def __init__(self, runner, draft_len: int):
        self.runner, self.draft_len = runner, draft_len

    def propose(self, seqs, plan, target, accepted, drafting) -> list[Proposal | None]:
        probs: dict[int, list[torch.Tensor]] = {}
        drafts = self.runner.propose(seqs, plan, target, accepted, drafting, self.draft_len,
                                     lambda rows, j, logits: choose_drafts(seqs, rows, logits, probs))
        return [Proposal(tuple(drafts[b]), torch.stack(probs[b]) if b in probs else None) if drafting[b] else None
                for b in range(len(seqs))]


def choose_drafts(seqs: Sequence[ScheduledSeq], rows: Sequence[int], logits: torch.Tensor,
                  keep: dict) -> torch.Tensor:
    """Draft tokens [len(rows)] on the device from the MTP logits [len(rows), V] of batch rows ``rows``: greedy
    requests take the argmax, sampled ones draw from q (kept in ``keep[b]`` for verification)."""
    out = greedy_tokens(logits)
    for i, b in enumerate(rows):
        req = seqs[b].request
        if not req.params.greedy:
            q = probs_from_logits(logits[i:i + 1], req.params)
            keep.setdefault(b, []).append(q[0])
            out[i:i + 1] = sample(q, req.generator)
    return out


class RewrittenProposer:
    """For tests and benchmarks: ``inner``'s drafts, each rewritten by ``rewrite(request, drafts) -> drafts``
    (e.g. replaced by the known answer part of the time, so that verification accepts and rejects at a chosen
    rate whatever the weights). Sampled requests keep ``inner``'s q, so use it with greedy requests."""

    def __init__(self, inner: Proposer, rewrite):
        self.inner, self.rewrite = inner, rewrite
        self.draft_len = inner.draft_len

    def propose(self, seqs, plan, target, accepted, drafting) -> list[Proposal | None]:
        out = self.inner.propose(seqs, plan, target, accepted, drafting)
        return [None if p is None else Proposal(tuple(self.rewrite(s.request, list(p.tokens))), p.probs)
                for s, p in zip(seqs, out)]


def rewrite_drafts(engine, rewrite) -> None:
    """Set (``rewrite`` a function) or clear (None) a RewrittenProposer on ``engine``."""
    base = engine.proposer
    while isinstance(base, RewrittenProposer):
        base = base.inner
    engine.proposer = base if rewrite is None or base is None else RewrittenProposer(base, rewrite)
