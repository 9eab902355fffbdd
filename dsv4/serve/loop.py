"""The engine loop: one thread owns the engine; HTTP handlers talk to it through queues.

    handlers (asyncio)                         engine thread
    ------------------                         -------------
    submit(rid, ids, params, sink) --inbox-->  add_request          \\
    abort(rid)                     --inbox-->  abort_request         |  drained before every step, so requests
                                                                     |  that arrive while a step runs join the
    sink.queue  <--call_soon_threadsafe-----  step() -> new tokens  /   next one (continuous batching)

A sink is an asyncio queue plus the choice index its events carry; the events of one step reach the event
loop in one callback. A request leaves the engine's table when it finishes, is aborted (client gone, a stop
string matched) or fails; aborting it frees its cache slot and blocks. When the engine is idle the thread
sleeps on the inbox, and (``DSV4_CHECK_CACHE=1``) checks that the cache is whole.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from .. import env
from ..engine.engine import RequestError
from ..engine.sampling_params import SamplingParams

log = logging.getLogger("dsv4.serve")


@dataclass(frozen=True)
class Event:
    """New tokens of one choice. ``finish_reason`` is set on its last event; ``error`` when it failed, with the
    HTTP status that fits (400: the engine refused the request; 500: the engine failed)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500


@dataclass(eq=False)
class Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int
    arrival: float = field(default_factory=time.perf_counter)
    num_sent: int = 0  # tokens of the request already sent as events
    scheduled: bool = False


def _deliver(batch: list[tuple[asyncio.Queue, Event]]) -> None:
    for q, ev in batch:
        q.put_nowait(ev)


class EngineLoop:
    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._stop = threading.Event()
        self._check_cache = env.flag(env.CHECK_CACHE)
        self.error: BaseException | None = None  # what killed the thread, if anything did
        self._spec_seen = (0, 0)
        self._thread = threading.Thread(target=self._run, name="dsv4-engine-loop", daemon=True)

    # ---- the handlers' side (any thread) ------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        self._inbox.put(("add", rid, prompt_ids, params, sink))

    def abort(self, rid: str) -> None:
        """Drop a request wherever it is (queued, running, finished): its cache is freed, no more events."""
        self._inbox.put(("abort", rid))

    # ---- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                idle = not self.engine.has_unfinished_requests()
                if idle:
                    if self._check_cache:
                        self.engine.cache.check_integrity()
                    self._update_gauges()
                    self._take(self._inbox.get())  # sleep until there is work
                self._drain()
                if self.engine.has_unfinished_requests():
                    self._step()
        except BaseException as e:  # the loop is dead: every waiting client gets an error
            self.error = e
            log.exception("the engine loop stopped")
            self._fail_all(f"the engine loop stopped: {type(e).__name__}: {e}")
            raise

    def _drain(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._take(msg)

    def _take(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            _, rid, ids, params, sink = msg
            try:
                self.engine.add_request(ids, params, request_id=rid)
            except RequestError as e:
                sink.loop.call_soon_threadsafe(_deliver, [(sink.queue, Event(sink.index, [], "error", str(e), 400))])
                return
            self._sinks[rid] = sink
        elif kind == "abort":
            rid = msg[1]
            self._sinks.pop(rid, None)
            self.engine.abort_request(rid)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            outs = self.engine.step()
        except Exception as e:  # the step's requests ended with an error; the others are failed too
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
            return
        if self.metrics is not None:
            self._observe_queue_time(start)
        batch = {}
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            comp = out.outputs[0]
            new = comp.token_ids[sink.num_sent:]
            sink.num_sent = len(comp.token_ids)
            finish = comp.finish_reason if out.finished else None
            if finish is not None:
                del self._sinks[out.request_id]
                self.engine.abort_request(out.request_id)  # a finished request: only leaves the table
            batch.setdefault(sink.loop, []).append(
                (sink.queue, Event(sink.index, new, finish, "the engine failed" if finish == "error" else None)))
        for loop, items in batch.items():
            loop.call_soon_threadsafe(_deliver, items)
        if self.metrics is not None:
            self._observe_step()

    def _fail_all(self, message: str) -> None:
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            self.engine.abort_request(rid)
            sink.loop.call_soon_threadsafe(_deliver, [(sink.queue, Event(sink.index, [], "error", message))])

    # ---- metrics (engine thread) ---------------------------------------------------------------------
    def _observe_queue_time(self, step_start: float) -> None:
        """Arrival -> the start of the first step that computed some of the request."""
        m = self.metrics
        for rid, sink in self._sinks.items():
            if not sink.scheduled:
                req = self.engine.requests.get(rid)
                if req is not None and (req.num_computed > 0 or req.output_ids):
                    sink.scheduled = True
                    m.m(m.queue_time).observe(max(0.0, step_start - sink.arrival))

    def _observe_step(self) -> None:
        """After a step: MTP counters, gauges."""
        m = self.metrics
        m.m(m.engine_steps).inc()
        stats = self.engine.spec_stats
        drafts, accepted = getattr(stats, "num_draft_tokens", 0), getattr(stats, "num_accepted_tokens", 0)
        d0, a0 = self._spec_seen
        if drafts >= d0 and accepted >= a0:  # (counters restart if someone resets the engine's stats)
            m.m(m.spec_drafts).inc(drafts - d0)
            m.m(m.spec_accepted).inc(accepted - a0)
        self._spec_seen = (drafts, accepted)
        if drafts:
            m.m(m.spec_acceptance).set(accepted / drafts)
        self._update_gauges()

    def _update_gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        sched, cache = self.engine.scheduler, self.engine.cache
        m.m(m.running).set(len(getattr(sched, "running", ())))
        m.m(m.waiting).set(len(getattr(sched, "waiting", ())))
        num_blocks = getattr(cache, "num_blocks", 0)
        free_blocks = cache.num_free_blocks
        m.m(m.kv_blocks_free).set(free_blocks)
        m.m(m.kv_usage).set((num_blocks - free_blocks) / num_blocks if num_blocks else 0.0)
        m.m(m.kv_slots).set(cache.num_slots)
        m.m(m.kv_slots_used).set(cache.num_slots - cache.num_free_slots)
