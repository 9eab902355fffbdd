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
from typing import Sequence

import torch

from .sampler import greedy_tokens, probs_from_logits, sample
from .scheduler import ScheduledSeq


@dataclass(frozen=True)
class Proposal:
    """One request's drafts for its next step; ``probs`` [k, V] the distributions sampled drafts were drawn
    from (None for greedy requests): rejection sampling needs them at verification."""

    tokens: tuple[int, ...]
    probs: torch.Tensor | None = None


class Proposer:
    """The interface (a base class with the defaults; ``propose`` is the one method to write).

    ``drafts_from_device``: ``propose`` may be handed the step's acceptance still on the device (a
    ``spec.DeviceVerdict``) before the host has read it or appended the step's tokens, so that drafting starts
    without a host round trip; a proposer that reads the requests' tokens leaves it False and gets host counts
    after the tokens are appended."""

    draft_len: int
    drafts_from_device: bool = False

    def propose(self, seqs: list[ScheduledSeq], plan, target, accepted, drafting: list[bool]) -> list[Proposal | None]:
        """The drafts of every seq with ``drafting`` set (None for the others), after this step's target pass
        ``target`` and acceptance (``accepted[b]``: the rows of seq b that stay in the cache, host ints or a
        ``DeviceVerdict``)."""
        raise NotImplementedError

    def drafts(self, request, proposal: Proposal) -> list[int]:
        """The drafts ``request`` carries into its next step; called once the step's tokens are appended."""
        return list(proposal.tokens)


class MtpProposer(Proposer):
    """Drafts from the MTP layer. The draft tokens of every pass stay on the device (greedy rows by argmax,
    sampled rows drawn on the device with their request's generator) and feed the next pass there; the host
    reads all k of them once, after the last pass. It drafts from acceptance on the device when the runner
    can (the single-device runner; the multi-rank driver sends host ints to its ranks)."""

    def __init__(self, runner, draft_len: int):
        self.runner, self.draft_len = runner, draft_len

    @property
    def drafts_from_device(self) -> bool:
        return self.runner.drafts_from_device

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


class RewrittenProposer(Proposer):
    """For tests and benchmarks: ``inner``'s drafts, each rewritten by ``rewrite(request, drafts) -> drafts``
    once the step's tokens are appended (e.g. replaced by the known answer part of the time, so that
    verification accepts and rejects at a chosen rate whatever the weights). Sampled requests keep ``inner``'s
    q, so use it with greedy requests."""

    def __init__(self, inner: Proposer, rewrite):
        self.inner, self.rewrite = inner, rewrite
        self.draft_len = inner.draft_len

    @property
    def drafts_from_device(self) -> bool:
        return self.inner.drafts_from_device

    def propose(self, seqs, plan, target, accepted, drafting) -> list[Proposal | None]:
        return self.inner.propose(seqs, plan, target, accepted, drafting)

    def drafts(self, request, proposal: Proposal) -> list[int]:
        return list(self.rewrite(request, self.inner.drafts(request, proposal)))


def rewrite_drafts(engine, rewrite) -> None:
    """Set (``rewrite`` a function) or clear (None) a RewrittenProposer on ``engine``."""
    base = engine.proposer
    while isinstance(base, RewrittenProposer):
        base = base.inner
    engine.proposer = base if rewrite is None or base is None else RewrittenProposer(base, rewrite)
