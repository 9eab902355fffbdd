"""KVCacheManager bookkeeping: allocation as values, exhaustion, step order, integrity (R5, R6, R7)."""

from __future__ import annotations

import pytest

from dsv4.cache import (CHECK_ENV, CacheConfigError, CacheIntegrityError, CacheLayout, KVCacheManager, SeqStep,
                        StalePlanError, StepOrderError)
from dsv4.config import get_preset


def layout(max_draft_len=2, tpb=16, preset="tiny"):
    return CacheLayout(get_preset(preset), max_draft_len, tpb)


def test_layout_values_and_validation():
    lay = layout(max_draft_len=3, tpb=32)
    assert lay.swa_cap == 8 + 3 and lay.num_swa_layers == 5 and lay.mtp_layer == 4
    assert lay.ratios == (4, 16) and lay.csa_layers == (1, 3) and lay.compressed_layers(16) == (2,)
    assert (lay.coff(4), lay.coff(16)) == (2, 1)
    assert (lay.state_cap(4), lay.state_cap(16)) == (8 + 3, 16 + 3)
    assert (lay.entries_per_block(4), lay.entries_per_block(16)) == (8, 2)
    with pytest.raises(CacheConfigError, match="not a multiple of the compress ratio.*use a multiple of 16"):
        layout(tpb=8)
    with pytest.raises(CacheConfigError, match="positive"):
        layout(tpb=0)
    with pytest.raises(CacheConfigError, match="max_draft_len"):
        layout(max_draft_len=-1)
    with pytest.raises(CacheConfigError, match="use a multiple of 128"):
        layout(tpb=64, preset="tiny-r128")
    no_mtp = get_preset("tiny").replace(num_mtp_layers=0)
    with pytest.raises(CacheConfigError, match="needs an MTP layer"):
        CacheLayout(no_mtp, 2, 16)
    assert CacheLayout(no_mtp, 0, 16).num_swa_layers == 4


def test_admit_reserve_free_accounting():
    m = KVCacheManager(layout(), num_slots=2, num_blocks=5)
    assert m.admit("a").ok and m.has("a") and m.num_free_slots == 1
    assert m.reserve("a", 17).ok and m.block_table("a") == (1, 2) and m.num_reserved_tokens("a") == 32
    assert m.reserve("a", 5).ok and m.block_table("a") == (1, 2)            # never shrinks
    assert m.can_reserve("a", 80) and not m.can_reserve("a", 81)
    assert m.num_free_blocks == 3                                           # can_reserve has no effect
    m.check_integrity()
    m.free("a")
    assert not m.has("a") and m.num_free_blocks == 5 and m.num_free_slots == 2
    with pytest.raises(KeyError, match=r"admit\('a'\)"):
        m.reserve("a", 1)
    with pytest.raises(ValueError, match="already admitted"):
        m.admit("b"), m.admit("b")


def test_exhaustion_is_a_value_and_leaks_nothing():
    m = KVCacheManager(layout(), num_slots=2, num_blocks=3)
    assert m.admit(1) and m.admit(2)
    r = m.admit(3)
    assert not r and not r.ok and "no free slot" in r.reason
    assert not m.has(3) and m.num_free_slots == 0
    assert m.reserve(1, 32)
    r = m.reserve(2, 33)                                                    # needs 3 blocks, 1 free
    assert not r.ok and "needs 3 more blocks" in r.reason and "1 free" in r.reason
    assert m.block_table(2) == () and m.num_free_blocks == 1               # no half allocation
    assert m.reserve(2, 16) and m.num_free_blocks == 0
    assert not m.reserve(1, 33) and m.block_table(1) == (1, 2)
    m.check_integrity()
    plan = m.begin_step([SeqStep(1, 16), SeqStep(2, 16)])
    m.commit_step(plan, [16, 16])
    for u in (1, 2):
        m.free(u)
    m.check_integrity()
    assert m.num_free_blocks == 3 and m.num_free_slots == 2


def test_begin_step_errors_name_the_missing_call():
    m = KVCacheManager(layout(max_draft_len=2), num_slots=2, num_blocks=4)
    with pytest.raises(KeyError, match=r"not admitted; call admit\('x'\)"):
        m.begin_step([SeqStep("x", 1)])
    m.admit("x")
    with pytest.raises(ValueError, match=r"reserved 0 tokens; call reserve\('x', 3\)"):
        m.begin_step([SeqStep("x", 3)])
    m.reserve("x", 16)
    with pytest.raises(ValueError, match="max_draft_len=2"):
        m.begin_step([SeqStep("x", 1, draft_len=3)])
    with pytest.raises(ValueError, match="twice"):
        m.begin_step([SeqStep("x", 1), SeqStep("x", 1)])
    with pytest.raises(ValueError, match="pad_tokens_to"):
        m.begin_step([SeqStep("x", 4)], pad_tokens_to=3)
    assert m.active_plan is None                                            # failed calls leave nothing
    plan = m.begin_step([SeqStep("x", 3, 2)])
    with pytest.raises(StepOrderError, match=r"step 0 is still active; call commit_step"):
        m.begin_step([SeqStep("x", 1)])
    with pytest.raises(StepOrderError, match="abort_step"):
        m.free("x")
    with pytest.raises(ValueError, match="accepted 0 of 3"):
        m.commit_step(plan, [0])
    with pytest.raises(ValueError, match="accepted counts"):
        m.commit_step(plan, [1, 1])
    assert m.num_computed("x") == 0 and m.active_plan is plan              # refused commits change nothing
    m.commit_step(plan, [1])
    assert m.num_computed("x") == 1 and m.step_id == 1


def test_rejecting_more_than_max_draft_len_is_refused():
    m = KVCacheManager(layout(max_draft_len=2), num_slots=1, num_blocks=4)
    m.admit("x"), m.reserve("x", 32)
    plan = m.begin_step([SeqStep("x", 10)])
    with pytest.raises(ValueError, match="rejects 3 of 10 tokens, more than max_draft_len=2"):
        m.commit_step(plan, [7])
    m.commit_step(plan, [8])
    assert m.num_computed("x") == 8


def test_rollback_keeps_lookahead_blocks():
    m = KVCacheManager(layout(max_draft_len=3), num_slots=1, num_blocks=4)
    m.admit("x"), m.reserve("x", 15)
    m.commit_step(m.begin_step([SeqStep("x", 14)]), [14])
    assert m.reserve("x", 14 + 4)                                           # verify of 1 + 3 drafts
    blocks = m.block_table("x")
    m.commit_step(m.begin_step([SeqStep("x", 4, 3)]), [1])                  # all drafts rejected
    assert m.num_computed("x") == 15 and m.block_table("x") == blocks and len(blocks) == 2


def test_abort_step_frees_its_requests():
    m = KVCacheManager(layout(), num_slots=2, num_blocks=4)
    for u in ("a", "b"):
        m.admit(u), m.reserve(u, 16)
    plan = m.begin_step([SeqStep("a", 5)])
    m.abort_step(plan)
    assert not m.has("a") and m.has("b") and m.active_plan is None
    with pytest.raises(StalePlanError):
        m.commit_step(plan, [5])
    m.check_integrity()
    m.commit_step(m.begin_step([SeqStep("b", 2)]), [2])                     # the manager carries on


@pytest.mark.parametrize("corrupt,message", [
    (lambda m: m._reqs["a"].blocks.append(m._reqs["b"].blocks[0]), "owned by 'b' and 'a'|owned by 'a' and 'b'"),
    (lambda m: m._free_blocks.append(m._reqs["a"].blocks[0]), "both free and owned"),
    (lambda m: m._reqs["a"].blocks.append(0), "owns the null block 0"),
    (lambda m: setattr(m._reqs["a"], "slot", 0), "null slot 0"),
    (lambda m: m._free_blocks.pop(), "free \\+ .* owned != "),
    (lambda m: setattr(m._reqs["a"], "num_computed", 99), "committed length 99 outside reserved"),
    (lambda m: m._reqs["b"].blocks.append(77), "block 77, outside 1..6"),
])
def test_check_integrity_detects(corrupt, message):
    m = KVCacheManager(layout(), num_slots=3, num_blocks=6)
    for u in ("a", "b"):
        m.admit(u), m.reserve(u, 20)
    m.check_integrity()
    corrupt(m)
    with pytest.raises(CacheIntegrityError, match=message):
        m.check_integrity()


def test_env_switch_runs_integrity_check_on_commit(monkeypatch):
    m = KVCacheManager(layout(), num_slots=2, num_blocks=4)
    m.admit("a"), m.reserve("a", 16)
    m._free_blocks.append(m._reqs["a"].blocks[0])                          # corrupt: a block free and owned
    monkeypatch.delenv(CHECK_ENV, raising=False)
    m.commit_step(m.begin_step([SeqStep("a", 1)]), [1])                     # switch off: not noticed
    monkeypatch.setenv(CHECK_ENV, "1")
    plan = m.begin_step([SeqStep("a", 1)])
    with pytest.raises(CacheIntegrityError, match="both free and owned"):
        m.commit_step(plan, [1])
