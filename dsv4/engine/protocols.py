"""What the engine needs of its cache and its scheduler, as Protocols. The single-device classes
(``cache.manager.KVCacheManager``, ``engine.scheduler.Scheduler``) and attention DP's per-lane compositions
(``parallel.lanes.LaneCaches``, ``DataParallelScheduler``) both satisfy them (``tests/test_protocols.py``
checks every member and signature), so the engine never asks which one it holds."""

from __future__ import annotations

from typing import Protocol, Sequence, runtime_checkable

from ..cache.manager import SeqStep
from .request import Request
from .scheduler import ScheduledSeq


@runtime_checkable
class StepCache(Protocol):
    """The cache's bookkeeping as the engine drives it: one step at a time, begun, then committed or aborted."""

    def begin_step(self, seqs: Sequence[SeqStep], *, pad_tokens_to: int | None = None,
                   pad_batch_to: int | None = None, max_entries: int | None = None, max_blocks: int | None = None,
                   device="cpu", shift=None, mtp_keep_up: bool = True, mtp_keep_last: int | None = None):
        """Reserve the step's rows and return its immutable plan (a StepPlan, or a LanePlans of them);
        ``shift``: the device's committed rows beyond the host's, for requests with unsettled rows;
        ``mtp_keep_up`` False: the step leaves the MTP layer's window rows unwritten (drafting paused);
        ``mtp_keep_last``: it writes only each request's last this many rows of them."""

    def mtp_current(self, req_ids) -> bool:
        """Whether these requests' MTP window rings hold every row a drafting pass reads."""

    def commit_step(self, plan, num_accepted: Sequence[int], unsettled: Sequence[int] | None = None) -> None: ...

    def settle(self, plan, extras: dict) -> None:
        """Commit the rows an overlapped MTP step left unsettled, once read back."""

    def abort_step(self, plan) -> None: ...

    def check_integrity(self) -> None: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_slots(self) -> int: ...

    @property
    def num_slots(self) -> int: ...


@runtime_checkable
class StepScheduler(Protocol):
    """Which requests run in the next step and how many of their tokens."""

    num_preemptions: int

    def add(self, req: Request): ...

    def has_work(self) -> bool: ...

    def schedule(self) -> list[ScheduledSeq]: ...

    def finish(self, req: Request): ...

    def forget(self, req: Request): ...

    def reset_stats(self) -> None: ...
