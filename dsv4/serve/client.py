"""The HTTP side's handle on the engine loop (``loop.py``), wherever it runs (``host.py``).

    handlers (asyncio)                             engine loop
    ------------------                             -----------
    submit(rid, ids, params, sink) --sender-->     Add
    abort(rid)                     --sender-->     Abort
    sink.queue  <--reader (event loop)--           Step: every request's new tokens, stats

A message to the loop is written at once when nothing is queued ahead of it, it is small and the connection
has room for it (so a request reaches the engine without waiting for another thread to get the interpreter
lock: up to the 5 ms switch interval while the event loop is busy); otherwise it goes through a sender thread,
so a handler never blocks on a full pipe. Messages from it are read on the event loop itself
(``loop.add_reader`` on the connection), one ``Step`` per engine step, and handed to the sinks' asyncio
queues; the engine-level metrics (queue time, step time by kind, running / waiting, KV cache use, MTP
counters) are observed from them. If the loop dies (``Dead``) or its process goes away (the connection
closes), every open request gets an error event and new ones a 503.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import select
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from multiprocessing.reduction import ForkingPickler

from ..engine.sampling_params import SamplingParams
from .messages import Abort, Add, Dead, Stats, Step, Stop, Update, poller
from .protocol import ApiError

log = logging.getLogger("dsv4.serve")

DIRECT_SEND_BYTES = 16 << 10  # a message up to this size is written from the event loop when the connection has room


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
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # pickled messages for the sender thread
        self._queued = 0  # messages put in the outbox and not yet written (the sender thread counts them down)
        self._queued_lock = threading.Lock()
        self._has_room = poller(self.conn, select.POLLOUT)
        self._has_message = poller(self.conn)
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
            self._post(Stop(), direct=False)
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

    # ---- the handlers' side (the event loop's thread: the one that sends) --------------------------------
    def submit(self, rid: str, prompt_ids: list[int], params: SamplingParams, sink: Sink) -> None:
        self._sinks[rid] = sink
        arrival = time.time() - (time.perf_counter() - sink.arrival)  # wall clock: the engine's process reads it
        self._post(Add(rid, prompt_ids, params, arrival))

    def abort(self, rid: str) -> None:
        """Drop a request wherever it is (queued, running, finished): its cache is freed, no more events."""
        self._sinks.pop(rid, None)
        self._post(Abort(rid))

    def _post(self, msg, direct: bool = True) -> None:
        """Write ``msg`` now when nothing is queued ahead of it (the sender thread has written all it was given,
        so nobody else writes), it is small and the connection has room; else queue it for the sender thread.
        (``conn.send`` is this: ``send_bytes`` of the ForkingPickler's bytes.)"""
        buf = ForkingPickler.dumps(msg)
        if direct and self._queued == 0 and len(buf) <= DIRECT_SEND_BYTES and self._has_room():
            try:
                self.conn.send_bytes(buf)
            except (OSError, ValueError):
                pass  # the engine is gone: the reader sees it
            return
        with self._queued_lock:
            self._queued += 1
        self._outbox.put((buf, isinstance(msg, Stop)))

    def _send_loop(self) -> None:
        while True:
            buf, last = self._outbox.get()
            try:
                self.conn.send_bytes(buf)
            except (OSError, ValueError):
                return  # the engine is gone: the reader sees it
            finally:
                with self._queued_lock:
                    self._queued -= 1
            if last:
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
                if not self._has_message():
                    return
        except (EOFError, OSError):
            self._unwatch()
            code = self.host.exit_code
            self._gone("the engine process has ended" + (f" (exit code {code})" if code is not None else ""))

    def _on_step(self, msg: Step) -> None:
        sinks = self._sinks
        for u in msg.updates:  # (Update's fields: rid, token_ids, finish_reason, ...)
            sink = sinks.get(u[0])
            if sink is None:
                continue  # aborted here; its last tokens were on the way
            if u[2] is not None:
                del sinks[u[0]]
            sink.queue.put_nowait(Event(sink.index, Update._make(u)))
        m = self.metrics
        if m is not None:
            for q in msg.queue_times:
                m.m(m.queue_time).observe(q)
            if msg.steps:
                m.m(m.engine_steps).inc(msg.steps)
                m.m(m.engine_step_time, kind=msg.kind).observe(msg.step_s)
            self._observe_stats(Stats._make(msg.stats))

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
        if s.spec_paused is not None:
            m.m(m.spec_paused).set(int(s.spec_paused))
        m.m(m.running).set(s.num_running)
        m.m(m.waiting).set(s.num_waiting)
        m.m(m.kv_blocks_free).set(s.kv_blocks - s.kv_used_blocks)
        m.m(m.kv_usage).set(s.kv_used_blocks / s.kv_blocks if s.kv_blocks else 0.0)
        m.m(m.kv_slots).set(s.kv_slots)
        m.m(m.kv_slots_used).set(s.kv_used_slots)
