"""The engine loop: it owns the engine and runs where the engine lives (the engine process ``dsv4 serve``
starts, or a thread of the server's process for an ``LLM`` built there; see ``host.py``). It talks to the HTTP
side (``client.py``) over one connection, in the messages of ``messages.py``:

    HTTP side                                  engine loop
    ---------                                  -----------
    Add(rid, prompt ids, params)   --conn-->   add_request          \\
    Abort(rid)                     --conn-->   abort_request         |  drained before every step, so requests
    Stop()                         --conn-->   end the loop          |  that arrive while a step runs join the
                                                                     |  next one (continuous batching)
    Step(updates, stats)           <--conn--   step() -> new tokens /

One ``Step`` message per engine step carries every request's new tokens (and logprobs, finish reason or error),
the queue times of the requests it scheduled first, and the engine's stats. A request leaves the engine's table
when it finishes, is aborted (client gone, a stop string matched) or fails; aborting it frees its cache slot and
blocks. When the engine is idle the loop reports its stats once and sleeps on the connection, and
(``DSV4_CHECK_CACHE=1``) checks that the cache is whole. The connection closing (the server gone) ends it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from .. import env
from ..engine.engine import RequestError
from .messages import Abort, Add, Dead, Stats, Step, Stop, Update

log = logging.getLogger("dsv4.serve")


@dataclass(eq=False)
class _Tracked:
    arrival: float  # perf_counter time (this process's clock) the request reached the server
    num_sent: int = 0  # tokens of the request already sent
    scheduled: bool = False


class EngineLoop:
    def __init__(self, engine, conn):
        self.engine = engine
        self.conn = conn
        self._reqs: dict[str, _Tracked] = {}
        self._pending: list[Update] = []  # updates for the next message (refused requests, a failed step)
        self._stop = False
        self._check_cache = env.flag(env.CHECK_CACHE)

    def run(self) -> None:
        """Until ``Stop`` or the connection closes. If the loop itself fails, the HTTP side is told (``Dead``)
        and the exception propagates."""
        try:
            while not self._stop:
                if not self.engine.has_unfinished_requests():
                    if self._check_cache:
                        self.engine.cache.check_integrity()
                    self._send(0)
                    self._take(self.conn.recv())  # sleep until there is work
                self._drain()
                if not self._stop and self.engine.has_unfinished_requests():
                    self._step()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            log.info("the server closed the engine's connection; the engine loop ends")
        except BaseException as e:
            log.exception("the engine loop stopped")
            try:
                self.conn.send(Dead(f"the engine loop stopped: {type(e).__name__}: {e}"))
            except OSError:
                pass
            raise
        finally:
            for rid in list(self._reqs):  # (an engine that outlives the loop holds nothing of the server's)
                self.engine.abort_request(rid)
            self._reqs.clear()

    def _drain(self) -> None:
        while not self._stop and self.conn.poll():
            self._take(self.conn.recv())

    def _take(self, msg) -> None:
        if isinstance(msg, Add):
            age = max(0.0, time.time() - msg.arrival)
            try:
                self.engine.add_request(msg.prompt_ids, msg.params, request_id=msg.rid)
            except RequestError as e:
                self._pending.append(Update(msg.rid, [], "error", str(e), 400))
                return
            self._reqs[msg.rid] = _Tracked(time.perf_counter() - age)
        elif isinstance(msg, Abort):
            self._reqs.pop(msg.rid, None)
            self.engine.abort_request(msg.rid)
        elif isinstance(msg, Stop):
            self._stop = True
        else:
            raise TypeError(f"the engine loop got an unknown message: {type(msg).__name__}")

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:  # the step's requests ended with an error; the others are failed too
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self._send(0)
            return
        queue_times = self._queue_times()
        for out in outs:
            t = self._reqs.get(out.request_id)
            if t is None:
                continue
            comp = out.outputs[0]
            new = comp.token_ids[t.num_sent:]
            finish = comp.finish_reason if out.finished else None
            if not new and finish is None:
                continue  # (a prefill chunk that emitted nothing)
            logprobs = comp.logprobs[t.num_sent:] if comp.logprobs is not None else None
            t.num_sent = len(comp.token_ids)
            if finish is not None:
                del self._reqs[out.request_id]
                self.engine.abort_request(out.request_id)  # a finished request: only leaves the table
            self._pending.append(Update(out.request_id, new, finish,
                                        "the engine failed" if finish == "error" else None, 500, logprobs))
        self._send(1, queue_times)

    def _fail_all(self, message: str) -> None:
        reqs, self._reqs = self._reqs, {}
        for rid in reqs:
            self.engine.abort_request(rid)
            self._pending.append(Update(rid, [], "error", message, 500))

    def _queue_times(self) -> list[float]:
        """Arrival (at the server) -> the first step that scheduled the request (the engine's
        ``first_scheduled_time``), once per request."""
        out = []
        for rid, t in self._reqs.items():
            if not t.scheduled:
                req = self.engine.requests.get(rid)
                if req is not None and req.first_scheduled_time is not None:
                    t.scheduled = True
                    out.append(max(0.0, req.first_scheduled_time - t.arrival))
        return out

    def _send(self, steps: int, queue_times: list[float] | None = None) -> None:
        updates, self._pending = self._pending, []
        self.conn.send(Step(updates, queue_times or [], self._stats(), steps))

    def _stats(self) -> Stats:
        s = self.engine.get_stats()
        kv, spec = s["kv_cache_usage"], s["speculative"]
        return Stats(s["num_running"], s["num_waiting"], kv["num_blocks"], kv["used_blocks"], kv["num_slots"],
                     kv["used_slots"], spec["num_draft_tokens"] if spec else None,
                     spec["num_accepted_tokens"] if spec else None)
