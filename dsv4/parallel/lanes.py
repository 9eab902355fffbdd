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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..cache.layout import CacheLayout
from ..cache.manager import KVCacheManager, SeqStep
from ..cache.plan import StepPlan
from ..engine.scheduler import Scheduler
from .executor import idle_plan_args, make_plan


@dataclass(frozen=True, eq=False)
class LanePlans:
    """One step under attention DP: per lane its StepPlan (None = idle), lane 0's plan on the driver's
    device (an inert one when lane 0 is idle), and the step's request indices per lane (batch order)."""

    plans: tuple
    local: StepPlan
    lane_indices: tuple[tuple[int, ...], ...]
    pad_tokens_to: int
    pad_batch_to: int


class LaneCaches:
    def __init__(self, managers: Sequence[KVCacheManager], lane_of: dict, layout: CacheLayout, num_slots: int):
        self.managers, self.lane_of, self.layout, self.lane_num_slots = list(managers), lane_of, layout, num_slots

    def begin_step(self, seqs: Sequence[SeqStep], *, pad_tokens_to: int | None = None,
                   pad_batch_to: int | None = None, max_entries: int | None = None, max_blocks: int | None = None,
                   device="cpu", shift=None, mtp_keep_up: bool = True,
                   mtp_keep_last: int | None = None) -> LanePlans:
        if shift is not None:
            raise NotImplementedError("attention-DP lanes do not overlap MTP steps (no unsettled rows to shift)")
        lanes: list[list[SeqStep]] = [[] for _ in self.managers]
        idx: list[list[int]] = [[] for _ in self.managers]
        for i, s in enumerate(seqs):
            lane = self.lane_of[s.req_id]
            lanes[lane].append(s)
            idx[lane].append(i)
        N = max([pad_tokens_to or 0, 1] + [sum(s.num_new for s in ls) for ls in lanes])
        B = max([pad_batch_to or 0, 1] + [len(ls) for ls in lanes])
        plans = []
        try:
            for lane, (m, ls) in enumerate(zip(self.managers, lanes)):
                plans.append(m.begin_step(ls, pad_tokens_to=N, pad_batch_to=B, max_entries=max_entries,
                                          max_blocks=max_blocks, device=device if lane == 0 else "cpu",
                                          mtp_keep_up=mtp_keep_up, mtp_keep_last=mtp_keep_last)
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
        return LanePlans(tuple(plans), local, tuple(tuple(i) for i in idx), N, B)

    def mtp_current(self, req_ids) -> bool:
        return all(self.managers[self.lane_of[r]].mtp_current([r]) for r in req_ids)

    def commit_step(self, plan: LanePlans, num_accepted: Sequence[int], unsettled: Sequence[int] | None = None) -> None:
        if unsettled is not None and any(unsettled):
            raise NotImplementedError("attention-DP lanes do not overlap MTP steps (nothing is left unsettled)")
        for m, p, idx in zip(self.managers, plan.plans, plan.lane_indices):
            if p is not None:
                m.commit_step(p, [num_accepted[i] for i in idx])

    def settle(self, plan: LanePlans, extras: dict) -> None:
        if extras:
            raise NotImplementedError("attention-DP lanes do not overlap MTP steps (nothing is left unsettled)")

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
