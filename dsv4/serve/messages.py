"""What the HTTP side and the engine loop say to each other over their connection (pickled by
``multiprocessing.connection``; both ends are this package, in one machine). Named tuples, except inside
``Step``: one crosses per engine step, and its updates and stats travel as plain tuples (the fields of
``Update`` and ``Stats`` in order; ``Update._make`` / ``Stats._make`` name them again, ``step_updates`` /
``step_stats`` for a whole message), since pickle reduces each named tuple through Python code: a step of 32
updates pickled in 90 us as named tuples and 10 us as plain ones (2-core CPU), time the engine loop spends
between steps.

HTTP side -> engine loop: ``Add``, ``Abort``, ``Stop``. Engine -> HTTP side: ``Ready`` or ``Failed`` once (a
process host's start-up), then one ``Step`` per engine step (and one when the loop goes idle), and ``Dead`` if
the loop fails.
"""

from __future__ import annotations

import select
from dataclasses import dataclass
from typing import Callable, NamedTuple

from ..engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side needs to know of the engine (it loads the tokenizer itself, from the model path)."""

    max_seq_len: int
    vocab_size: int
    eos_token_id: int | None
    pid: int  # the process the engine loop runs in


class Add(NamedTuple):
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float  # wall-clock time (time.time()) the request reached the server: its queue time starts there


class Abort(NamedTuple):
    rid: str


class Stop(NamedTuple):
    """End the loop (the requests still in the engine are aborted)."""


class Update(NamedTuple):
    """What one step did to one request: the tokens it added (not those sent before); ``finish_reason`` on its
    last update; ``error`` when it failed, with the HTTP status that fits (400: the engine refused the request;
    500: the engine failed)."""

    rid: str
    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    status: int = 500
    logprobs: list[dict[int, float]] | None = None  # one per token of token_ids, when the request asked


class Stats(NamedTuple):
    """The engine's live state after a step (``LLMEngine.get_stats()``), for the metrics."""

    num_running: int
    num_waiting: int
    kv_blocks: int
    kv_used_blocks: int
    kv_slots: int
    kv_used_slots: int
    spec_drafts: int | None  # MTP counters since the engine's last reset_stats; None without MTP
    spec_accepted: int | None
    spec_paused: bool | None = None  # drafting paused now (engine/spec_pause.py); None without the pause


def poller(conn, event: int = select.POLLIN) -> Callable[[], bool]:
    """``check()``: whether ``conn`` is ready now (POLLIN: a message, or the other end closed, waits; POLLOUT: its
    send buffer is three quarters free or more). One poll object kept for the connection: ``conn.poll()`` builds a
    selector every call, 15 us against 2 (2-core CPU), and both ends ask once or more per engine step."""
    p = select.poll()
    p.register(conn.fileno(), event)

    def check() -> bool:
        try:
            return bool(p.poll(0))
        except (OSError, ValueError):
            return event == select.POLLIN  # (closed: a read says so)

    return check


class Step(NamedTuple):
    updates: list[tuple]  # Update's fields, as plain tuples (see the module's docstring)
    queue_times: list[float]  # seconds from arrival to the first step that scheduled a request, once per request
    stats: tuple  # Stats' fields
    steps: int  # engine steps this message reports: 1, or 0 (the loop went idle, or a step failed)
    step_s: float = 0.0  # the engine's step() call, wall seconds (0 when steps is 0)
    kind: str = ""  # what that step ran: "graph", "eager", "prefill" or "readback" (loop.StepKinds)


def step_updates(msg: Step) -> list[Update]:
    return [Update._make(u) for u in msg.updates]


def step_stats(msg: Step) -> Stats:
    return Stats._make(msg.stats)


class Ready(NamedTuple):
    info: EngineInfo


class Failed(NamedTuple):
    """The engine could not be built (a process host's start-up)."""

    message: str


class Dead(NamedTuple):
    """The engine loop failed and has ended; every request still open fails with this."""

    message: str
