"""Test-only drafters, set with ``proposer.rewrite_drafts(engine, fn)``: they replace the MTP's drafts so that
both the accept and the reject branches of verification run, whatever the weights."""

from __future__ import annotations

import random


def oracle(reference: dict[tuple, list[int]], p_right: float, seed: int, vocab: int = 256):
    """For each draft position, the target's known greedy answer (``reference``: prompt ids -> output ids) with
    probability ``p_right``, else a wrong token."""
    rng = random.Random(seed)

    def override(req, drafts):
        answer = reference[tuple(req.prompt_ids)]
        done = len(req.output_ids)
        out = []
        for j, d in enumerate(drafts):
            truth = answer[done + j] if done + j < len(answer) else d
            out.append(truth if rng.random() < p_right else (truth + 1) % vocab)
        return out

    return override
