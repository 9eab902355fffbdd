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

from ..transfer import HostCopy, to_device
from .runner import DraftTokens
from .sampler import greedy_tokens, sample_rows
from .scheduler import ScheduledSeq


@dataclass(frozen=True)
class Proposal:
    """One request's drafts for its next step."""

    tokens: tuple[int, ...]


@dataclass(frozen=True)
class DeviceProposals:
    """Every sampling seq's drafts for its next step, left on the device (``propose_on_device``): the engine may
    launch that step before the host reads them."""

    drafts: DraftTokens  # one row per sampling seq, in step order
    host: HostCopy | None  # drafts.tokens on their way to the host (None: no seq drafts)

    @staticmethod
    def of(drafts: DraftTokens) -> DeviceProposals:
        """Queue the drafts' copy to the host now (the engine reads it after launching the next step)."""
        return DeviceProposals(drafts, HostCopy(drafts.tokens) if drafts.tokens is not None else None)

    def read(self) -> list[list[int]]:
        """Per seq, its drafts on the host ([] for a seq that does not sample); waits for their copy only."""
        return self.drafts.per_seq(self.host.tolist() if self.host is not None else [])


class Proposer:
    """The interface (a base class with the defaults; ``propose`` is the one method to write).

    ``drafts_from_device``: ``propose`` may be handed the step's acceptance still on the device (a
    ``spec.DeviceVerdict``) before the host has read it or appended the step's tokens, so that drafting starts
    without a host round trip; a proposer that reads the requests' tokens leaves it False and gets host counts
    after the tokens are appended.

    ``overlaps``: ``propose_on_device`` drafts from a verdict on the device and leaves its drafts there, so the
    engine can launch the next step (which verifies them) before it reads this one back (the overlap
    scheduler with MTP)."""

    draft_len: int
    drafts_from_device: bool = False
    overlaps: bool = False
    # the drafts are the model's MTP passes with greedy choice, so the runner may compute them in the step's
    # own CUDA graph (``ModelRunner.has_step_graph``); ``propose`` then takes them from ``target.step``
    in_step_graph: bool = False

    def propose(self, seqs: list[ScheduledSeq], plan, target, accepted, drafting: list[bool]) -> list[Proposal | None]:
        """The drafts of every seq with ``drafting`` set (None for the others), after this step's target pass
        ``target`` and acceptance (``accepted[b]``: the rows of seq b that stay in the cache, host ints or a
        ``DeviceVerdict``)."""
        raise NotImplementedError

    def drafts(self, request, proposal: Proposal) -> list[int]:
        """The drafts ``request`` carries into its next step; called once the step's tokens are appended."""
        return list(proposal.tokens)

    def propose_on_device(self, seqs, plan, target, verdict, drafting: list[bool]) -> DeviceProposals:
        """The drafts of every seq with ``drafting`` set (every seq that samples, or none while the engine's
        drafting is paused), from a ``DeviceVerdict``, left on the device (``overlaps``)."""
        raise NotImplementedError(f"{type(self).__name__} drafts on the host only (overlaps = False)")


class MtpProposer(Proposer):
    """Drafts from the MTP layer. The draft tokens of every pass stay on the device (greedy rows by argmax,
    sampled rows drawn on the device with their request's generator) and feed the next pass there; the host
    reads all k of them once, after the last pass. It drafts from acceptance on the device (every runner's
    ``propose`` takes a ``DeviceVerdict``: the multi-rank driver broadcasts the inputs it computes from it to its
    ranks)."""

    def __init__(self, runner, draft_len: int):
        self.runner, self.draft_len = runner, draft_len

    drafts_from_device = overlaps = True
    in_step_graph = True

    def propose(self, seqs, plan, target, accepted, drafting) -> list[Proposal | None]:
        if target.step is not None:
            tokens = self._from_step_graph(seqs, target).read()
            return [Proposal(tuple(t)) for t in tokens]
        tokens = self._draft(seqs, plan, target, accepted, drafting).tolist()
        return [Proposal(tuple(tokens[b])) if drafting[b] else None for b in range(len(seqs))]

    def propose_on_device(self, seqs, plan, target, verdict, drafting) -> DeviceProposals:
        if target.step is not None:
            return self._from_step_graph(seqs, target)
        return DeviceProposals.of(self._draft(seqs, plan, target, verdict, drafting))

    def _from_step_graph(self, seqs, target) -> DeviceProposals:
        """The drafts the step's graph computed (every seq samples greedily), read from its one host copy; none
        from a keep-up bucket's step (drafting paused)."""
        if target.step.drafts.shape[1] == 0:
            return DeviceProposals(DraftTokens(len(seqs), (), None, target.step.new_lens[:len(seqs)]), None)
        return DeviceProposals(self.runner.step_graph_drafts(target, len(seqs)),
                               target.step.drafts_host(len(seqs)))

    def _draft(self, seqs, plan, target, accepted, drafting) -> DraftTokens:
        return self.runner.propose(seqs, plan, target, accepted, drafting, self.draft_len,
                                   lambda rows, logits, positions: choose_drafts(seqs, rows, logits, positions))


def choose_drafts(seqs: Sequence[ScheduledSeq], rows: Sequence[int], logits: torch.Tensor,
                  positions) -> torch.Tensor:
    """Draft tokens [len(rows)] on the device from the MTP logits [len(rows), V] of batch rows ``rows``: greedy
    requests take the argmax; sampled ones draw from the MTP layer's q with the noise the target's draw at the
    same position will use (``sampler.sample_rows``; ``positions()`` gives the drafts' positions [len(rows)],
    asked only then), so a draft is the target's token whenever the two races agree."""
    out = greedy_tokens(logits)
    drawn = [i for i, b in enumerate(rows) if not seqs[b].request.params.greedy]
    if drawn:
        at = to_device(drawn, logits.device)
        reqs = [seqs[rows[i]].request for i in drawn]
        out[at] = sample_rows(logits[at], [r.params for r in reqs], [r.key for r in reqs], positions()[at])
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


class KnownAnswerProposer(Proposer):
    """For tests and benchmarks: ``inner``'s drafts, each replaced by the request's known answer (``answers``:
    prompt ids -> the output ids greedy decoding gives) with probability ``p_right``, else by a wrong token,
    so that verification accepts and rejects at a chosen rate whatever the weights. Unlike
    ``RewrittenProposer`` it works on the device (the answers live there, each draft's position comes from
    the device's accepted lengths), so it keeps the overlap scheduler's MTP steps. Whether draft j of a request
    is right is a hash of (the request's answer, the position), the same on every path (host, device,
    overlapped). Sampled requests keep ``inner``'s q: use it with greedy requests."""

    def __init__(self, inner: Proposer, answers: dict, p_right: float, vocab: int, seed: int = 0):
        self.inner, self.draft_len = inner, inner.draft_len
        self.p_right, self.vocab, self.seed = p_right, vocab, seed
        self._key = {tuple(p): i for i, p in enumerate(answers)}
        self._answers = [list(a) for a in answers.values()]
        self._device_answers: dict = {}

    @property
    def drafts_from_device(self) -> bool:
        return self.inner.drafts_from_device

    @property
    def overlaps(self) -> bool:
        return self.inner.overlaps

    @property
    def in_step_graph(self) -> bool:
        return self.inner.in_step_graph

    def _right(self, key, index):  # (python ints or int64 tensors alike)
        return (key * 1000003 + index * 7919 + self.seed * 104729) % 1009 < round(self.p_right * 1009)

    def propose(self, seqs, plan, target, accepted, drafting) -> list[Proposal | None]:
        return self.inner.propose(seqs, plan, target, accepted, drafting)  # (rewritten by ``drafts``)

    def drafts(self, request, proposal: Proposal) -> list[int]:
        key, done = self._key[tuple(request.prompt_ids)], len(request.output_ids)
        ans = self._answers[key]
        out = []
        for j, d in enumerate(proposal.tokens):  # draft j is output token done + j
            i = done + j
            if i < len(ans):
                out.append(ans[i] if self._right(key, i) else (ans[i] + 1) % self.vocab)
            else:
                out.append(d)
        return out

    def propose_on_device(self, seqs, plan, target, verdict, drafting) -> DeviceProposals:
        p = self.inner.propose_on_device(seqs, plan, target, verdict, drafting)
        d = p.drafts
        if d.tokens is None:
            return p
        dev = d.tokens.device
        table = self._device_answers.get(dev)
        if table is None:
            width = max([len(a) for a in self._answers] + [1])
            table = torch.full((len(self._answers), width), -1, dtype=torch.long)
            for i, a in enumerate(self._answers):
                table[i, :len(a)] = torch.tensor(a, dtype=torch.long)
            table = self._device_answers[dev] = table.to(dev)
        rows = [seqs[b].request for b in d.active]
        t = to_device([self._key[tuple(r.prompt_ids)] for r in rows] + [len(r.prompt_ids) for r in rows] + list(d.active),
                      dev)
        A = len(rows)
        key, P, act = t[:A, None], t[A:2 * A, None], t[2 * A:]
        k = d.tokens.shape[1]
        # draft j (1-based) of seq b is the token at position new_lens[b] + j: output index that - P
        index = d.new_lens[act][:, None] + torch.arange(1, k + 1, device=dev)[None, :] - P
        ok = (index >= 0) & (index < table.shape[1])
        truth = table[key, index.clamp(0, table.shape[1] - 1)]
        ok &= truth >= 0
        tokens = torch.where(ok, torch.where(self._right(key, index), truth, (truth + 1) % self.vocab), d.tokens)
        return DeviceProposals.of(DraftTokens(d.num_seqs, d.active, tokens, d.new_lens))


def _base(engine) -> Proposer | None:
    base = engine.proposer
    while isinstance(base, (RewrittenProposer, KnownAnswerProposer)):
        base = base.inner
    return base


def rewrite_drafts(engine, rewrite) -> None:
    """Set (``rewrite`` a function) or clear (None) a RewrittenProposer on ``engine`` (it drafts on the host:
    MTP steps no longer overlap)."""
    base = _base(engine)
    engine.proposer = base if rewrite is None or base is None else RewrittenProposer(base, rewrite)


def use_known_answers(engine, answers: dict | None, p_right: float = 0.0, seed: int = 0) -> None:
    """Set (``answers``: prompt ids -> greedy output ids) or clear (None) a KnownAnswerProposer on ``engine``."""
    base = _base(engine)
    engine.proposer = (base if answers is None or base is None
                       else KnownAnswerProposer(base, answers, p_right, engine.model_cfg.vocab_size, seed))
