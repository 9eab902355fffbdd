"""The engine's cache and scheduler are Protocols (``dsv4/engine/protocols.py``); the single-device classes and
attention DP's lane compositions both satisfy them: every member present, every method's parameters the
Protocol's. A lane class that drifted (a renamed keyword, a missing property) fails here, not in a two-rank run."""

from __future__ import annotations

import inspect

import pytest

from dsv4.cache.layout import CacheLayout
from dsv4.cache.manager import KVCacheManager
from dsv4.config import get_preset
from dsv4.engine.protocols import StepCache, StepScheduler
from dsv4.engine.scheduler import Scheduler
from dsv4.parallel.lanes import DataParallelScheduler, LaneCaches


def _members(proto) -> list[str]:
    return [n for n in vars(proto) if not n.startswith("_")] + list(getattr(proto, "__annotations__", {}))


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def _check(proto, obj):
    assert isinstance(obj, proto)
    for name in _members(proto):
        want = getattr(proto, name, None)
        have = getattr(type(obj), name, None)
        if isinstance(want, property):
            assert isinstance(have, property) or name in vars(obj), f"{type(obj).__name__}.{name}: not a property"
        elif callable(want):
            assert callable(have), f"{type(obj).__name__}.{name} missing"
            assert _params(have) == _params(want), f"{type(obj).__name__}.{name}{inspect.signature(have)}"
        else:
            assert hasattr(obj, name), f"{type(obj).__name__}.{name} missing"


def _layout():
    return CacheLayout(get_preset("tiny"), 1, 128)


@pytest.mark.parametrize("lanes", [1, 2])
def test_caches_and_schedulers_satisfy_the_protocols(lanes):
    managers = [KVCacheManager(_layout(), 2, 8) for _ in range(lanes)]
    lane_of: dict = {}
    cache = managers[0] if lanes == 1 else LaneCaches(managers, lane_of, _layout(), 2)
    schedulers = [Scheduler(m, 2, 64) for m in managers]
    sched = schedulers[0] if lanes == 1 else DataParallelScheduler(schedulers, lane_of)
    _check(StepCache, cache)
    _check(StepScheduler, sched)
    for s in schedulers:
        s.num_preemptions = 3
    sched.reset_stats()
    assert sched.num_preemptions == 0 and all(s.num_preemptions == 0 for s in schedulers)


def test_the_check_finds_a_drifted_signature():
    class Drifted(KVCacheManager):
        def commit_step(self, plan, accepted):  # renamed parameter
            return super().commit_step(plan, accepted)

    with pytest.raises(AssertionError, match="commit_step"):
        _check(StepCache, Drifted(_layout(), 2, 8))
