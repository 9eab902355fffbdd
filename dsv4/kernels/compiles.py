"""Triton kernels compiled after warmup: each one is a kernel specialization (sizes, alignments, constexprs)
that warmup did not run, and its first use costs the step that meets it the compile, or the load from Triton's
cache on disk (tens to hundreds of ms), with every request in that step waiting.

``COMPILES`` watches every Triton compile in this process (Triton's ``jit_cache_hook`` before it and
``jit_post_compile_hook`` after, chained to any hooks already set): the kernel's name, its specialization and
how long it took. Warmup marks its end (``mark``); ``since`` lists what compiled after the mark, and each of
those is logged as a warning naming the kernel, so a path warmup misses shows up in the log and in
dsv4-bench's report (``kernels_compiled``) rather than as an unexplained slow step. Without Triton (the CPU machines) nothing is
watched and the lists stay empty. Under multi-device runs it watches this process's rank only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("dsv4")


@dataclass(frozen=True)
class Compile:
    kernel: str  # the @triton.jit function's name
    specialization: str  # Triton's repr of the call: argument types, alignments, constexprs
    ms: float  # from the cache hook to the post-compile hook (a compile, or a load from the disk cache)
    at: float  # time.perf_counter() when it started


class CompileWatch:
    def __init__(self):
        self.compiles: list[Compile] = []
        self._started: dict[str, tuple[float, str, str]] = {}
        self._installed = False
        self._warn_from: int | None = None  # compiles from this index on are logged as warnings

    def install(self) -> bool:
        """Set the hooks (once per process); False where Triton is absent."""
        if self._installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        before, after = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

        def on_cache_miss(**kw):
            fn = kw.get("fn")
            name = str(getattr(fn, "name", fn)).rsplit(".", 1)[-1]  # (a nested function's: its qualified name)
            self._started[str(kw.get("key"))] = (time.perf_counter(), name, str(kw.get("repr", "")))
            return before(**kw) if before is not None else None

        def on_compiled(**kw):
            started = self._started.pop(str(kw.get("key")), None)
            if started is not None:
                self._record(*started)
            return after(**kw) if after is not None else None

        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = on_cache_miss, on_compiled
        self._installed = True
        return True

    def _record(self, t0: float, kernel: str, specialization: str) -> None:
        c = Compile(kernel, specialization, (time.perf_counter() - t0) * 1e3, t0)
        self.compiles.append(c)
        if self._warn_from is not None:
            log.warning("Triton kernel %s compiled after warmup (%.0f ms; a path warmup did not run): %s",
                        c.kernel, c.ms, c.specialization[:300])

    def mark(self) -> int:
        """Warmup's end: compiles from now on are logged as warnings; the index for ``since``."""
        self.install()
        self._warn_from = len(self.compiles)
        return self._warn_from

    def quiet(self) -> None:
        """Compiles are expected (an engine is built: its graphs captured, its warmup run): stop warning until
        the next ``mark``."""
        self.install()
        self._warn_from = None

    def since(self, index: int) -> list[Compile]:
        return self.compiles[index:]


COMPILES = CompileWatch()
