"""Attention data parallelism on the driver: one scheduler and one cache bookkeeping per rank ("lane").

The engine talks to one scheduler and one cache; under attention DP these are compositions:

* ``DataParallelScheduler`` gives each new request to the lane with the fewest requests in flight (waiting
  + running; ties to the lowest rank) and concatenates the lanes' batches, lane 0 first. Each lane is a
  plain ``Scheduler`` over its rank's ``KVCacheManager``, with its own ``max_batch_size`` and
  ``max_num_tokens`` (they are per rank, as in TensorRT-LLM), preempting only within its lane.
* ``LaneCaches`` splits a step by lane and begins a step on every busy lane's manager, all padded to the
  same token count N and row count B (the largest lane's, at least 1), so every rank's MoE all-gather has
  the same shape. Lane 0's plan is built on the driver's device (the driver runs it); the other lanes'
  plans are built on the CPU for their bookkeeping and their build_plan arguments, which their ranks turn
  into the same plan on their own devices. An idle lane 0 gets an inert plan of padded rows only. A step
  whose drafting is paused passes its keep-up decision to every busy lane's plan (an idle lane's inert rows
  may keep up: they write the null row only).

Overlapped MTP steps: the lanes' batches are concatenated lane 0 first, so each lane's requests are one run
of the step's batch order. A request whose previous step is not read back has unsettled rows; the engine's
``shift`` (the device's accepted drafts, batch order) goes to lane 0's plan as its own slice; the other lanes'
CPU plans take zeros there (their tables are never read: each rank rebuilds its plan with the C column the
driver broadcasts, ``LanePlans.rows``). ``LanePlans`` answers what the engine asks of a step's plan for the
whole batch (``step_id``, ``num_computed``, ``unsettled``, and on the driver's device the C column ``rows``
and the logit rows' ``positions``), and commits and settles go to each lane's manager.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import torch

from ..cache.layout import CacheLayout
from ..cache.manager import KVCacheManager, SeqStep
from ..cache.plan import StepPlan
from ..engine.scheduler import Scheduler
from ..transfer import to_device
from .executor import idle_plan_args, make_plan


@dataclass(frozen=True, eq=False)
class LanePlans:
    """One step under attention DP: per lane its StepPlan (None = idle), lane 0's plan on the driver's
    device (an inert one when lane 0 is idle), and the step's request indices per lane (batch order: each
    lane's a run of consecutive indices, lane 0's first). ``shift``: the engine's device shift of the step
    (batch order), None when no request has unsettled rows."""

    plans: tuple
    local: StepPlan
    lane_indices: tuple[tuple[int, ...], ...]
    pad_tokens_to: int
    pad_batch_to: int
    step_id: int = 0  # the step's own id among LaneCaches' steps (each lane's manager numbers its own)
    shift: torch.Tensor | None = None

    def _joined(self, field: str) -> tuple:
        """A per-request tuple of the plans (``num_computed``, ...) for the whole batch: the busy lanes' in order."""
        return tuple(v for p in self.plans if p is not None for v in getattr(p, field))

    @property
    def num_computed(self) -> tuple:
        return self._joined("num_computed")

    @property
    def unsettled(self) -> tuple:
        return self._joined("unsettled")

    @property
    def num_new(self) -> tuple:
        return self._joined("num_new")

    @cached_property
    def rows(self) -> torch.Tensor:
        """Each request's C on the driver's device, batch order (the host's ``num_computed`` plus ``shift``): what
        a plan's C column is, for the whole batch."""
        C = to_device(list(self.num_computed), self.local.rows.device)
        return C if self.shift is None else C + self.shift.to(C.dtype)

    @cached_property
    def positions(self) -> torch.Tensor:
        """The sequence position of each of the step's (unpadded) rows, batch order, on the driver's device."""
        seq_of, offset = [], []
        for b, n in enumerate(self.num_new):
            seq_of += [b] * n
            offset += range(n)
        t = to_device(seq_of + offset, self.rows.device)
        return self.rows[t[:len(seq_of)]] + t[len(seq_of):]

    def lane_span(self, lane: int) -> tuple[int, int]:
        """(first batch index, count) of lane ``lane``'s requests."""
        idx = self.lane_indices[lane]
        return (idx[0] if idx else 0), len(idx)


class LaneCaches:
    def __init__(self, managers: Sequence[KVCacheManager], lane_of: dict, layout: CacheLayout, num_slots: int):
        self.managers, self.lane_of, self.layout, self.lane_num_slots = list(managers), lane_of, layout, num_slots
        self._steps = 0

    def begin_step(self, seqs: Sequence[SeqStep], *, pad_tokens_to: int | None = None,
                   pad_batch_to: int | None = None, max_entries: int | None = None, max_blocks: int | None = None,
                   device="cpu", shift=None, mtp_keep_up: bool = True,
                   mtp_keep_last: int | None = None) -> LanePlans:
        lanes: list[list[SeqStep]] = [[] for _ in self.managers]
        idx: list[list[int]] = [[] for _ in self.managers]
        for i, s in enumerate(seqs):
            lane = self.lane_of[s.req_id]
            lanes[lane].append(s)
            idx[lane].append(i)
        if [i for ix in idx for i in ix] != list(range(len(seqs))):
            raise ValueError("LaneCaches.begin_step: the batch must hold each lane's requests together, lane 0's"
                             " first (DataParallelScheduler.schedule's order)")
        N = max([pad_tokens_to or 0, 1] + [sum(s.num_new for s in ls) for ls in lanes])
        B = max([pad_batch_to or 0, 1] + [len(ls) for ls in lanes])
        plans = []
        try:
            for lane, (m, ls) in enumerate(zip(self.managers, lanes)):
                lane_shift = None
                if shift is not None and ls:  # lane 0: its slice on the device; others: their CPU plans' zeros
                    first = idx[lane][0]
                    lane_shift = (shift[first:first + len(ls)] if lane == 0
                                  else torch.zeros(len(ls), dtype=torch.long))
                plans.append(m.begin_step(ls, pad_tokens_to=N, pad_batch_to=B, max_entries=max_entries,
                                          max_blocks=max_blocks, device=device if lane == 0 else "cpu",
                                          shift=lane_shift, mtp_keep_up=mtp_keep_up, mtp_keep_last=mtp_keep_last)
                             if ls else None)
        except BaseException:
            for m, p in zip(self.managers, plans):
                if p is not None:
                    m.abort_step(p)
            raise
        local = plans[0] if plans[0] is not None else \
            make_plan(self.layout, self.lane_num_slots, idle_plan_args(
                self.managers[0].step_id, N, B, {k: v for k, v in (("max_entries", max_entries),
                                                                   ("max_blocks", max_blocks)) if v is not None}),
                device)
        self._steps += 1
        return LanePlans(tuple(plans), local, tuple(tuple(i) for i in idx), N, B, self._steps, shift)

    def mtp_current(self, req_ids) -> bool:
        return all(self.managers[self.lane_of[r]].mtp_current([r]) for r in req_ids)

    def commit_step(self, plan: LanePlans, num_accepted: Sequence[int], unsettled: Sequence[int] | None = None) -> None:
        for m, p, idx in zip(self.managers, plan.plans, plan.lane_indices):
            if p is not None:
                m.commit_step(p, [num_accepted[i] for i in idx],
                              None if unsettled is None else [unsettled[i] for i in idx])

    def settle(self, plan: LanePlans, extras: dict) -> None:
        """Each lane's manager settles its own requests' extras (a request of the step that is gone meanwhile
        is not in ``extras``)."""
        for m, p in zip(self.managers, plan.plans):
            if p is not None:
                m.settle(p, {rid: n for rid, n in extras.items() if rid in p.req_ids})

    def abort_step(self, plan: LanePlans) -> None:
        for m, p in zip(self.managers, plan.plans):
            if p is not None:
                m.abort_step(p)

    def check_integrity(self) -> None:
        for m in self.managers:
            m.check_integrity()

    @property
    def num_free_blocks(self) -> int:
        return sum(m.num_free_blocks for m in self.managers)

    @property
    def num_blocks(self) -> int:
        return sum(m.num_blocks for m in self.managers)

    @property
    def num_free_slots(self) -> int:
        return sum(m.num_free_slots for m in self.managers)

    @property
    def num_slots(self) -> int:
        return sum(m.num_slots for m in self.managers)


class DataParallelScheduler:
    def __init__(self, schedulers: Sequence[Scheduler], lane_of: dict):
        self.schedulers, self.lane_of = list(schedulers), lane_of

    def in_flight(self, lane: int) -> int:
        s = self.schedulers[lane]
        return len(s.waiting) + len(s.running)

    def add(self, req) -> int:
        lane = min(range(len(self.schedulers)), key=lambda i: (self.in_flight(i), i))
        self.lane_of[req.request_id] = lane
        self.schedulers[lane].add(req)
        return lane

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.schedulers)

    def schedule(self):
        out = []
        for s in self.schedulers:
            out.extend(s.schedule())
        return out

    def finish(self, req) -> None:
        lane = self.lane_of.pop(req.request_id, None)
        if lane is not None:
            self.schedulers[lane].finish(req)

    def forget(self, req) -> None:
        lane = self.lane_of.pop(req.request_id, None)
        if lane is not None:
            self.schedulers[lane].forget(req)

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.schedulers)

    def reset_stats(self) -> None:
        for s in self.schedulers:
            s.reset_stats()
