"""The HTTP side's handle on the engine loop (``loop.py``), wherever it runs (``host.py``).

    handlers (asyncio)                             engine loop
    ------------------                             -----------
    submit(rid, ids, params, sink) --sender-->     Add
    abort(rid)                     --sender-->     Abort
    sink.queue  <--reader (event loop)--           Step: every request's new tokens, stats

Messages to the loop go through a sender thread, so a handler never blocks on a full pipe. Messages from it
are read on the event loop itself (``loop.add_reader`` on the connection), one ``Step`` per engine step, and
handed to the sinks' asyncio queues; the engine-level metrics (queue time, running / waiting, KV cache use,
MTP counters) are observed from them. If the loop dies (``Dead``) or its process goes away (the connection
closes), every open request gets an error event and new ones a 503.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from ..engine.sampling_params import SamplingParams
from .messages import Abort, Add, Dead, Stats, Step, Stop, Update
from .protocol import ApiError

log = logging.getLogger("dsv4.serve")


class Event(NamedTuple):
    """An engine update of one choice, with the choice's index in its HTTP request (what a sink's queue holds)."""

    index: int
    update: Update


@dataclass(eq=False)
class Sink:
    queue: asyncio.Queue
    index: int
    arrival: float = field(default_factory=time.perf_counter)


class EngineClient:
    def __init__(self, host, metrics=None):
        self.host = host
        self.conn = host.conn
        self.metrics = metrics
        self.error: str | None = None  # why the engine is gone, once it is
        self._sinks: dict[str, Sink] = {}
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="dsv4-engine-sender", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._spec_seen = (0, 0)

    # ---- life (the event loop's thread) --------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.conn.fileno(), self._on_readable)
        self._sender.start()

    def stop(self) -> None:
        """Stop the engine loop and its host (process or thread); open requests get an error event."""
        self._unwatch()
        if self._sender.is_alive():
            self._outbox.put(Stop())
            self._sender.join(10)
        self.host.stop()
        self._gone("the server is shutting down", quiet=True)

    @property
    def alive(self) -> bool:
        return self.error is None and self.host.alive

    def check_alive(self) -> None:
        """A 503 (OpenAI's error shape) when the engine cannot take requests."""
        if not self.alive:
            raise ApiError(f"the engine is not running: {self.error or 'its process has ended'}", status=503,
                           type="server_error", code="engine_unavailable")

    # ---- the handlers' side ------------------------------------------------------------------------
    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        self._sinks[rid] = sink
        arrival = time.time() - (time.perf_counter() - sink.arrival)  # wall clock: the engine's process reads it
        self._outbox.put(Add(rid, prompt_ids, params, arrival))

    def abort(self, rid: str) -> None:
        """Drop a request wherever it is (queued, running, finished): its cache is freed, no more events."""
        self._sinks.pop(rid, None)
        self._outbox.put(Abort(rid))

    def _send_loop(self) -> None:
        while True:
            msg = self._outbox.get()
            try:
                self.conn.send(msg)
            except (OSError, ValueError):
                return  # the engine is gone: the reader sees it
            if isinstance(msg, Stop):
                return

    # ---- the engine's side (read on the event loop) ---------------------------------------------------
    def _on_readable(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                if isinstance(msg, Step):
                    self._on_step(msg)
                elif isinstance(msg, Dead):
                    self._unwatch()
                    self._gone(msg.message)
                    return
                else:
                    raise TypeError(f"the engine loop sent an unknown message: {type(msg).__name__}")
                if not self.conn.poll():
                    return
        except (EOFError, OSError):
            self._unwatch()
            code = self.host.exit_code
            self._gone("the engine process has ended" + (f" (exit code {code})" if code is not None else ""))

    def _on_step(self, msg: Step) -> None:
        for u in msg.updates:
            sink = self._sinks.get(u.rid)
            if sink is None:
                continue  # aborted here; its last tokens were on the way
            if u.finish_reason is not None:
                del self._sinks[u.rid]
            sink.queue.put_nowait(Event(sink.index, u))
        m = self.metrics
        if m is not None:
            for q in msg.queue_times:
                m.m(m.queue_time).observe(q)
            if msg.steps:
                m.m(m.engine_steps).inc(msg.steps)
            self._observe_stats(msg.stats)

    def _unwatch(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.conn.fileno())
        self._loop = None

    def _gone(self, message: str, quiet: bool = False) -> None:
        if self.error is None:
            self.error = message
            if not quiet:
                log.error("%s", message)
        sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            sink.queue.put_nowait(Event(sink.index, Update(rid, [], "error", message, 500)))

    # ---- metrics ---------------------------------------------------------------------------------------
    def _observe_stats(self, s: Stats) -> None:
        """MTP counters and gauges, from the engine's live stats."""
        m = self.metrics
        if s.spec_drafts is not None:
            drafts, accepted = s.spec_drafts, s.spec_accepted
            d0, a0 = self._spec_seen
            if drafts >= d0 and accepted >= a0:  # (counters restart if someone resets the engine's stats)
                m.m(m.spec_drafts).inc(drafts - d0)
                m.m(m.spec_accepted).inc(accepted - a0)
            self._spec_seen = (drafts, accepted)
            if drafts:
                m.m(m.spec_acceptance).set(accepted / drafts)
        m.m(m.running).set(s.num_running)
        m.m(m.waiting).set(s.num_waiting)
        m.m(m.kv_blocks_free).set(s.kv_blocks - s.kv_used_blocks)
        m.m(m.kv_usage).set(s.kv_used_blocks / s.kv_blocks if s.kv_blocks else 0.0)
        m.m(m.kv_slots).set(s.kv_slots)
        m.m(m.kv_slots_used).set(s.kv_used_slots)
