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
the queue times of the requests it scheduled first, the engine's stats, and how long the step took and what
it ran (a CUDA graph, an eager decode / verify, or prefill chunks: ``StepKinds``); a step slower than
``SLOW_STEP_S`` is logged with what it held. With ``batch_wait_steps`` (``dsv4 serve --batch_wait_steps``, off by
default; TensorRT-LLM's ``batch_wait_timeout_iters``) new requests that arrive while the engine is busy are held
back until every free batch slot has one or the first of them has waited that many steps, so that they prefill in
one step instead of one step each (a step with a prefill chunk runs eagerly; a batch of decodes replays a CUDA
graph); an idle engine takes them at once. A request leaves the engine's table
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
from .messages import Abort, Add, Dead, Step, Stop, poller

log = logging.getLogger("dsv4.serve")

SLOW_STEP_S = 1.0  # a step slower than this is logged (what it held, and how long)


class StepKinds:
    """What the step ``engine`` has just run was: "graph" (it replayed a CUDA graph: a decode / verify batch with a
    bucket that fits), "prefill" (eager, with prefill chunks: more tokens than 1 + draft_len per request), "eager"
    (a decode / verify batch run eagerly: no graphs, or no bucket fits its size, e.g. 31 requests with buckets 16
    and 32 and padding off), "readback" (nothing scheduled: the overlap scheduler's last step read back). Call it
    after each ``engine.step()``."""

    def __init__(self, engine):
        self.engine = engine
        self.graphs = getattr(getattr(engine, "runner", None), "graphs", None)
        self._replays = self._count("num_replays", self.graphs)
        self._steps = self._count("num_steps", engine)

    @staticmethod
    def _count(name: str, obj) -> int:
        return getattr(obj, name, 0) if obj is not None else 0

    def __call__(self) -> str:
        replays, steps = self._count("num_replays", self.graphs), self._count("num_steps", self.engine)
        ran, graphed = steps != self._steps, replays != self._replays
        self._replays, self._steps = replays, steps
        if graphed:
            return "graph"
        if not ran:
            return "readback"
        last = getattr(self.engine, "last_step", None) or {}
        rows = 1 + (getattr(self.engine, "draft_len", 0) or 0)  # a decode / verify row's tokens at most
        return "prefill" if last.get("num_tokens", 0) > rows * last.get("num_seqs", 0) else "eager"


@dataclass(eq=False)
class _Tracked:
    arrival: float  # perf_counter time (this process's clock) the request reached the server
    num_sent: int = 0  # tokens of the request already sent


class EngineLoop:
    def __init__(self, engine, conn, batch_wait_steps: int = 0):
        self.engine = engine
        self.conn = conn
        self.batch_wait_steps = batch_wait_steps
        self._held: list[tuple[Add, int]] = []  # (a new request held back, the step count when it came)
        self._steps = 0
        self._reqs: dict[str, _Tracked] = {}
        self._unscheduled: set[str] = set()  # requests whose queue time is not reported yet
        self._pending: list[tuple] = []  # updates (Update's fields) for the next message
        self._kinds = StepKinds(engine)
        self._has_message = poller(conn)
        self._stop = False
        self._check_cache = env.flag(env.CHECK_CACHE)

    def run(self) -> None:
        """Until ``Stop`` or the connection closes. If the loop itself fails, the HTTP side is told (``Dead``)
        and the exception propagates."""
        try:
            while not self._stop:
                if not self.engine.has_unfinished_requests() and not self._held:
                    if self._check_cache:
                        self.engine.cache.check_integrity()
                    self._send(0)
                    self._take(self.conn.recv())  # sleep until there is work
                self._drain()
                if self._held:
                    self._release()
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
        while not self._stop and self._has_message():
            self._take(self.conn.recv())

    def _take(self, msg) -> None:
        if isinstance(msg, Add):
            if self.batch_wait_steps and self.engine.has_unfinished_requests():
                self._held.append((msg, self._steps))
            else:
                self._add(msg)
        elif isinstance(msg, Abort):
            if any(m.rid == msg.rid for m, _ in self._held):
                self._held = [(m, s) for m, s in self._held if m.rid != msg.rid]
                return
            self._reqs.pop(msg.rid, None)
            self._unscheduled.discard(msg.rid)
            self.engine.abort_request(msg.rid)
        elif isinstance(msg, Stop):
            self._stop = True
        else:
            raise TypeError(f"the engine loop got an unknown message: {type(msg).__name__}")

    def _release(self) -> None:
        """The held requests go to the engine together once the engine is idle, they fill its free batch slots,
        or the first of them has waited ``batch_wait_steps`` steps."""
        e = self.engine
        cfg = getattr(e, "cfg", None)
        room = cfg.max_batch_size * getattr(e, "num_lanes", 1) - len(e.requests) if cfg is not None else None
        if (not e.has_unfinished_requests() or (room is not None and len(self._held) >= room)
                or self._steps - self._held[0][1] >= self.batch_wait_steps):
            held, self._held = self._held, []
            for msg, _ in held:
                self._add(msg)

    def _add(self, msg: Add) -> None:
        age = max(0.0, time.time() - msg.arrival)
        try:
            self.engine.add_request(msg.prompt_ids, msg.params, request_id=msg.rid)
        except RequestError as e:
            self._pending.append((msg.rid, [], "error", str(e), 400, None))
            return
        self._reqs[msg.rid] = _Tracked(time.perf_counter() - age)
        self._unscheduled.add(msg.rid)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outs = self.engine.step()
        except Exception as e:  # the step's requests ended with an error; the others are failed too
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {type(e).__name__}: {e}")
            self._send(0)
            return
        took = time.perf_counter() - t0
        self._steps += 1
        kind = self._kinds()
        if took > SLOW_STEP_S:
            self._log_slow(took, kind)
        queue_times = self._queue_times() if self._unscheduled else []
        reqs, pending = self._reqs, self._pending
        for out in outs:
            t = reqs.get(out.request_id)
            if t is None:
                continue
            comp = out.outputs[0]
            ids = comp.token_ids
            finish = comp.finish_reason if out.finished else None
            if len(ids) == t.num_sent and finish is None:
                continue  # (a prefill chunk that emitted nothing)
            new = ids[t.num_sent:]
            logprobs = comp.logprobs[t.num_sent:] if comp.logprobs is not None else None
            t.num_sent = len(ids)
            if finish is not None:
                del reqs[out.request_id]
                self.engine.abort_request(out.request_id)  # a finished request: only leaves the table
                pending.append((out.request_id, new, finish, "the engine failed" if finish == "error" else None,
                                500, logprobs))
            else:
                pending.append((out.request_id, new, None, None, 500, logprobs))
        self._send(1, queue_times, took, kind)

    def _log_slow(self, took: float, kind: str) -> None:
        last = getattr(self.engine, "last_step", None) or {}
        log.warning("engine step %s took %.2f s (%s: %s requests, %s new tokens)", last.get("step", "?"), took, kind,
                    last.get("num_seqs", "?"), last.get("num_tokens", "?"))

    def _fail_all(self, message: str) -> None:
        reqs, self._reqs = self._reqs, {}
        self._unscheduled.clear()
        for rid in reqs:
            self.engine.abort_request(rid)
            self._pending.append((rid, [], "error", message, 500, None))

    def _queue_times(self) -> list[float]:
        """Arrival (at the server) -> the first step that scheduled the request (the engine's
        ``first_scheduled_time``), once per request."""
        out = []
        for rid in list(self._unscheduled):
            t = self._reqs.get(rid)
            req = self.engine.requests.get(rid)
            if t is None:
                self._unscheduled.discard(rid)  # (finished or failed before it was seen scheduled)
            elif req is not None and req.first_scheduled_time is not None:
                self._unscheduled.discard(rid)
                out.append(max(0.0, req.first_scheduled_time - t.arrival))
        return out

    def _send(self, steps: int, queue_times: list[float] | None = None, took: float = 0.0, kind: str = "") -> None:
        updates, self._pending = self._pending, []
        self.conn.send(Step(updates, queue_times or [], self._stats(), steps, took, kind))

    def _stats(self) -> tuple:
        s = self.engine.get_stats()
        kv, spec = s["kv_cache_usage"], s["speculative"]
        return (s["num_running"], s["num_waiting"], kv["num_blocks"], kv["used_blocks"], kv["num_slots"],
                kv["used_slots"], spec["num_draft_tokens"] if spec else None,
                spec["num_accepted_tokens"] if spec else None,
                spec["pause"]["paused"] if spec and spec.get("pause") else None)
