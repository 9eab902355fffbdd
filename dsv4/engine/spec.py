"""Speculative decoding's accept step and its statistics.

One MTP layer proposes k draft tokens; the target verifies all of them in one forward (k+1 rows).
Greedy: accept the longest prefix of drafts equal to the target's argmax, plus the target's token after it
(the bonus). Sampling: standard rejection sampling against the draft's own distribution q — accept d_j with
probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection sample from norm(max(0, p_j - q_j)); if all
are accepted sample the bonus from p_{k+1}. The emitted tokens are then distributed exactly as the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .sampler import probs_from_logits, sample
from .sampling_params import SamplingParams


def accept_greedy(target: list[int], drafts: list[int]) -> list[int]:
    """target: the target's argmax at the k+1 verify rows. Returns the emitted tokens (accepted drafts + 1)."""
    out = []
    for j, d in enumerate(drafts):
        out.append(target[j])
        if target[j] != d:
            return out
    out.append(target[len(drafts)])
    return out


def accept_sampled(target_logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None,
                   sp: SamplingParams, generator: torch.Generator) -> list[int]:
    """Rejection sampling. target_logits: [k+1, V]; draft_probs: [k, V] (q of each draft) or None if k=0."""
    p = probs_from_logits(target_logits, sp)  # [k+1, V]
    out = []
    for j, d in enumerate(drafts):
        q = draft_probs[j]
        u = torch.rand((), generator=generator, device=p.device)
        if q[d] > 0 and u * q[d] <= p[j, d]:  # accept with prob min(1, p/q)
            out.append(d)
            continue
        residual = (p[j] - q).clamp(min=0)
        mass = residual.sum()
        residual = residual / mass if mass > 0 else p[j]
        out.append(int(sample(residual.unsqueeze(0), generator)))
        return out
    out.append(int(sample(p[len(drafts)].unsqueeze(0), generator)))
    return out


@dataclass
class SpecStats:
    """Acceptance bookkeeping: per draft position j (1-based), how often it was proposed and accepted."""

    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    proposed_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int):
        if num_drafts == 0:
            return
        while len(self.proposed_per_pos) < num_drafts:
            self.proposed_per_pos.append(0)
            self.accepted_per_pos.append(0)
        self.num_verify_steps += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_drafts):
            self.proposed_per_pos[j] += 1
            self.accepted_per_pos[j] += int(j < num_accepted)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_len(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token)."""
        return (self.num_accepted_tokens + self.num_verify_steps) / self.num_verify_steps if self.num_verify_steps else 0.0

    def as_dict(self) -> dict:
        return {
            "num_verify_steps": self.num_verify_steps,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_len": self.mean_accepted_len,
            "per_position_acceptance": [a / p if p else 0.0 for a, p in zip(self.accepted_per_pos, self.proposed_per_pos)],
            "proposed_per_position": list(self.proposed_per_pos),
            "accepted_per_position": list(self.accepted_per_pos),
        }
