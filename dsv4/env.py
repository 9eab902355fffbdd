"""Every environment switch the engine reads, in one place. None is needed to run it: each is a debugging aid,
a test hook or an override of a launcher's variables. Modules read them through the functions here, so a switch
cannot be spelled two ways or parsed by two rules.

| variable | read by | effect |
|---|---|---|
| ``DSV4_CHECK_CACHE=1`` | cache manager | the cache's integrity check after every step (on in every test) |
| ``DSV4_LOG_LEVEL`` | worker ranks | their logging level (default WARNING) |
| ``DSV4_DIST_TIMEOUT_S`` | ranks | seconds a collective may wait before the run fails (default 300) |
| ``DSV4_DUMP_STACKS_S=S`` | ranks | every rank prints its Python stacks every S seconds (a hang's diagnosis) |
| ``DSV4_HEARTBEAT_TIMEOUT_S`` | driver | a worker silent this long (it beats every 0.5 s) is declared stopped, killed and the run fails (default 10 s; 0 = off) |
| ``DSV4_INJECT_FAILURE`` | ranks (tests) | ``<rank>:<setup|forward|propose>[:<n>]`` makes that rank raise |
| ``DSV4_STATIC_GRAPHS_ON_CPU=1`` | CUDA backend (tests) | the decode kernels' torch twins and the graphs' static buffers on the CPU |

torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` are read where ranks start
(``dsv4/parallel/``), with the meaning torchrun gives them.
"""

from __future__ import annotations

import os

CHECK_CACHE = "DSV4_CHECK_CACHE"
LOG_LEVEL = "DSV4_LOG_LEVEL"
DIST_TIMEOUT_S = "DSV4_DIST_TIMEOUT_S"
DUMP_STACKS_S = "DSV4_DUMP_STACKS_S"
HEARTBEAT_TIMEOUT_S = "DSV4_HEARTBEAT_TIMEOUT_S"
INJECT_FAILURE = "DSV4_INJECT_FAILURE"
STATIC_GRAPHS_ON_CPU = "DSV4_STATIC_GRAPHS_ON_CPU"

ALL = (CHECK_CACHE, LOG_LEVEL, DIST_TIMEOUT_S, DUMP_STACKS_S, HEARTBEAT_TIMEOUT_S, INJECT_FAILURE,
       STATIC_GRAPHS_ON_CPU)


def flag(name: str) -> bool:
    """A switch that is on unless unset, empty or "0"."""
    return os.environ.get(name, "") not in ("", "0")


def text(name: str, default: str = "") -> str:
    return os.environ.get(name, default)


def seconds(name: str, default: float | None = None) -> float | None:
    """A number of seconds; None (or ``default``) when unset; a clear error when it is not a number."""
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: give a number of seconds") from None
