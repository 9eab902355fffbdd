"""Ranks, their process groups, the driver's messages, and failure.

Who launches what. Rank 0 is the driver: the process that built the ``LLM``. With ``launch`` it hosts a
``TCPStore`` and starts ranks 1..W-1 as ``python -m dsv4.parallel.worker`` processes (no re-import of the
user's script); under ``torchrun`` (RANK / WORLD_SIZE set) every process is already there and rank 0 is the
driver. Every rank joins two groups:

* the data group (the default group: NCCL on CUDA, gloo on CPU): the model's collectives (all-reduce
  after ``wo_b`` and after the experts, the token all-gather of attention DP), with ``DSV4_DIST_TIMEOUT_S``
  (default 300 s) as the bound on any one collective;
* the control group (gloo, no practical timeout since a worker may wait idle for the next request): the
  driver's step messages (``broadcast_object_list``) and, under attention DP, logits gathered to the driver.

Failure. Whatever rank fails first writes ``"<rank>\\n<message>"`` under ``ABORT_KEY`` in the store
(compare-and-set: the first writer wins) and exits. Every worker runs a monitor thread that raises its
heartbeat counter in the store every ``HEARTBEAT_EVERY_S`` and exits its process as soon as the key is
set, the store is gone, or its parent (the driver) died: then with one line, ``dsv4 rank R: the driver
(pid P) exited; stopping``. The driver's monitor thread watches the other way: a worker process that ended
(killed without a word) or whose heartbeat has not moved for ``DSV4_HEARTBEAT_TIMEOUT_S`` (a stopped or
hung process; the thread beats whatever the main thread is blocked in) is recorded as the first failure,
and a silent one is killed, so that a collective blocked on it fails at once (a gloo collective fails as
soon as a peer's sockets close; NCCL's groups are aborted). The driver then (``fail``) stops the remaining
ranks and raises ``RankError`` naming the first failing rank and its message. A failed group is dead: the
``LLM`` that owned it refuses further work.
"""

from __future__ import annotations

import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from typing import Callable, NoReturn

import torch
import torch.distributed as dist

from .. import env

log = logging.getLogger("dsv4")

ABORT_KEY = "dsv4/abort"
HEARTBEAT_KEY = "dsv4/heartbeat/{}"  # a worker's beat counter, raised by its monitor thread
PID_KEY = "dsv4/pid/{}"  # "<host> <pid>" of a worker's process (to kill a silent rank torchrun started)
HEARTBEAT_EVERY_S = 0.5
TIMEOUT_ENV = env.DIST_TIMEOUT_S
HEARTBEAT_ENV = env.HEARTBEAT_TIMEOUT_S
STACKS_ENV = env.DUMP_STACKS_S  # debugging a hang: every rank prints its threads' Python stacks every S s
_CONTROL_TIMEOUT = datetime.timedelta(days=30)
_POLL_S = 0.1
_EXIT_LOCK = threading.Lock()  # a worker's last line is printed once, by whichever thread gets there first


class StopMsg:
    """The driver's last message: the workers exit."""


class RankError(RuntimeError):
    """A rank failed; every rank has been stopped. ``rank`` is the first rank that failed."""

    def __init__(self, rank: int, message: str):
        super().__init__(f"rank {rank} failed: {message}")
        self.rank, self.message = rank, message
        self.pids: list[int] = []


def data_timeout() -> datetime.timedelta:
    return datetime.timedelta(seconds=env.seconds(TIMEOUT_ENV, 300.0))


def heartbeat_timeout() -> float | None:
    """Seconds a worker may miss its heartbeat before the driver declares it stopped (None: not checked).
    Default 10 s: a beat comes every 0.5 s from a thread of its own, which torch's kernels and collectives do
    not hold up (they release the GIL), so only a stopped, hung or starved process goes silent that long."""
    s = env.seconds(HEARTBEAT_ENV, 10.0)
    if s == 0:
        return None
    if not s >= 2 * HEARTBEAT_EVERY_S:
        raise ValueError(f"{HEARTBEAT_ENV}={s:g}: give at least {2 * HEARTBEAT_EVERY_S:g} seconds (a worker beats"
                         f" every {HEARTBEAT_EVERY_S:g} s), or 0 to turn the heartbeat check off")
    return s


def _driver_exited(parent_pid: int | None, wait_s: float = 0.0) -> bool:
    """A worker: True once its parent, the driver, has exited. Waits up to ``wait_s`` for it: a dying driver's
    sockets close (failing this worker's collective) just before its children are re-parented."""
    if parent_pid is None:  # torchrun's ranks: the driver is not the parent
        return False
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def worker_env() -> dict:
    """The environment of a launched worker: this one, with the package importable, and C++ logging at errors
    only unless the user chose a level. (A dying driver closes its store's sockets a moment before its workers
    are re-parented: a heartbeat sent in that moment fails and is handled with one line, but c10d would first
    log the failure as a warning with its C++ stack.)"""
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return env


def describe_exception(e: BaseException) -> str:
    """One line of type and message, plus where it was raised (for the launcher's error)."""
    msg = "".join(traceback.format_exception_only(type(e), e)).strip()
    tb = traceback.extract_tb(e.__traceback__)
    if tb:
        f = tb[-1]
        msg += f" (at {os.path.basename(f.filename)}:{f.lineno} in {f.name})"
    return msg


def _is_comm_error(e: BaseException) -> bool:
    """A collective that failed because some other rank went away (not this rank's own fault)."""
    if isinstance(e, getattr(dist, "DistError", ())):
        return True
    text = str(e)
    return any(s in text for s in ("Connection closed", "Connection reset", "gloo", "NCCL", "Timed out",
                                   "timed out", "Broken pipe"))


def _backend_for(device: str) -> str:
    return "nccl" if str(device).startswith("cuda") else "gloo"


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank``: cuda:(base + rank) on CUDA (base = the driver's index), the CPU otherwise."""
    if str(device).startswith("cuda"):
        base = torch.device(device).index or 0
        return f"cuda:{base + rank}"
    return "cpu"


class Collectives:
    """The model's collectives over the data group (the same calls on gloo and NCCL)."""

    def __init__(self, rank: int, world_size: int, backend: str):
        self.rank, self.world_size, self.backend = rank, world_size, backend

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns ``t``."""
        dist.all_reduce(t)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[n, ...] on every rank (same n) -> [world * n, ...], rank order."""
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous())
        return torch.cat(parts, dim=0)

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """The driver's ``t`` on every rank, in place (same shape and dtype everywhere); returns ``t``. On NCCL it
        waits for the work queued before it on the device, not for the host."""
        dist.broadcast(t, src=0)
        return t

    def reduce_scatter(self, t: torch.Tensor) -> torch.Tensor:
        """[world * n, ...] partial sums on every rank -> this rank's n rows of the sum."""
        n = t.shape[0] // self.world_size
        if self.backend == "nccl":
            out = torch.empty((n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
            dist.reduce_scatter_tensor(out, t.contiguous())
            return out
        dist.all_reduce(t)  # gloo has no reduce-scatter: reduce everything, keep our rows
        return t[self.rank * n:(self.rank + 1) * n]


class RankGroup:
    """This process's place in the world: rank, groups, the store, and on the driver the worker processes."""

    def __init__(self, rank: int, world_size: int, device: str, store_addr: tuple[str, int],
                 procs: list | None = None):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.backend = _backend_for(device)
        self.store_addr = store_addr
        self.procs = procs or []  # rank r >= 1 at index r - 1 (driver with launch only)
        self.parent_pid: int | None = None  # a launched worker: the driver's pid
        self.control = None
        self._store = None  # a client of the store the ranks meet at (the driver's, or torchrun's)
        self.collectives = Collectives(rank, world_size, self.backend)
        self.failed: RankError | None = None
        self.closed = False
        self._exiting = False  # a worker reporting its own failure (its monitor must not exit under it)
        self._lock = threading.Lock()
        self._saved_threads: int | None = None
        self._owns_default = True
        self._stop = threading.Event()  # ends the driver's monitor thread (joined before the groups go)
        self._monitor: threading.Thread | None = None
        self._before_destroy: list = []  # called before the groups go (``on_destroy``)
        if env.seconds(STACKS_ENV):
            import faulthandler

            faulthandler.dump_traceback_later(env.seconds(STACKS_ENV), repeat=True)

    # ---- starting ---------------------------------------------------------------------------------------
    @classmethod
    def launch(cls, world_size: int, device: str, startup_timeout_s: float = 120.0) -> "RankGroup":
        """The driver: host the store, start ranks 1..world-1 as worker processes, join the groups."""
        if dist.is_initialized():
            from ..engine.config import EngineConfigError

            raise EngineConfigError("torch.distributed is already initialised in this process (is another"
                                    " multi-device LLM still running? call its shutdown() first)")
        heartbeat_timeout()  # a bad value is refused before any rank starts
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=startup_timeout_s))
        addr = ("127.0.0.1", store.port)
        env = worker_env()
        procs = []
        for r in range(1, world_size):
            cmd = [sys.executable, "-m", "dsv4.parallel.worker", "--rank", str(r), "--world-size", str(world_size),
                   "--store", f"{addr[0]}:{addr[1]}", "--device", device, "--parent", str(os.getpid())]
            procs.append(subprocess.Popen(cmd, env=env))
        group = cls(0, world_size, device, addr, procs)
        group._store = store
        if group.backend == "gloo":  # CPU ranks share the cores: give the driver its share too (restored later)
            group._saved_threads = torch.get_num_threads()
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        try:
            group._wait_alive(store, startup_timeout_s)
            group._join(store)
        except BaseException as e:
            raise group.fail(e) from e
        group._start_driver_monitor()
        log.info("started %d ranks (%s), store %s:%d", world_size, group.backend, *addr)
        return group

    def _wait_alive(self, store, timeout_s: float) -> None:
        """Fail fast if a worker dies before joining (init_process_group would wait for the whole timeout)."""
        keys = [f"dsv4/alive/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + timeout_s
        while not store.check(keys):
            for r, p in enumerate(self.procs, start=1):
                if p.poll() is not None:
                    raise RuntimeError(f"rank {r} exited during start-up with code {p.returncode}")
            if store.check([ABORT_KEY]):
                raise RuntimeError("a rank failed during start-up")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not start within {timeout_s:.0f} s")
            time.sleep(_POLL_S)

    @classmethod
    def join_as_worker(cls, rank: int, world_size: int, store_addr: tuple[str, int], device: str,
                       parent_pid: int | None) -> "RankGroup":
        store = dist.TCPStore(store_addr[0], store_addr[1], world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=120))
        group = cls(rank, world_size, device, store_addr)
        group._store = store
        group.parent_pid = parent_pid
        group._start_worker_monitor(parent_pid)
        store.set(f"dsv4/alive/{rank}", "1")
        group._join(store)
        return group

    @classmethod
    def from_torchrun(cls, world_size: int, device: str) -> "RankGroup":
        """Every rank was started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)."""
        rank = int(os.environ["RANK"])
        addr = (os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")))
        if int(os.environ["WORLD_SIZE"]) != world_size:
            from ..engine.config import EngineConfigError

            raise EngineConfigError(f"torchrun started {os.environ['WORLD_SIZE']} processes but the settings ask"
                                    f" for {world_size} ranks (max(tp, ep)); start torchrun with"
                                    f" --nproc-per-node {world_size}")
        group = cls(rank, world_size, device, addr)
        group._join(None)  # env:// (whoever hosts the store, it exists once this returns)
        group._store = dist.TCPStore(addr[0], addr[1], world_size, is_master=False,
                                     timeout=datetime.timedelta(seconds=120))
        if rank != 0:
            group._start_worker_monitor(None)
        else:
            group._start_driver_monitor()
        return group

    def _join(self, store) -> None:
        if self.backend == "nccl":
            torch.cuda.set_device(torch.device(self.device_of_rank()))
        if dist.is_initialized():  # torchrun, and the script initialised the default group itself: use it
            if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
                raise RuntimeError(f"the default process group is rank {dist.get_rank()} of"
                                   f" {dist.get_world_size()}, the settings ask for {self.world_size} ranks")
            self._owns_default = False
        else:
            kw = {"store": store} if store is not None else {"init_method": "env://"}
            dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size,
                                    timeout=data_timeout(), **kw)
        self.control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)

    def device_of_rank(self) -> str:
        if str(self.device).startswith("cuda") and "LOCAL_RANK" in os.environ:
            return f"cuda:{int(os.environ['LOCAL_RANK'])}"
        return rank_device(self.device, self.rank)

    # ---- messages (control group) -------------------------------------------------------------------------
    def send(self, msg) -> None:
        """Driver: one message to every rank."""
        box = [msg]
        dist.broadcast_object_list(box, src=0, group=self.control)

    def recv(self):
        """Worker: the driver's next message (waits as long as the driver is idle)."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank contributes ``obj``; the driver gets the list in rank order, workers get None."""
        out = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    # ---- failure --------------------------------------------------------------------------------------------
    def _abort_message(self) -> str | None:
        try:
            if self._store.check([ABORT_KEY]):
                return self._store.get(ABORT_KEY).decode()
        except Exception:
            return None
        return None

    def report(self, e: BaseException) -> tuple[int, str]:
        """Record this rank's failure unless another rank failed first; returns the first (rank, message)."""
        own = describe_exception(e)
        if _is_comm_error(e):  # most likely a symptom: give the rank that failed first time to say so
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline and self._abort_message() is None:
                if self._record_dead_rank():  # killed without a word: the driver sees its process end
                    break
                time.sleep(_POLL_S)
        try:
            first = self._store.compare_set(ABORT_KEY, "", f"{self.rank}\n{own}").decode()
        except Exception:
            first = self._abort_message() or f"{self.rank}\n{own}"
        rank, _, msg = first.partition("\n")
        return int(rank), msg

    def _start_worker_monitor(self, parent_pid: int | None) -> None:
        """This worker's watch thread, whatever the main thread is blocked in: every ``HEARTBEAT_EVERY_S`` it
        raises the rank's heartbeat counter in the store, and it exits the process as soon as any rank has
        failed, the driver's store is gone, or the driver died: a worker never outlives a failed group."""
        mon = dist.TCPStore(self.store_addr[0], self.store_addr[1], self.world_size, is_master=False,
                            timeout=datetime.timedelta(seconds=30))
        mon.set(PID_KEY.format(self.rank), f"{socket.gethostname()} {os.getpid()}")
        beat = HEARTBEAT_KEY.format(self.rank)

        def watch():
            next_beat = 0.0
            while True:
                if _driver_exited(parent_pid):  # checked first: the dead driver's store would fail loudly
                    self._leave(f"the driver (pid {parent_pid}) exited")
                if time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + HEARTBEAT_EVERY_S
                    try:
                        mon.add(beat, 1)
                        aborted = mon.check([ABORT_KEY])
                    except Exception as e:
                        if _driver_exited(parent_pid, wait_s=1.0):
                            self._leave(f"the driver (pid {parent_pid}) exited")
                        self._leave(f"lost the driver's store ({describe_exception(e).splitlines()[0]})")
                    if aborted and not self._exiting:  # another rank failed: the driver reports it
                        os._exit(1)
                time.sleep(_POLL_S)

        threading.Thread(target=watch, name="dsv4-rank-monitor", daemon=True).start()

    def _leave(self, why: str) -> NoReturn:
        """A worker whose driver went away: one line on stderr, exit 1 (nothing of its own to report)."""
        with _EXIT_LOCK:
            print(f"dsv4 rank {self.rank}: {why}; stopping", file=sys.stderr, flush=True)
            os._exit(1)

    def exit_worker(self, e: BaseException) -> NoReturn:
        """A worker's way out after ``e``: the driver gone, one line; another rank failed first, quietly (the
        driver names that rank); this rank's own failure, recorded for the driver, with its traceback."""
        self._exiting = True
        if _is_comm_error(e) and _driver_exited(self.parent_pid, wait_s=1.0):
            self._leave(f"the driver (pid {self.parent_pid}) exited")
        with _EXIT_LOCK:
            first = self.rank
            if self._store is not None:
                try:
                    first, _ = self.report(e)
                except Exception:
                    pass
            if first == self.rank:
                traceback.print_exception(type(e), e, e.__traceback__)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)

    def _record_dead_rank(self, store=None) -> bool:
        """Driver: if a worker's process has ended with an error code, record it as the group's first failure
        (unless one is recorded already); True when a dead rank was found."""
        died = [r for r, p in enumerate(self.procs, start=1) if p.poll() not in (None, 0)]
        if not died:
            return False
        p = self.procs[died[0] - 1]
        try:
            (store or self._store).compare_set(ABORT_KEY, "", f"{died[0]}\nthe rank's process exited with code"
                                               f" {p.returncode} (killed, or crashed outside Python; see its output)")
        except Exception:  # pragma: no cover - the store is going away with the group
            pass
        return True

    def _record_silent_rank(self, store, beats: dict, timeout: float) -> bool:
        """Driver: if a worker's heartbeat counter has not moved for ``timeout`` seconds (``beats``: rank ->
        (counter, when it last moved), kept by the caller), record it as the group's first failure and kill
        its process; True when one was found. Judged by when this thread saw the counter move, so a driver
        that was itself held up blames nobody."""
        now = time.monotonic()
        for r in range(1, self.world_size):
            n = store.add(HEARTBEAT_KEY.format(r), 0)
            last, since = beats.get(r, (None, now))
            if n != last:
                beats[r] = (n, now)
            elif now - since >= timeout:
                store.compare_set(ABORT_KEY, "", f"{r}\nstopped responding (no heartbeat for {now - since:.1f} s,"
                                  f" {HEARTBEAT_ENV}={timeout:g}): a stopped or hung process, now killed")
                self._kill_rank(r, store)
                return True
        return False

    def _kill_rank(self, r: int, store) -> None:
        """Kill rank ``r``'s process: a stopped process cannot exit by itself, and its end closes its sockets,
        so a gloo collective blocked on it fails at once. (A torchrun rank on another host cannot be killed
        from here: NCCL's groups are aborted; gloo waits for ``DSV4_DIST_TIMEOUT_S``.)"""
        if self.procs:
            self.procs[r - 1].kill()
            return
        host, pid = store.get(PID_KEY.format(r)).decode().split()
        if host == socket.gethostname():
            os.kill(int(pid), signal.SIGKILL)

    def _start_driver_monitor(self) -> None:
        """Watch the other ranks while the driver may be blocked in a collective: a rank that failed (the abort
        key), a worker process that ended without a word (OOM killer, a signal), a worker whose heartbeat
        stopped (killed, see ``_record_silent_rank``). A gloo collective fails by itself once the failed
        rank's sockets close; an NCCL one may not until its timeout, so the process groups are aborted (which
        makes the blocked call raise; ``fail`` then reports the first failure)."""
        mon = dist.TCPStore(self.store_addr[0], self.store_addr[1], self.world_size, is_master=False,
                            timeout=datetime.timedelta(seconds=30))
        timeout = heartbeat_timeout()
        beats: dict = {}

        def watch():
            while not self._stop.wait(_POLL_S):
                try:
                    aborted = mon.check([ABORT_KEY])
                    if self._stop.is_set():
                        return
                    aborted = (aborted or self._record_dead_rank(mon)
                               or (timeout is not None and self._record_silent_rank(mon, beats, timeout)))
                except Exception:
                    return
                if aborted:
                    if self.backend == "nccl":
                        try:
                            dist.distributed_c10d._abort_process_group()
                        except Exception:  # pragma: no cover - best effort on the way down
                            pass
                    return

        self._monitor = threading.Thread(target=watch, name="dsv4-driver-monitor", daemon=True)
        self._monitor.start()

    def _stop_monitor(self) -> None:
        """Join the driver's monitor (a daemon thread left inside a store call at interpreter exit aborts)."""
        self._stop.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=5.0)

    def fail(self, e: BaseException) -> RankError:
        """Driver: stop every rank after ``e`` and return the error to raise (the first failing rank's)."""
        with self._lock:
            if self.failed is not None:
                return self.failed
            self._stop.set()
            rank, msg = self.report(e)
            err = RankError(rank, msg)
            err.pids = [p.pid for p in self.procs]
            self._stop_workers(grace_s=3.0)
            self._stop_monitor()
            self._destroy()
            self.failed = err
            log.info("%s; all %d ranks stopped", err, self.world_size)  # the error raised says it
            return err

    def _stop_workers(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def on_destroy(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` before the process groups are destroyed (shutdown or failure). The driver releases
        its CUDA graphs here: NCCL keeps a communicator alive while any graph holding its captured
        collectives exists, so destroying (or aborting) the group first waits forever (seen on 2x H200)."""
        self._before_destroy.append(fn)

    def _destroy(self) -> None:
        for fn in self._before_destroy:
            try:
                fn()
            except Exception:  # pragma: no cover - best effort on the way down
                log.exception("releasing before the process groups are destroyed")
        self._before_destroy.clear()
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None
        try:
            if not self._owns_default:
                if self.control is not None:
                    dist.destroy_process_group(self.control)
            elif dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # pragma: no cover - tearing down after a failure
            pass

    def check_alive(self) -> None:
        if self.failed is not None:
            raise RankError(self.failed.rank, f"{self.failed.message} (the ranks stopped then; build a new LLM)")
        if self.closed:
            raise RuntimeError("this LLM's ranks were shut down (LLM.shutdown()); build a new LLM")

    def shutdown(self) -> None:
        """Driver: tell the workers to exit, wait for them, leave the groups."""
        with self._lock:
            if self.closed or self.failed is not None:
                return
            self.closed = True
            try:
                self.send(StopMsg())
            except Exception:
                pass
            self._stop_monitor()
            self._stop_workers(grace_s=10.0)
            self._destroy()
