"""Where the engine loop runs, and the HTTP side's end of its connection.

``EngineProcess`` (what ``dsv4 serve`` uses): a process of its own (multiprocessing, "spawn"), which builds the
``LLM`` from an ``EngineSpec`` and runs the loop, so the engine's steps and the HTTP side's per-token work
(detokenizing, SSE) do not share one interpreter lock. ``EngineThread``: the loop in a thread of this process,
for an ``LLM`` already built here (``build_app(llm)``). Both give ``conn`` (the connection to the loop),
``info`` (``EngineInfo``), ``tokenizer`` (loaded in this process), ``alive`` and ``stop()``.

The engine process ignores SIGINT (Ctrl-C reaches the whole process group; the server stops it), and ends when
its connection closes, so a server that dies, however it dies, leaves no engine behind.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import signal
import threading
from dataclasses import dataclass

from ..checkpoint.tokenizer import load_tokenizer
from .loop import EngineLoop
from .messages import EngineInfo, Failed, Ready, Stop

log = logging.getLogger("dsv4.serve")


class EngineStartError(RuntimeError):
    """The engine process could not build the engine (the message says why)."""


@dataclass(frozen=True)
class EngineSpec:
    """Everything the engine process needs to build the ``LLM`` (picklable)."""

    model_path: str
    config: object  # an EngineConfig, already validated
    threads: int | None = None  # torch.set_num_threads in the engine process
    log_level: int = logging.WARNING
    batch_wait_steps: int = 0  # EngineLoop's: new requests held back up to this many steps to prefill together


def _info(llm) -> EngineInfo:
    return EngineInfo(llm.engine.max_seq_len, llm.model_config.vocab_size,
                      llm.model_config.eos_token_id, os.getpid())


def freeze_heap() -> None:
    """Collect once, then move every object alive now (modules, the app, the tokenizer; in the engine process the
    model and the engine) out of the garbage collector's view (``gc.freeze``, as vLLM's server does). A full
    collection otherwise walks them all and stops the process while it does: 150 ms for the HTTP process's 200k
    startup objects on a 2-core CPU, seen as 200-300 ms stalls of every stream at once under load."""
    gc.collect()
    gc.freeze()


def _engine_main(spec: EngineSpec, conn) -> None:
    """The engine process: build the LLM, say Ready (or Failed), run the loop until Stop or the server is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level, format="%(levelname)s %(name)s [engine]: %(message)s")
    import torch

    from ..engine.config import EngineConfigError
    from ..llm import LLM

    if spec.threads is not None:
        torch.set_num_threads(spec.threads)
    try:
        llm = LLM(spec.model_path, config=spec.config, warmup=True)
    except (EngineConfigError, FileNotFoundError, ValueError, RuntimeError) as e:
        conn.send(Failed(f"cannot build the engine: {e}"))
        return
    except Exception as e:  # a bug: its traceback in the log, one line for the server to print
        conn.send(Failed(f"cannot build the engine: {type(e).__name__}: {e}"))
        raise
    try:
        freeze_heap()  # the model, the engine, torch: out of the collector's view (nothing steps while it collects)
        conn.send(Ready(_info(llm)))
        EngineLoop(llm.engine, conn, spec.batch_wait_steps).run()
    except (BrokenPipeError, ConnectionResetError):
        pass  # the server went away before the loop started
    finally:
        llm.shutdown()
        conn.close()


class EngineProcess:
    def __init__(self, spec: EngineSpec, main=_engine_main):
        """Start the engine process and wait until its engine is built (warmup included). Raises
        ``EngineStartError`` if it cannot be; anything else (Ctrl-C) stops the process before propagating.
        ``main(spec, conn)``: what the process runs (``_engine_main``; bench/serve_chunks.py gives a fake
        engine's, picklable by reference); ``spec.model_path`` names the tokenizer either way."""
        ctx = multiprocessing.get_context("spawn")
        self.conn, theirs = ctx.Pipe()
        self.process = ctx.Process(target=main, args=(spec, theirs), name="dsv4-engine", daemon=True)
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited: the child never sees Ctrl-C
        try:
            self.process.start()
        finally:
            signal.signal(signal.SIGINT, old)
        theirs.close()
        try:
            self.info = self._wait_ready()
            self.tokenizer = load_tokenizer(spec.model_path)  # the HTTP side's own
        except BaseException:
            self.stop(timeout=0)  # (an engine still building reads no Stop)
            raise

    def _wait_ready(self) -> EngineInfo:
        try:
            msg = self.conn.recv()
        except EOFError:
            self.process.join(10)
            raise EngineStartError(f"the engine process exited during start-up (exit code"
                                   f" {self.process.exitcode})") from None
        if isinstance(msg, Failed):
            raise EngineStartError(msg.message)
        if not isinstance(msg, Ready):
            raise EngineStartError(f"the engine process sent {type(msg).__name__} instead of Ready")
        return msg.info

    @property
    def alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exit_code(self) -> int | None:
        return self.process.exitcode

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the loop (``Stop``; the client sends it first when it can), wait up to ``timeout`` for the
        process, then terminate it. Safe to call more than once."""
        if self.process.is_alive() and timeout > 0:
            try:
                self.conn.send(Stop())
            except (OSError, ValueError):
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                log.warning("the engine process did not stop in %.0f s; terminating it", timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


class EngineThread:
    def __init__(self, llm, batch_wait_steps: int = 0):
        """Run the loop for ``llm`` (built in this process) in a thread, over a pipe as a process would."""
        self.conn, theirs = multiprocessing.Pipe()
        self.info = _info(llm)
        self.tokenizer = llm.tokenizer
        self._thread = threading.Thread(target=self._run, args=(llm.engine, theirs, batch_wait_steps),
                                        name="dsv4-engine-loop", daemon=True)
        self._thread.start()

    @staticmethod
    def _run(engine, conn, batch_wait_steps: int) -> None:
        try:
            EngineLoop(engine, conn, batch_wait_steps).run()
        except BaseException:
            pass  # logged by the loop, and the server told (Dead)
        finally:
            conn.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def exit_code(self) -> int | None:
        return None

    def stop(self, timeout: float = 15.0) -> None:
        if self._thread.is_alive():
            try:
                self.conn.send(Stop())
            except (OSError, ValueError):
                pass
            self._thread.join(timeout)
        self.conn.close()
