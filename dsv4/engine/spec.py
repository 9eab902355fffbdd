"""Speculative decoding's accept step and its statistics.

One MTP layer proposes k draft tokens; the target verifies all of them in one forward (k+1 rows). Every verify
row j has the target's own token for its position: the argmax for a greedy request, for a sampled one the
draw keyed by the request's key and that position (``sampler.sample_keyed``: the token MTP off draws there).
The drafts are accepted while they equal those tokens; the seq emits the accepted drafts, then the target's
token at the first row that differs (or at the last row: the bonus). A sampled request's tokens are therefore
MTP off's, not only distributed as the target's; its drafts are drawn with the same keyed noise
(``proposer.choose_drafts``), so a draft is accepted when the MTP layer's race and the target's agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..transfer import HostCopy, to_device
from .sampler import greedy_tokens, sample_rows
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


def draft_accepted(target: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """The acceptance rule of a sampled request's drafts, elementwise: a draft is accepted where it is the
    target's own draw at its row (-1, no draft, never is)."""
    return target == drafts


def accept_sampled(target_logits: torch.Tensor, drafts: list[int], sp: SamplingParams, key: int,
                   position: int) -> list[int]:
    """The host's verify of a sampled request: target_logits [k+1, V] at its verify rows, the first of which
    draws the token at sequence ``position``. Returns the emitted tokens (the accepted drafts, then the
    target's draw at the first row that rejects, or the bonus)."""
    k = len(drafts)
    t = sample_rows(target_logits, [sp] * (k + 1), [key] * (k + 1),
                    torch.arange(position, position + k + 1, device=target_logits.device))
    ok = draft_accepted(t[:k], torch.tensor(drafts, dtype=torch.long, device=t.device))
    a = int(ok.long().cumprod(0).sum()) if k else 0
    return list(drafts[:a]) + [int(t[a])]


@dataclass(frozen=True)
class DeviceVerdict:
    """Greedy verification of a step left on the device, so that the proposer drafts from it before the host
    reads anything (one host read per MTP step instead of one after verify and one after the drafts).

    ``accept_greedy`` on the host gives the same answer from the same argmax; the engine checks that it does.
    """

    target_ids: torch.Tensor  # [R] per verify row, seqs in order: the argmax (a greedy seq), emitted tokens (sampled)
    accepted_drafts: torch.Tensor  # [B] drafts each seq accepted (0 for a seq that samples nothing)
    accepted_rows: torch.Tensor  # [B] rows of each seq's step that stay in the cache
    rows_per_seq: tuple[int, ...]  # verify rows of each seq (0: samples nothing)
    host: HostCopy  # target_ids, accepted_rows, then the drafts each verify row checked, on their way to the host
    last_ids: torch.Tensor  # [S] per seq that samples, in order: the token it emits last (after its accepted drafts)
    # where accepted_rows and the checked drafts start in ``host`` (None: right after the R target ids, then B
    # rows later); a step graph's copy holds its padded rows too
    offsets: tuple[int, int] | None = None

    def read(self) -> tuple[list[list[int]], list[int]]:
        """(each seq's target argmax rows, each seq's accepted rows) on the host; waits for the copy only."""
        ids, rows, _ = self.read_all()
        return ids, rows

    def read_all(self) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """``read`` and each seq's drafts, as the device verified them (what the step's inputs held)."""
        flat = self.host.tolist()
        B = len(self.rows_per_seq)
        at_rows, at_checks = self.offsets or (sum(self.rows_per_seq), sum(self.rows_per_seq) + B)
        ids, drafts, off = [], [], 0
        for n in self.rows_per_seq:
            ids.append(flat[off:off + n])
            drafts.append(flat[at_checks + off:at_checks + off + n - 1] if n else [])
            off += n
        return ids, flat[at_rows:at_rows + B], drafts


def accept_on_device(seqs: Sequence, logits: torch.Tensor, inputs: torch.Tensor | None = None,
                     positions: torch.Tensor | None = None) -> DeviceVerdict:
    """Verification of every seq of a step at once, on the device, with no host read. ``logits`` [R, V]: the
    verify rows of the seqs that sample (``len(drafts) + 1`` each), seqs in order. ``inputs`` [N]: the step's
    input ids on the device; the drafts are read from them (each seq's last ``len(drafts)`` inputs), so drafts
    still on the device (``PENDING`` on the host, after an overlapped step) verify too. Without it, from
    ``seq.drafts``.

    Greedy seqs (``accept_greedy``): the accepted drafts are the index of the first verify row whose argmax
    differs from the draft that row checks; the last row checks none (-1 never matches), so the count stops at
    the number of drafts. Sampled seqs the same, against their keyed draws (``sampler.sample_rows``;
    ``positions`` [R]: the sequence position each row draws, on the device; needed when a seq samples); their
    ``target_ids`` rows hold the emitted tokens (the accepted drafts, then the draw after them)."""
    G = greedy_tokens(logits)
    checks, seq_of, local, counts, fixed, start = [], [], [], [], [], 0
    sampled, first_row = [], []  # the seqs that sample, and where their verify rows start
    drawn, params, keys = [], [], []  # the verify rows of the seqs that sample with a temperature
    for b, s in enumerate(seqs):
        d = len(s.drafts) if s.sample else 0
        n = d + 1 if s.sample else 0
        if n and not s.request.params.greedy:
            drawn += range(len(seq_of), len(seq_of) + n)
            params += [s.request.params] * n
            keys += [s.request.key] * n
        # the draft verify row j checks: a draft id, or (from ``inputs``) the step position holding it; -1: none
        checks += (list(s.drafts[:d]) if inputs is None else list(range(start + s.num_new - d, start + s.num_new)))
        checks += [-1] * (n - d)
        if n:
            sampled.append(b)
            first_row.append(len(seq_of))
        seq_of += [b] * n
        local += range(n)
        counts.append(n)
        fixed.append(s.num_new - d)  # rows kept whatever the verdict: the step's inputs before the drafts
        start += s.num_new
    R, B = len(checks), len(seqs)
    if R != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} verify rows of logits for seqs that verify {R}")
    S = len(sampled)
    t = to_device(checks + seq_of + local + fixed + sampled + first_row, logits.device)
    chk, seq, loc, kept = t[:R], t[R:2 * R], t[2 * R:3 * R], t[3 * R:3 * R + B]
    sampled_t, first_t = t[3 * R + B:3 * R + B + S], t[3 * R + B + S:]
    if inputs is not None:
        chk = torch.where(chk >= 0, inputs[chk.clamp(min=0)], -1)
    T = G
    if drawn:
        if positions is None:
            raise ValueError("accept_on_device: seqs that sample with a temperature need the rows' positions")
        at = to_device(drawn, logits.device)
        T = G.clone()
        T[at] = sample_rows(logits[at], params, keys, positions[at])
    first_miss = torch.where(draft_accepted(T, chk), R + 1, loc)
    a = torch.full((B,), R + 1, dtype=torch.long, device=logits.device)
    a = a.scatter_reduce(0, seq, first_miss, "amin")
    a = torch.where(a > R, 0, a)  # a seq without verify rows
    if drawn:  # a sampled seq emits its accepted drafts, then its draw (a greedy seq's accepted rows: the same)
        G = torch.where(loc < a[seq], chk, T)
    rows = kept + a
    return DeviceVerdict(G, a, rows, tuple(counts), HostCopy(torch.cat([G, rows, chk])), G[first_t + a[sampled_t]])


def accept_uniform(G: torch.Tensor, ids: torch.Tensor, batch: int, k: int) -> tuple[torch.Tensor, ...]:
    """``accept_on_device`` for greedy seqs on static shapes (a CUDA graph's): ``batch`` rows, each verifying k
    drafts in k+1 step rows laid out one after another (``G`` [>= batch*(k+1)] the target's argmax at every
    step row, ``ids`` the step's inputs: a row's token, then its k drafts). No host list, no host read.
    Returns (accepted drafts a [B], the token each row emits last [B] (its argmax at row a), checks [B, k+1]:
    the draft each verify row checked, -1 at the last). Padded batch rows get values that nothing reads."""
    k1 = k + 1
    g = G[:batch * k1].view(batch, k1)
    checks = torch.cat([ids[:batch * k1].view(batch, k1)[:, 1:], ids.new_full((batch, 1), -1)], 1)
    a = (g[:, :k] == checks[:, :k]).long().cumprod(1).sum(1)
    return a, g.gather(1, a[:, None])[:, 0], checks


def verdict_of_step_graph(out, num_seqs: int) -> DeviceVerdict:
    """The ``DeviceVerdict`` of a step that verified in one CUDA graph (``graphs.StepGraphOut``: its
    ``accept_uniform`` on the padded bucket), for its first ``num_seqs`` rows: every one samples greedily with
    the graph's k drafts. The graph packed the target ids, accepted rows and checked drafts in ``out.packed``;
    one copy to the host carries them (and the drafts, read by the proposer from the same copy)."""
    k1 = out.drafts.shape[1] + 1
    at_rows, at_checks, _ = out.offsets
    return DeviceVerdict(out.target_ids[:num_seqs * k1], out.accepted_drafts[:num_seqs],
                         out.accepted_rows[:num_seqs], (k1,) * num_seqs, out.host, out.last_ids[:num_seqs],
                         offsets=(at_rows, at_checks))


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
