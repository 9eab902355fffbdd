"""The step protocol: the driver's runner broadcasts what every rank must compute; the ranks follow.

A step is a *target* forward, and with MTP a *propose* (catch-up pass, then draft passes 2..k). The
driver's scheduler and cache bookkeeping decide everything; the other ranks hold no bookkeeping of their
own. For each pass the driver sends one message on the control group, and every rank then runs the same
model code, whose collectives (data group) line up because every rank makes the same calls in the same
order with the same shapes:

    driver                                    every other rank
    ForwardMsg(step, lanes)          ---->    build its StepPlan from its lane's build_plan arguments
                                              (the same function the driver's cache used), run the target
    [attention DP: gather logits]    <----    logits of its lane's sampled rows
    sample / verify (the driver only)
    ProposeMsg(step, lanes, k, any)  ---->    MTP catch-up pass
    for j in 1..k:
      [attention DP: gather logits]  <----    MTP logits of its active rows
      choose drafts (the driver only)
      DraftTokensMsg(step, j, toks)  ---->    (j < k) next draft pass with these tokens

Lanes: without attention DP there is one lane, the whole batch, which every rank runs (same plan, same
tokens; each rank computes its share of heads / experts). With attention DP lane r is rank r's own
requests and cache; every lane is padded to the same token and row counts so that the MoE all-gathers line
up, and a rank without requests runs an inert plan of padded rows only (R3: they read nothing valid and
write only the null slot / block). Draft passes run on every rank if any lane drafts.

Per-step state stays a value: each rank's plan is built from the message (R2); the only thing a rank keeps
between two messages of one step is that step's (plan, streams), checked against the step number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..cache.layout import CacheLayout
from ..cache.manager import StepOrderError
from ..cache.plan import StepPlan, build_plan
from ..engine.backend import CachedBackend
from ..engine.runner import ModelRunner, TargetOutput
from ..engine.scheduler import ScheduledSeq
from .comm import StopMsg


# ---- messages ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaneWork:
    """One lane's part of a target forward."""

    plan: dict  # build_plan keyword arguments (host ints; an idle lane's have no requests, only padding)
    token_ids: tuple[int, ...]
    logit_rows: tuple[int, ...]  # step rows whose logits the driver needs (attention DP; else empty)


@dataclass(frozen=True)
class DraftInputs:
    """One lane's MTP inputs, from the driver's verify results."""

    next_ids: tuple[int, ...]  # per step token at position p: token p+1 after this step's emission (0 past it)
    picks: tuple[int, ...]  # per request: the step row of its newest committed position
    new_lens: tuple[int, ...]  # per request: committed length after acceptance
    active: tuple[int, ...]  # batch rows that draft


@dataclass(frozen=True)
class ForwardMsg:
    step: int
    lanes: tuple[LaneWork, ...]


@dataclass(frozen=True)
class ProposeMsg:
    step: int
    lanes: tuple[DraftInputs, ...]
    draft_len: int
    any_active: bool  # draft passes 2..k run on every rank iff some lane drafts


@dataclass(frozen=True)
class DraftTokensMsg:
    step: int
    j: int
    tokens: tuple[tuple[int, ...], ...]  # per lane: the draft tokens of its active rows


# ---- plan arguments -----------------------------------------------------------------------------------------
def plan_args(plan: StepPlan) -> dict:
    """The build_plan arguments that rebuild ``plan`` on another rank (same tables; padding included)."""
    B, N = plan.num_seqs, plan.num_tokens
    Np, Bp = plan.positions.shape[0], plan.slots.shape[0]
    return dict(step_id=plan.step_id, req_ids=plan.req_ids, num_computed=plan.num_computed,
                num_new=plan.num_new, draft_lens=plan.draft_lens, slots=tuple(plan.slots[:B].tolist()),
                block_tables=[tuple(r) for r in plan.block_table[:B].tolist()],
                pad_tokens_to=Np if Np > N else None, pad_batch_to=Bp if Bp > B else None)


def idle_plan_args(step_id: int, num_tokens: int, num_rows: int) -> dict:
    """An idle lane's plan: ``num_tokens`` padded tokens in ``num_rows`` padded rows, all on the null slot."""
    return dict(step_id=step_id, req_ids=(), num_computed=(), num_new=(), draft_lens=(), slots=(),
                block_tables=[], pad_tokens_to=num_tokens, pad_batch_to=num_rows)


def make_plan(layout: CacheLayout, num_slots: int, args: dict, device) -> StepPlan:
    return build_plan(layout, num_slots=num_slots, owner=0, device=device, **args)


# ---- inputs from the scheduled batch -------------------------------------------------------------------------
def target_inputs(seqs: Sequence[ScheduledSeq]) -> tuple[list[int], list[int], list[int]]:
    """(token ids, logit rows, logit rows per seq): every sampled seq's verify rows (its last row when it
    has no drafts)."""
    ids = [t for s in seqs for t in s.token_ids]
    rows, counts, start = [], [], 0
    for s in seqs:
        if s.sample:
            k1 = len(s.drafts) + 1
            rows.extend(range(start + s.num_new - k1, start + s.num_new))
            counts.append(k1)
        else:
            counts.append(0)
        start += s.num_new
    return ids, rows, counts


def draft_inputs(seqs: Sequence[ScheduledSeq], num_computed: Sequence[int], num_accepted: Sequence[int],
                 drafting: Sequence[bool]) -> DraftInputs:
    next_ids, picks, start = [], [], 0
    for b, s in enumerate(seqs):
        toks, C = s.request.tokens, num_computed[b]
        for i in range(s.num_new):
            p = C + i
            next_ids.append(toks[p + 1] if p + 1 < len(toks) else 0)
        picks.append(start + num_accepted[b] - 1)
        start += s.num_new
    return DraftInputs(tuple(next_ids), tuple(picks), tuple(C + a for C, a in zip(num_computed, num_accepted)),
                       tuple(b for b in range(len(seqs)) if drafting[b]))


# ---- one rank's passes ----------------------------------------------------------------------------------------
class LaneRunner(ModelRunner):
    """The model runner's passes on plain inputs (what a rank receives) for one lane."""

    def _backend(self, plan):
        if plan.num_seqs == 0:  # an idle lane's inert plan: the plain path, whatever the device
            return CachedBackend.for_step(plan, self.storage)
        return super()._backend(plan)

    def _draft_backend(self, plan, tables):
        if plan.num_seqs == 0:
            return CachedBackend.for_draft(tables, self.storage)
        return super()._draft_backend(plan, tables)

    @torch.no_grad()
    def run_target(self, plan: StepPlan, token_ids: Sequence[int], logit_rows: Sequence[int]):
        """-> (last-layer streams [N_pad, n, d], logits [len(logit_rows), V] or None)."""
        X = self.model.streams(self._ids(list(token_ids), plan.positions.shape[0]), self._backend(plan))
        logits = None
        if logit_rows:
            logits = self.model.logits_from_streams(X[torch.tensor(list(logit_rows), device=self.device)])
        return X, logits

    @torch.no_grad()
    def run_drafts(self, plan: StepPlan, X: torch.Tensor, inp: DraftInputs, draft_len: int, any_active: bool,
                   pick: Callable[[int, Callable[[], torch.Tensor]], Sequence[int]]) -> None:
        """MTP catch-up pass, then (if any lane drafts) draft passes 2..draft_len. After pass j,
        ``pick(j, logits_fn)`` returns the draft tokens of this lane's active rows (``logits_fn()`` gives their
        MTP logits [A, V]); they are the inputs of pass j+1."""
        model = self.model
        X_mtp = model.mtp_streams(X, self._ids(list(inp.next_ids), plan.positions.shape[0]), self._backend(plan))
        if not any_active:
            return
        active = list(inp.active)
        active_t = torch.tensor(active, dtype=torch.long, device=self.device)
        rows = torch.tensor([inp.picks[b] for b in active], dtype=torch.long, device=self.device)
        V = model.cfg.vocab_size

        def logits_of(Xs):
            return (lambda: model.mtp_logits_from_streams(Xs)) if active else \
                (lambda: torch.zeros(0, V, device=self.device))

        toks = pick(1, logits_of(X_mtp[rows]))
        b_pad = plan.slots.shape[0]
        new_lens = torch.zeros(b_pad, dtype=torch.long)
        new_lens[:len(inp.new_lens)] = torch.tensor(inp.new_lens, dtype=torch.long)
        new_lens = new_lens.to(self.device)
        X_prev = torch.zeros(b_pad, *X_mtp.shape[1:], dtype=X_mtp.dtype, device=self.device)
        X_prev[active_t] = X_mtp[rows]
        for j in range(2, draft_len + 1):
            tables = plan.draft.step_tables(j, new_lens)
            row_toks = [0] * b_pad
            for b, t in zip(active, toks):
                row_toks[b] = t
            X_prev = model.mtp_streams(X_prev, self._ids(row_toks, b_pad), self._draft_backend(plan, tables))
            toks = pick(j, logits_of(X_prev[active_t]))


# ---- the driver ---------------------------------------------------------------------------------------------------
class DistributedRunner(LaneRunner):
    """The engine's runner on rank 0: same ``forward`` / ``propose`` as ModelRunner, and every pass is
    announced to the other ranks first. Any failure stops every rank (``RankGroup.fail``)."""

    def __init__(self, model, storage, device, attention_backend, group, mapping):
        super().__init__(model, storage, device, attention_backend)
        self.group, self.mapping = group, mapping
        self.dp = mapping.attention_dp
        self._step = 0

    def _lanes(self, seqs, plan):
        """(lane plans, lane 0's local plan, seq indices per lane) for a StepPlan or LanePlans."""
        if isinstance(plan, StepPlan):
            return (plan,), plan, (tuple(range(len(seqs))),)
        return plan.plans, plan.local, plan.lane_indices

    def _guard(self, fn, *args):
        self.group.check_alive()
        try:
            return fn(*args)
        except BaseException as e:
            raise self.group.fail(e) from e

    def forward(self, seqs: list[ScheduledSeq], plan) -> TargetOutput:
        return self._guard(self._forward, seqs, plan)

    def propose(self, seqs, plan, target, num_accepted, drafting, draft_len, choose) -> list[list[int]]:
        return self._guard(self._propose, seqs, plan, target, num_accepted, drafting, draft_len, choose)

    def _forward(self, seqs, plan) -> TargetOutput:
        plans, local, lane_idx = self._lanes(seqs, plan)
        self._step += 1
        works, counts = [], []
        for lane, idx in enumerate(lane_idx):
            ids, rows, cnt = target_inputs([seqs[i] for i in idx])
            p = plans[lane]
            args = plan_args(p) if p is not None else idle_plan_args(local.step_id, plan.pad_tokens_to,
                                                                      plan.pad_batch_to)
            works.append(LaneWork(args, tuple(ids), tuple(rows) if self.dp else ()))
            counts.append((cnt, rows))
        self.group.send(ForwardMsg(self._step, tuple(works)))
        X, logits0 = self.run_target(local, works[0].token_ids, counts[0][1])
        lane_logits = [logits0]
        if self.dp:
            got = self.group.gather(None)
            lane_logits += [None if t is None else t.to(self.device) for t in got[1:]]
        per_seq: list = [None] * len(seqs)
        for lane, idx in enumerate(lane_idx):
            off = 0
            for i, c in zip(idx, counts[lane][0]):
                if c:
                    per_seq[i] = lane_logits[lane][off:off + c]
                    off += c
        return TargetOutput(X, per_seq)

    def _propose(self, seqs, plan, target, num_accepted, drafting, draft_len, choose) -> list[list[int]]:
        plans, local, lane_idx = self._lanes(seqs, plan)
        inps = []
        for lane, idx in enumerate(lane_idx):
            p = plans[lane]
            inps.append(draft_inputs([seqs[i] for i in idx], p.num_computed if p is not None else (),
                                     [num_accepted[i] for i in idx], [drafting[i] for i in idx]))
        any_active = any(i.active for i in inps)
        self.group.send(ProposeMsg(self._step, tuple(inps), draft_len, any_active))
        drafts: list[list[int]] = [[] for _ in seqs]

        def pick(j, logits_fn):
            lane_logits = [logits_fn()]
            if self.dp:
                lane_logits += [t.to(self.device) for t in self.group.gather(None)[1:]]
            chosen = []
            for lane, inp in enumerate(inps):
                idx = lane_idx[lane]
                toks = tuple(choose(idx[b], j, lane_logits[lane][i]) for i, b in enumerate(inp.active))
                for b, t in zip(inp.active, toks):
                    drafts[idx[b]].append(t)
                chosen.append(toks)
            if j < draft_len:
                self.group.send(DraftTokensMsg(self._step, j, tuple(chosen)))
            return chosen[0]

        self.run_drafts(local, target.streams, inps[0], draft_len, any_active, pick)
        return drafts


# ---- the other ranks --------------------------------------------------------------------------------------------------
def follow(group, runner: LaneRunner, layout: CacheLayout, num_slots: int, dp: bool,
           on_message: Callable[[object], None] | None = None) -> None:
    """A worker's loop: run what the driver announces until it says stop."""
    lane = group.rank if dp else 0
    held = None  # (step, plan, streams) of the last target forward, for its propose
    while True:
        msg = group.recv()
        if on_message is not None:
            on_message(msg)
        if isinstance(msg, StopMsg):
            return
        if isinstance(msg, ForwardMsg):
            work = msg.lanes[lane]
            plan = make_plan(layout, num_slots, work.plan, runner.device)
            X, logits = runner.run_target(plan, work.token_ids, work.logit_rows)
            if dp:
                group.gather(None if logits is None else logits.cpu())
            held = (msg.step, plan, X)
        elif isinstance(msg, ProposeMsg):
            if held is None or held[0] != msg.step:
                raise StepOrderError(f"rank {group.rank}: propose for step {msg.step} but the last target forward"
                                     f" was step {held[0] if held else None}; the driver must send ForwardMsg first")
            _, plan, X = held
            held = None

            def pick(j, logits_fn, msg=msg):
                if dp:
                    group.gather(logits_fn().cpu())
                if j >= msg.draft_len:
                    return ()
                toks = group.recv()
                if not (isinstance(toks, DraftTokensMsg) and toks.step == msg.step and toks.j == j):
                    raise StepOrderError(f"rank {group.rank}: expected the draft tokens of step {msg.step} pass {j},"
                                         f" got {type(toks).__name__}")
                return toks.tokens[lane]

            runner.run_drafts(plan, X, msg.lanes[lane], msg.draft_len, msg.any_active, pick)
        else:
            raise TypeError(f"rank {group.rank}: unknown message {type(msg).__name__}")
