"""Attention-DP lanes' bookkeeping on the driver, without ranks: the lanes' scheduler, their plans padded alike,
and an overlapped MTP step's shift, C column, positions and settling (dsv4.parallel.lanes)."""

import pytest
import torch

from dsv4.cache.layout import CacheLayout
from dsv4.cache.manager import KVCacheManager, SeqStep
from dsv4.config import get_preset
from dsv4.engine.request import Request
from dsv4.engine.sampling_params import SamplingParams as SP
from dsv4.engine.scheduler import Scheduler
from dsv4.parallel.lanes import DataParallelScheduler, LaneCaches


def test_attention_dp_balances_and_pads_lanes():
    """New requests go to the lane with the fewest in flight; every lane's plan has the same padded shape,
    and an idle lane 0 gets an inert plan on the null slot."""
    cfg = get_preset("tiny")
    layout = CacheLayout(cfg, 2, 16)
    managers = [KVCacheManager(layout, 4, 32) for _ in range(2)]
    lane_of: dict = {}
    sched = DataParallelScheduler([Scheduler(m, 4, 64) for m in managers], lane_of)
    reqs = [Request(str(i), [5] * n, SP(max_tokens=4)) for i, n in enumerate([3, 10, 4])]
    assert [sched.add(r) for r in reqs] == [0, 1, 0]
    sched.finish(reqs[1])  # lane 1 is empty again: it gets the next one
    assert sched.add(Request("3", [7] * 5, SP(max_tokens=4))) == 1
    caches = LaneCaches(managers, lane_of, layout, 4)
    seqs = sched.schedule()
    lp = caches.begin_step([SeqStep(s.request.request_id, s.num_new) for s in seqs])
    assert [len(i) for i in lp.lane_indices] == [2, 1]
    shapes = {(p.positions.shape[0], p.slots.shape[0]) for p in lp.plans}
    assert shapes == {(7, 2)}  # lane 0: 3 + 4 tokens in 2 rows; lane 1 padded to the same
    caches.commit_step(lp, [s.num_new for s in seqs])
    for r in (reqs[0], reqs[2]):
        sched.finish(r)
    lp = caches.begin_step([SeqStep("3", 1)], pad_tokens_to=4)
    assert lp.plans[0] is None and lp.local.num_seqs == 0 and lp.local.positions.shape[0] == 4
    assert not lp.local.swa_valid.any() and not lp.local.swa_write.any()  # reads nothing, writes the null row
    for t in lp.local.ratio_tables.values():  # compressor state and entries: null rows only
        assert not t.state_write.any() and not t.win_write.any() and not t.win_active.any()
    caches.abort_step(lp)
    caches.check_integrity()


def test_attention_dp_lanes_carry_an_overlapped_mtp_step():
    """An overlapped MTP step in the lanes' bookkeeping: a verify step commits the rows every outcome keeps and
    leaves its drafts unsettled in each lane's manager; the next step begins with the engine's shift (batch order,
    lane 0's requests first): lane 0's plan adds its slice to its C column, lane 1's CPU plan zeros, and LanePlans
    gives the whole batch's C (host lengths + shift) and its rows' positions; the verify step's extras settle in
    each request's own lane; a batch that interleaves the lanes is refused."""
    cfg = get_preset("tiny")
    layout = CacheLayout(cfg, 2, 16)
    managers = [KVCacheManager(layout, 4, 32) for _ in range(2)]
    lane_of = {"a": 0, "c": 0, "b": 1}
    caches = LaneCaches(managers, lane_of, layout, 4)
    for rid in ("a", "c", "b"):
        m = managers[lane_of[rid]]
        assert m.admit(rid).ok and m.reserve(rid, 40).ok
    order = ["a", "c", "b"]  # batch order: lane 0's, then lane 1's
    prompt = caches.begin_step([SeqStep(r, n) for r, n in zip(order, (5, 6, 7))])
    caches.commit_step(prompt, [5, 6, 7])
    verify = caches.begin_step([SeqStep(r, 3, 2) for r in order])  # the bonus row and 2 drafts each
    caches.commit_step(verify, [1, 1, 1], [2, 2, 2])  # the drafts' rows: known on the device only
    assert [managers[lane_of[r]].num_unsettled(r) for r in order] == [2, 2, 2]
    shift = torch.tensor([1, 0, 2])  # the drafts each accepted, on the device
    nxt = caches.begin_step([SeqStep(r, 3, 2) for r in order], shift=shift)
    assert nxt.unsettled == (2, 2, 2) and nxt.num_computed == (6, 7, 8) and nxt.step_id == verify.step_id + 1
    assert nxt.rows.tolist() == [7, 7, 10]
    assert nxt.plans[0].rows[:2].tolist() == [7, 7] and nxt.plans[1].rows[:1].tolist() == [8]  # (zeros: unread)
    assert nxt.positions.tolist() == [7, 8, 9, 7, 8, 9, 10, 11, 12]
    assert (nxt.lane_span(0), nxt.lane_span(1)) == ((0, 2), (2, 1))
    caches.commit_step(nxt, [1, 1, 1], [2, 2, 2])
    caches.settle(verify, {"a": 1, "c": 0, "b": 2})  # the verify step read back after the next one began
    # host lengths: the prompt, both steps' kept row, the verify step's extras
    assert [managers[lane_of[r]].num_computed(r) for r in order] == [8, 8, 11]
    assert [managers[lane_of[r]].num_unsettled(r) for r in order] == [2, 2, 2]  # (the next step's)
    caches.settle(nxt, {"a": 0, "c": 0, "b": 0})
    caches.check_integrity()
    with pytest.raises(ValueError, match="lane 0's first"):
        caches.begin_step([SeqStep(r, 1) for r in ("a", "b", "c")])
