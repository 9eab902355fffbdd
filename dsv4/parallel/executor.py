"""The step protocol: the driver's runner broadcasts what every rank must compute; the ranks follow.

A step is a *target* forward, and with MTP a *propose* (catch-up pass, then draft passes 2..k). The
driver's scheduler and cache bookkeeping decide everything; the other ranks hold no bookkeeping of their
own. For each pass the driver sends one message on the control group, and every rank then runs the same
model code, whose collectives (data group) line up because every rank makes the same calls in the same
order with the same shapes:

    driver                                    every other rank
    ForwardMsg(step, lanes)          ---->    build its StepPlan from its lane's build_plan arguments
                                              (the same function the driver's cache used)
    [overlap: broadcast pending ids] ---->    the previous step's tokens, still on the device
                                              run the target
    [attention DP: gather logits]    <----    logits of its lane's sampled rows (data group all-gather)
    sample / verify (the driver only)
    ProposeMsg(step, lanes, k, any)  ---->    MTP catch-up pass (not after a whole step, see below)
    [acceptance on the device: broadcast the catch-up inputs]
    for j in 1..k:
      [attention DP: gather logits]  <----    MTP logits of its active rows
      choose drafts (the driver only)
      broadcast the draft tokens     ---->    (j < k) next draft pass with these tokens

Warmup also sends ``WarmRowsMsg(counts)``: every rank runs the MTP layer's kept-rows passes over inert rows at
those row counts (``ModelRunner.run_inert_mtp_rows``), as the driver does.

Lanes: without attention DP there is one lane, the whole batch, which every rank runs (same plan, same
tokens; each rank computes its share of heads / experts). With attention DP lane r is rank r's own
requests and cache; every lane is padded to the same token and row counts so that the MoE all-gathers line
up, and a rank without requests runs an inert plan of padded rows only (R3: they read nothing valid and
write only the null slot / block). Draft passes run on every rank if any lane drafts.

Whole steps (one lane, every request greedy, a bucket with the graph): the ForwardMsg says ``whole_step`` and
every rank replays its bucket's whole-step graph (target pass, verdict, MTP catch-up and draft passes). Each
rank computes the verdict and the drafts itself, from the same logits (the head is replicated and the streams
are all-reduced), so no ProposeMsg and no draft broadcast follow; the driver reads its own graph's outputs.

Drafting paused (the driver's ``DraftPause``): a paused step's plan arguments carry its keep-up decision
(``mtp_keep_up`` False: no pass writes the MTP layer's rings; ``mtp_keep_last``: each request's last rows
only), so every rank runs the same keep-up pass, or none (under attention DP each lane's plan says it for its
rank: the keep-up pass has no collective). With one lane, a step with no pass at all sends no ProposeMsg; the
ranks' held target output is simply replaced by the next ForwardMsg's.

CUDA graphs: every rank holds a GraphRunner with the same buckets (``RankSetup.graphs``), prepared at
start-up on every rank in the same order (largest bucket first; the all-reduce / all-gather / reduce-scatter
inside are captured: NCCL with static shapes). The driver alone decides per step whether it replays (every
lane's plan fits a bucket; under attention DP the bucket is the busiest lane's, every lane padded to it) and
sends that decision and the bucket's padding in the ForwardMsg; the ranks rebuild the plan with exactly that
padding and replay target, MTP catch-up and draft graphs for that step, never deciding on local state.

Overlap: the engine launches step n+1 before it reads step n's tokens back, so some of step n+1's inputs
exist only on the driver's device (PENDING in the host ids). The ForwardMsg names them per lane (step
positions, flat indices into the previous step's token tensor) and the driver broadcasts that tensor over the
data group right after the message (a device collective: on NCCL nobody waits for the host); every rank fills
its inputs from it as the single-process runner does (``ModelRunner._step_inputs``). After an overlapped MTP
step the requests' committed lengths are on the device too (``unsettled``): the driver broadcasts the C column
of every lane that has such requests first (one tensor, lanes in order; ``LanePlans.rows`` under attention DP)
and every rank builds its plan with its lane's. An MTP step's acceptance then stays on the driver's device
(under attention DP over every lane's gathered logits and the step's inputs, which the driver rebuilds for
every lane from the host ids and the broadcast pending ones), so the catch-up pass's inputs
(``device_draft_inputs``, for the whole batch, then each lane's run of it) are broadcast as well; draft tokens
always are (device tensors, never host ints).

Per-step state stays a value: each rank's plan is built from the message (R2); the only thing a rank keeps
between two messages of one step is that step's (plan, streams, graphed), checked against the step number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..cache.layout import CacheLayout
from ..cache.manager import StepOrderError
from ..cache.plan import StepPlan, build_plan
from ..engine.backend import CachedBackend
from ..engine.runner import (DraftInputs, DraftTokens, ModelRunner, TargetOutput, draft_inputs, draft_inputs_for,
                             pending_inputs, target_inputs)
from ..engine.spec import DeviceVerdict
from ..engine.scheduler import ScheduledSeq
from .comm import StopMsg


# ---- messages ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LaneWork:
    """One lane's part of a target forward."""

    plan: dict  # build_plan keyword arguments (host ints; an idle lane's have no requests, only padding)
    token_ids: tuple[int, ...]
    logit_rows: tuple[int, ...]  # step rows whose logits the driver needs (attention DP; else empty)
    # inputs still on the device (PENDING in token_ids): (step positions, flat indices into the broadcast ids)
    pending: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())


@dataclass(frozen=True)
class ForwardMsg:
    step: int
    lanes: tuple[LaneWork, ...]
    graphed: bool = False  # the driver's decision: every rank replays its bucket's graphs for this step
    pending_ids: int = 0  # overlap: the driver broadcasts this many int64 ids (its previous step's tokens) next
    # every rank replays its bucket's whole-step graph (one lane, greedy): no ProposeMsg follows
    whole_step: bool = False


def pending_of(work: LaneWork, values: torch.Tensor | None):
    """``run_target``'s ``pending`` for a lane: None when all its inputs are host ids."""
    dst, src = work.pending
    return (dst, src, values) if dst else None


@dataclass(frozen=True)
class WarmRowsMsg:
    """Warmup: every rank runs the MTP layer's kept-rows passes over inert rows at these row counts
    (``ModelRunner.run_inert_mtp_rows``; their collectives line up)."""
    counts: tuple[int, ...]


@dataclass(frozen=True)
class ProposeMsg:
    step: int
    lanes: tuple[DraftInputs, ...]  # host ints; with ``on_device`` only ``active`` (the rest is broadcast)
    draft_len: int
    any_active: bool  # draft passes 2..k run on every rank iff some lane drafts
    # the inputs came from acceptance on the driver's device: each lane's (next_ids [N], picks [B], new_lens [B])
    # follow, lanes in order, as one broadcast of int64 (each lane's (N, B) given here)
    on_device: tuple[tuple[int, int], ...] | None = None


# ---- plan arguments -----------------------------------------------------------------------------------------
def plan_args(plan: StepPlan, padding: dict | None = None) -> dict:
    """The build_plan arguments that rebuild ``plan`` on another rank (same tables). ``padding``: the
    begin_step padding the plan was built with (a graphed step's bucket padding: pad_batch_to, pad_tokens_to,
    max_entries, max_blocks), so the rank's tables have exactly the bucket's static shapes."""
    B, N = plan.num_seqs, plan.num_tokens
    Np, Bp = plan.shape.tokens, plan.shape.batch
    args = dict(step_id=plan.step_id, req_ids=plan.req_ids, num_computed=plan.num_computed,
                num_new=plan.num_new, draft_lens=plan.draft_lens, slots=plan.slot_ids,
                block_tables=[tuple(b) for b in plan.block_ids],
                pad_tokens_to=Np if Np > N else None, pad_batch_to=Bp if Bp > B else None)
    if any(plan.unsettled):  # C known on the device only: the driver broadcasts its C column (``make_plan``)
        args["unsettled"] = tuple(plan.unsettled)
    if not plan.mtp_keep_up:  # drafting paused far from a probe: no rank writes the MTP layer's rows
        args["mtp_keep_up"] = False
    elif plan.mtp_keep_last is not None:  # paused near a probe: each request's last rows only
        args["mtp_keep_last"] = plan.mtp_keep_last
    args.update(padding or {})
    return args


def idle_plan_args(step_id: int, num_tokens: int, num_rows: int, padding: dict | None = None) -> dict:
    """An idle lane's plan: ``num_tokens`` padded tokens in ``num_rows`` padded rows, all on the null slot
    (``padding``: as in ``plan_args``; its token and row counts are the same)."""
    args = dict(step_id=step_id, req_ids=(), num_computed=(), num_new=(), draft_lens=(), slots=(),
                block_tables=[], pad_tokens_to=num_tokens, pad_batch_to=num_rows)
    args.update(padding or {})
    return args


def make_plan(layout: CacheLayout, num_slots: int, args: dict, device,
              c_column: torch.Tensor | None = None) -> StepPlan:
    """A rank's plan from the driver's arguments; ``c_column``: the driver's C of each request (on the device)
    when some are unsettled (an overlapped MTP step's accepted drafts), applied as the driver's shift."""
    shift = None
    if c_column is not None:
        shift = c_column - torch.tensor(args["num_computed"], dtype=torch.long).to(c_column.device)
    return build_plan(layout, num_slots=num_slots, owner=0, device=device, shift=shift, **args)


def lane_part(flat: torch.Tensor, sizes: Sequence[int], lane: int) -> torch.Tensor:
    """Lane ``lane``'s part of a broadcast that holds every lane's, lanes in order (``sizes[l]`` values each)."""
    start = sum(sizes[:lane])
    return flat[start:start + sizes[lane]]


def unsettled_count(work: "LaneWork") -> int:
    """How many C values the driver broadcasts for this lane's plan (0: all settled)."""
    return len(work.plan["req_ids"]) if any(work.plan.get("unsettled", ())) else 0


# ---- attention DP: logits to the driver ------------------------------------------------------------------------
def gather_lanes(comm, logits, counts: list[int], vocab: int, device) -> list:
    """Every rank's lane logits ([counts[r], V], None or empty where a lane has none) to every rank, as
    fp32 rows over the data group (NCCL on GPUs: one all-gather of padded device tensors, no pickling
    through the control group). ``counts`` is known to every rank from the driver's message."""
    R = max(counts)
    if R == 0:
        return [None] * len(counts)
    buf = torch.zeros(R, vocab, dtype=torch.float32, device=device)
    if logits is not None and logits.shape[0]:
        buf[:logits.shape[0]] = logits
    every = comm.all_gather(buf)
    return [every[r * R:r * R + c] if c else None for r, c in enumerate(counts)]


# ---- one rank's passes ----------------------------------------------------------------------------------------
class LaneRunner(ModelRunner):
    """The model runner's passes on plain inputs (what a rank receives: ``run_target`` / ``run_drafts``) for
    one lane; an idle lane's inert plan runs the plain path unless the step replays a graph bucket."""

    def lane_settings(self, attention_dp: bool) -> None:
        """What the driver and every rank set alike from the mapping, before their graphs are built. With one
        plan for every rank, as on one device: the MTP pass over each request's kept rows and the whole-step
        graphs (every rank computes the same greedy verdict and drafts from the same logits). Under attention DP
        neither: the lanes' MoE gathers equal shares of rows, and acceptance runs on the driver over every lane's
        gathered logits (no rank holds what a whole step's verdict needs)."""
        self.mtp_tail_rows = self.whole_step_graphs = not attention_dp

    def _backend(self, plan):
        if plan.num_seqs == 0:  # an idle lane's inert plan: the plain path, whatever the device
            return CachedBackend.for_step(plan, self.storage)
        return super()._backend(plan)

    def _draft_backend(self, plan, tables):
        if plan.num_seqs == 0:
            return CachedBackend.for_draft(tables, self.storage)
        return super()._draft_backend(plan, tables)


# ---- the driver ---------------------------------------------------------------------------------------------------
class DistributedRunner(LaneRunner):
    """The engine's runner on rank 0: same ``forward`` / ``propose`` as ModelRunner, and every pass is
    announced to the other ranks first. Any failure stops every rank (``RankGroup.fail``). Steps overlap, MTP
    steps too: what only the driver's device knows is broadcast (see the module doc)."""

    supports_overlap = True

    def __init__(self, model, storage, device, attention_backend, group, mapping, batch_invariant: bool = False):
        super().__init__(model, storage, device, attention_backend, batch_invariant)
        self.group, self.mapping = group, mapping
        self.dp = mapping.attention_dp
        self.lane_settings(self.dp)
        self.lane_of: dict = {}  # attention DP: request id -> lane (the engine's scheduler fills it)
        self._step = 0
        self._graphed_step = False  # the last ForwardMsg's graph decision (its propose follows it)

    def padding_for(self, seqs: list[ScheduledSeq]) -> dict:
        """Attention DP: every lane is padded to the same shape, so the bucket is the one of the busiest lane
        (its requests per lane, not the whole batch's)."""
        if self.graphs is None or not self.dp:
            return super().padding_for(seqs)
        per_lane = [0] * self.mapping.dp_size
        for s in seqs:
            per_lane[self.lane_of[s.request.request_id]] += 1
        return self._bucket_padding(max(per_lane), [s.num_new for s in seqs])

    def _step_graphed(self, plans, local):
        """One decision for every rank: the graph runner whose bucket every lane's plan fits (an idle lane's has
        the same padded shape as lane 0's local one: the verify buckets, or the keep-up runner's of one row a
        request for a paused step), None to run eagerly. Sent in the ForwardMsg; the ranks never decide alone
        (each finds the same runner from the plan it rebuilds with the bucket's padding)."""
        g = self._graphs_of(local)
        return g if g is not None and all(g.matches(p) for p in plans if p is not None) else None

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
            err = self.group.fail(e)  # the other ranks may be mid-step: every rank is stopped
            if isinstance(e, KeyboardInterrupt):  # Ctrl-C stays Ctrl-C for the caller (a partial report)
                raise
            raise err from e

    def forward(self, seqs: list[ScheduledSeq], plan, prev=None, whole_step: bool = False) -> TargetOutput:
        if whole_step and self.dp:
            raise RuntimeError("attention-DP lanes have no whole-step graphs (a rank holds only its lane's logits;"
                               " acceptance runs on the driver)")
        return self._guard(self._forward, seqs, plan, prev, whole_step)

    def propose(self, seqs, plan, target, num_accepted, drafting, draft_len, choose) -> DraftTokens:
        return self._guard(self._propose, seqs, plan, target, num_accepted, drafting, draft_len, choose)

    def run_inert_mtp_rows(self, counts) -> None:
        """Announced to the other ranks first (their passes' collectives line up with the driver's)."""
        if counts:
            self._guard(self._inert_rows, tuple(counts))

    def _inert_rows(self, counts: tuple[int, ...]) -> None:
        self.group.send(WarmRowsMsg(counts))
        super().run_inert_mtp_rows(counts)

    def _forward(self, seqs, plan, prev, whole_step: bool = False) -> TargetOutput:
        plans, local, lane_idx = self._lanes(seqs, plan)
        self._step += 1
        g = self._step_graphed(plans, local)
        graphed = self._graphed_step = g is not None
        padding = g.padding(local.shape.batch) if graphed else None  # the bucket's static shapes
        works, counts = [], []
        for lane, idx in enumerate(lane_idx):
            lane_seqs = [seqs[i] for i in idx]
            ids, rows, cnt = target_inputs(lane_seqs)
            dst, src = pending_inputs(lane_seqs, prev)
            p = plans[lane]
            args = plan_args(p, padding) if p is not None else idle_plan_args(local.step_id, plan.pad_tokens_to,
                                                                               plan.pad_batch_to, padding)
            works.append(LaneWork(args, tuple(ids), tuple(rows) if self.dp else (), (tuple(dst), tuple(src))))
            counts.append((cnt, rows))
        values = None
        if any(w.pending[0] for w in works):  # the previous step's tokens, from the device to every rank
            values = prev.inputs.reshape(-1).to(torch.long).contiguous()
        self.group.send(ForwardMsg(self._step, tuple(works), graphed, 0 if values is None else values.numel(),
                                   whole_step))
        # C of each request of the lanes where some are known on the device only (an overlapped MTP step)
        c_columns = [self._c_column(plan, lane) for lane, w in enumerate(works) if unsettled_count(w)]
        if c_columns:
            self.group.collectives.broadcast(torch.cat(c_columns).to(torch.long).contiguous())
        if values is not None:
            self.group.collectives.broadcast(values)
        X, logits0, inputs, step = self.run_target(local, works[0].token_ids, counts[0][1], graphed,
                                                   pending_of(works[0], values), whole_step)
        lane_logits = [logits0]
        if self.dp:
            got = gather_lanes(self.group.collectives, logits0, [len(w.logit_rows) for w in works],
                               self.model.cfg.vocab_size, self.device)
            lane_logits += got[1:]
        per_seq: list = [None] * len(seqs)
        for lane, idx in enumerate(lane_idx):
            off = 0
            for i, c in zip(idx, counts[lane][0]):
                if c:
                    per_seq[i] = lane_logits[lane][off:off + c]
                    off += c
        if self.dp:
            # acceptance on the device reads a step's drafts from its inputs: every lane's, rebuilt here
            all_inputs = (self._lane_inputs(works, plans, inputs, values) if any(len(s.drafts) for s in seqs)
                          else None)
            return TargetOutput(X, per_seq, None, all_inputs)
        return TargetOutput(X, per_seq, logits0, inputs, step)

    @staticmethod
    def _c_column(plan, lane: int) -> torch.Tensor:
        """Lane ``lane``'s requests' C on the driver's device (one lane: its plan's C column)."""
        if isinstance(plan, StepPlan):
            return plan.rows[:plan.num_seqs]
        first, count = plan.lane_span(lane)
        return plan.rows[first:first + count]

    def _lane_inputs(self, works, plans, local_inputs, values) -> torch.Tensor:
        """The step's input ids of every lane's requests, batch order, on the driver's device: lane 0's from its
        own pass, the others' from their host ids and the pending ones (``values``)."""
        parts = []
        for lane, (w, p) in enumerate(zip(works, plans)):
            if p is None:
                continue
            if lane == 0:
                parts.append(local_inputs[:p.num_tokens])
                continue
            dst, src = w.pending
            ids, _ = self._step_inputs(p, w.token_ids, (), (dst, src, values) if dst else None)
            parts.append(ids[:p.num_tokens])
        return torch.cat(parts)

    @staticmethod
    def _lane_draft_inputs(full: DraftInputs, plan, lane: int) -> DraftInputs:
        """Lane ``lane``'s run of the batch's MTP inputs on the device (its rows and tokens renumbered from 0)."""
        first, count = plan.lane_span(lane)
        start = sum(plan.num_new[:first])
        n = sum(plan.num_new[first:first + count])
        return DraftInputs(full.next_ids[start:start + n], full.picks[first:first + count] - start,
                           full.new_lens[first:first + count],
                           tuple(b - first for b in full.active if first <= b < first + count))

    def _propose(self, seqs, plan, target, num_accepted, drafting, draft_len, choose) -> DraftTokens:
        plans, local, lane_idx = self._lanes(seqs, plan)
        coll = self.group.collectives
        on_device = isinstance(num_accepted, DeviceVerdict)  # inputs from acceptance on the device
        if on_device:
            full = draft_inputs_for(seqs, plan, num_accepted, drafting)
            inps = ([self._lane_draft_inputs(full, plan, lane) for lane in range(len(lane_idx))] if self.dp
                    else [full])
        else:
            inps = [draft_inputs([seqs[i] for i in idx], plans[lane].num_computed if plans[lane] is not None else (),
                                 [num_accepted[i] for i in idx], [drafting[i] for i in idx])
                    for lane, idx in enumerate(lane_idx)]
        if len(inps) == 1 and not inps[0].active and not local.mtp_keep_up:  # paused far from a probe: no pass
            return DraftTokens(len(seqs), (), None, inps[0].new_lens)
        if on_device:
            self.group.send(ProposeMsg(self._step, tuple(DraftInputs((), (), (), i.active) for i in inps), draft_len,
                                       any(i.active for i in inps),
                                       tuple((i.next_ids.numel(), i.picks.numel()) for i in inps)))
            coll.broadcast(torch.cat([t for i in inps for t in (i.next_ids, i.picks, i.new_lens)])
                           .to(torch.long).contiguous())
        else:
            self.group.send(ProposeMsg(self._step, tuple(inps), draft_len, any(i.active for i in inps)))
        any_active = any(i.active for i in inps)
        order = [lane_idx[lane][b] for lane, inp in enumerate(inps) for b in inp.active]  # seq of each drafted row
        total = len(order)
        passes: list[torch.Tensor] = []

        def pick(j, logits_fn):
            lane_logits = [logits_fn()]
            if self.dp:
                got = gather_lanes(coll, lane_logits[0], [len(i.active) for i in inps], self.model.cfg.vocab_size,
                                   self.device)
                lane_logits += got[1:]
            chosen = [choose([lane_idx[lane][b] for b in inp.active], lane_logits[lane],
                             lambda inp=inp: inp.positions(j, self.device)).to(torch.long)
                      if inp.active else torch.zeros(0, dtype=torch.long, device=self.device)
                      for lane, inp in enumerate(inps)]
            flat = torch.cat(chosen)
            passes.append(flat)
            if j < draft_len and total:  # the next pass's inputs on every rank, from the device
                coll.broadcast(flat.contiguous())
            return chosen[0]

        self.run_drafts(local, target.streams, inps[0], draft_len, any_active, pick, self._graphed_step)
        if on_device:
            new_lens = full.new_lens
        else:
            lens = [0] * len(seqs)
            for idx, inp in zip(lane_idx, inps):
                for b, n in zip(range(len(idx)), inp.new_lens):
                    lens[idx[b]] = n
            new_lens = tuple(lens)
        active = tuple(sorted(order))
        tokens = None
        if total:
            tokens = torch.stack(passes, 1)  # [drafted rows, k] in lane order
            if tuple(order) != active:  # attention DP: the lanes' rows in seq order
                perm = sorted(range(total), key=order.__getitem__)
                tokens = tokens[torch.tensor(perm, device=tokens.device)]
        return DraftTokens(len(seqs), active, tokens, new_lens)


# ---- the other ranks --------------------------------------------------------------------------------------------------
def follow(group, runner: LaneRunner, layout: CacheLayout, num_slots: int, dp: bool,
           on_message: Callable[[object], None] | None = None) -> None:
    """A worker's loop: run what the driver announces until it says stop."""
    lane = group.rank if dp else 0
    held = None  # (step, plan, streams, graphed) of the last target forward, for its propose
    while True:
        msg = group.recv()
        if on_message is not None:
            on_message(msg)
        if isinstance(msg, StopMsg):
            return
        if isinstance(msg, ForwardMsg):
            work = msg.lanes[lane]
            c_column = None
            counts = [unsettled_count(w) for w in msg.lanes]
            if sum(counts):  # the driver's C columns (its requests' accepted drafts are on the device), lanes in order
                every = group.collectives.broadcast(torch.empty(sum(counts), dtype=torch.long, device=runner.device))
                if counts[lane]:
                    c_column = lane_part(every, counts, lane)
            plan = make_plan(layout, num_slots, work.plan, runner.device, c_column)
            values = None
            if msg.pending_ids:  # the driver's previous tokens (its broadcast follows the message)
                values = group.collectives.broadcast(torch.empty(msg.pending_ids, dtype=torch.long,
                                                                 device=runner.device))
            rows = range(plan.num_tokens) if msg.whole_step else work.logit_rows  # (a whole step's: every row)
            X, logits, _, _ = runner.run_target(plan, work.token_ids, rows, msg.graphed, pending_of(work, values),
                                                msg.whole_step)
            if dp:
                gather_lanes(group.collectives, logits, [len(w.logit_rows) for w in msg.lanes],
                             runner.model.cfg.vocab_size, runner.device)
            held = (msg.step, plan, X, msg.graphed)
        elif isinstance(msg, ProposeMsg):
            if held is None or held[0] != msg.step:
                raise StepOrderError(f"rank {group.rank}: propose for step {msg.step} but the last target forward"
                                     f" was step {held[0] if held else None}; the driver must send ForwardMsg first")
            _, plan, X, graphed = held
            held = None
            inp = msg.lanes[lane]
            if msg.on_device:  # the driver's inputs from acceptance on its device, every lane's run in order
                sizes = [N + 2 * B for N, B in msg.on_device]
                buf = group.collectives.broadcast(torch.empty(sum(sizes), dtype=torch.long, device=runner.device))
                N, B = msg.on_device[lane]
                buf = lane_part(buf, sizes, lane)
                inp = DraftInputs(buf[:N], buf[N:N + B], buf[N + B:], inp.active)
            sizes = [len(i.active) for i in msg.lanes]
            first = sum(sizes[:lane])

            def pick(j, logits_fn, msg=msg, sizes=sizes, first=first):
                if dp:
                    gather_lanes(group.collectives, logits_fn(), sizes, runner.model.cfg.vocab_size, runner.device)
                if j >= msg.draft_len or not sum(sizes):
                    return ()
                flat = group.collectives.broadcast(torch.empty(sum(sizes), dtype=torch.long, device=runner.device))
                return flat[first:first + sizes[lane]]

            runner.run_drafts(plan, X, inp, msg.draft_len, msg.any_active, pick, graphed)
        elif isinstance(msg, WarmRowsMsg):
            runner.run_inert_mtp_rows(msg.counts)
        else:
            raise TypeError(f"rank {group.rank}: unknown message {type(msg).__name__}")
