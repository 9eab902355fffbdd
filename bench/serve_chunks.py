"""The serving path's chunk rate without a model, on the CPU: the real HTTP side (``build_app``, ``EngineClient``,
``Job``, the SSE stream, uvicorn) and the real engine loop (``loop.py``, in a process of its own, over its pipe)
around a fake engine that gives every running request ``--tokens_per_step`` tokens per step, each step taking
``--interval_ms``. The load client is ``serve_load.py``'s, in ``--clients`` processes. Reported: tokens/s and
chunks/s (what every client received), steps/s (the engine loop's), and each process's CPU seconds per chunk
(server = the HTTP process, engine = the engine loop's process, client = all client processes): a process
near one CPU-second per wall-second is the one that caps the rate.

    python bench/serve_chunks.py --interval_ms 2.5 --concurrency 32 --clients 1
    python bench/serve_chunks.py --interval_ms 2.5 --concurrency 32 --clients 2 --profile server
    python bench/serve_chunks.py --mode pipe --interval_ms 0     # the engine loop + pipe + reader alone

``--mode pipe``: no HTTP; the loop's Step messages are read by an ``EngineClient`` in this process and the
events drained, so steps/s is what the loop, the pipe and the reader allow. ``--mode client``: no server code;
a bare asyncio server writes pre-built SSE chunks as fast as the client reads, so chunks/s is the client's own
ceiling. ``--profile server|engine|client`` runs py-spy (``pip install py-spy``) on that process during the
timed load and prints its top functions (``--profile_out`` keeps the raw py-spy output).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import httpx  # noqa: E402

import serve_load  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


# ---- the fake engine (in the engine process, run by the real EngineLoop) -----------------------------
@dataclass(frozen=True)
class FakeSpec:
    model_path: str  # the tokenizer's checkpoint
    interval_s: float
    max_batch_size: int
    tokens_per_step: int
    tokens: tuple[int, ...]  # what the requests generate, cycled
    max_seq_len: int = 4096
    prefill_s: float = 0.0  # a step that admits a request takes this long (0: interval_s) (the real one runs eagerly)
    batch_wait_steps: int = 0  # the loop's (dsv4 serve --batch_wait_steps)


@dataclass(eq=False)
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival_time: float
    out: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class _NoCache:
    def check_integrity(self) -> None:
        pass


class FakeEngine:
    """What EngineLoop reads of an LLMEngine; each step sleeps out its interval and gives every running request
    its next tokens, as RequestOutputs built the way LLMEngine._output builds them (lists copied)."""

    def __init__(self, spec: FakeSpec):
        self.spec = spec
        self.requests: dict[str, _Req] = {}
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self.cache = _NoCache()
        self.cfg = SimpleNamespace(max_batch_size=spec.max_batch_size)  # (the loop's batch wait reads it)
        self.num_steps = 0
        self.last_step: dict = {}  # (what loop.StepKinds reads: a new request's first step counts its prompt)
        self.timing = {"outside": 0.0, "overshoot": 0.0, "work": 0.0, "n": 0}  # seconds, summed over steps
        self._left_at = None

    def add_request(self, prompt_ids, params, request_id=None):
        r = _Req(request_id, list(prompt_ids), params.max_tokens, time.perf_counter())
        self.requests[request_id] = r
        self._waiting.append(r)
        return request_id

    def abort_request(self, request_id):
        r = self.requests.pop(request_id, None)
        if r is not None and not r.finished:
            r.finish_reason = "abort"
            if r in self._running:
                self._running.remove(r)
            elif r in self._waiting:
                self._waiting.remove(r)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self):
        from dsv4.engine.outputs import CompletionOutput, RequestOutput

        t0 = time.perf_counter()
        end = t0 + self.spec.interval_s
        if self._left_at is not None and self._running:
            self.timing["outside"] += t0 - self._left_at
            self.timing["n"] += 1
        tokens = len(self._running)
        while self._waiting and len(self._running) < self.spec.max_batch_size:
            r = self._waiting.popleft()
            r.first_scheduled_time = t0
            self._running.append(r)
            tokens += len(r.prompt)
            if self.spec.prefill_s:
                end = t0 + self.spec.prefill_s
        toks, k = self.spec.tokens, self.spec.tokens_per_step
        outs = []
        for r in self._running:
            n = len(r.out)
            r.out.extend(toks[(n + i) % len(toks)] for i in range(min(k, r.max_tokens - n)))
            if r.first_token_time is None:
                r.first_token_time = t0
            if len(r.out) >= r.max_tokens:
                r.finish_reason = "length"
            outs.append(RequestOutput(request_id=r.rid, prompt_token_ids=list(r.prompt), prompt=None,
                                      outputs=[CompletionOutput(0, list(r.out), None, r.finish_reason, None)],
                                      finished=r.finished,
                                      metrics={"arrival_time": r.arrival_time,
                                               "first_scheduled_time": r.first_scheduled_time,
                                               "first_token_time": r.first_token_time, "finish_time": None,
                                               "num_preemptions": 0}))
        self.last_step = {"step": self.num_steps + 1, "num_seqs": len(self._running), "num_tokens": tokens}
        self._running = [r for r in self._running if not r.finished]
        self.num_steps += 1
        t1 = time.perf_counter()
        self.timing["work"] += t1 - t0
        if end > t1:
            time.sleep(end - t1)
        self._left_at = time.perf_counter()
        self.timing["overshoot"] += max(0.0, self._left_at - end)
        return outs

    def get_stats(self) -> dict:
        return {"num_steps": self.num_steps, "num_preemptions": 0, "speculative": None,
                "num_running": len(self._running), "num_waiting": len(self._waiting),
                "kv_cache_usage": {"num_blocks": 1024, "used_blocks": 0, "num_slots": self.spec.max_batch_size,
                                   "used_slots": len(self._running)}}


def fake_engine_main(spec: FakeSpec, conn) -> None:
    """The engine process's main (EngineProcess(spec, main=fake_engine_main)): the real loop, a fake engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from dsv4.serve.loop import EngineLoop
    from dsv4.serve.messages import EngineInfo, Ready

    conn.send(Ready(EngineInfo(spec.max_seq_len, 1 << 20, 1, os.getpid())))
    engine = FakeEngine(spec)
    try:
        EngineLoop(engine, conn, spec.batch_wait_steps).run()
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass
    finally:
        conn.close()
        t = engine.timing
        if t["n"]:
            print(f"  fake engine, per step: work {1e6 * t['work'] / t['n']:.0f} us, sleep overshoot"
                  f" {1e6 * t['overshoot'] / t['n']:.0f} us, loop outside step() {1e6 * t['outside'] / t['n']:.0f}"
                  f" us ({t['n']} steps)", file=sys.stderr)


def fake_spec(args) -> FakeSpec:
    """Tokens of real text (the held-out prompts of mini), so detokenizing costs what it costs."""
    from dsv4.builtin import heldout_prompts, resolve_model
    from dsv4.checkpoint.tokenizer import load_tokenizer

    path = resolve_model("mini")
    tok = load_tokenizer(path)
    ids = [t for p in heldout_prompts("mini")[:20] for t in tok.encode(p, add_special_tokens=False).ids]
    return FakeSpec(path, args.interval_ms / 1e3, args.concurrency, args.tokens_per_step, tuple(ids),
                    prefill_s=getattr(args, "prefill_ms", 0.0) / 1e3,
                    batch_wait_steps=getattr(args, "batch_wait_steps", 0))


# ---- processes ------------------------------------------------------------------------------------------
def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def server_main(spec: FakeSpec, port: int, cprofile: str | None = None, stall_ms: float = 0.0,
                freeze: bool = True) -> None:
    """The HTTP process, as ``dsv4 serve`` runs it (the startup heap frozen unless ``freeze`` is off), around the
    fake engine's process."""
    import uvicorn

    from dsv4.serve.app import build_app
    from dsv4.serve.host import EngineProcess, freeze_heap

    host = EngineProcess(spec, main=fake_engine_main)
    if stall_ms:
        watch_stalls(stall_ms / 1e3)
    app = build_app(host, "mini")
    if freeze:
        freeze_heap()

    def leave(signum, frame):  # (uvicorn re-raises the SIGTERM it stopped on, with this handler back)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, leave)
    if cprofile:
        import cProfile

        prof = cProfile.Profile()
        try:
            prof.runcall(uvicorn.run, app, host="127.0.0.1", port=port, log_level="warning")
        finally:
            prof.dump_stats(cprofile)
    else:
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def watch_stalls(limit_s: float) -> None:
    """Print the event loop thread's stack whenever its loop has not run a 2 ms heartbeat for ``limit_s`` (once
    per stall, and how long it lasted). Call before the loop starts: the heartbeat starts with EngineClient.start."""
    import threading
    import traceback

    from dsv4.serve.client import EngineClient

    beat = {"t": None, "thread": None}
    start = EngineClient.start

    def start_and_beat(self):
        start(self)
        loop = asyncio.get_running_loop()
        beat["thread"] = threading.get_ident()

        def tick():
            beat["t"] = time.perf_counter()
            loop.call_later(0.002, tick)

        tick()

    EngineClient.start = start_and_beat

    def watch():
        seen, stack = None, None
        while True:
            time.sleep(0.002)
            t = beat["t"]
            if t is None:
                continue
            late = time.perf_counter() - t
            if late > limit_s and t != seen:
                seen = t
                frame = sys._current_frames().get(beat["thread"])
                stack = "".join(traceback.format_stack(frame)[-14:]) if frame is not None else "?"
            elif stack is not None and t != seen:
                print(f"STALL: the event loop stopped for {1e3 * (t - seen):.0f} ms; {1e3 * limit_s:.0f} ms in, it"
                      f" was in:\n{stack}", file=sys.stderr)
                stack = None

    threading.Thread(target=watch, name="stall-watch", daemon=True).start()


def client_main(url: str, prompts, n_out: int, concurrency: int, start_at: float, q) -> None:
    """One client process: wait for the common start, run its share, send back results and CPU seconds."""
    time.sleep(max(0.0, start_at - time.time()))
    c0 = time.process_time()
    wall, res = asyncio.run(serve_load.load(url, "mini", prompts, n_out, concurrency, None))
    q.put((wall, res, time.process_time() - c0))


def run_clients(url: str, prompts, n_out: int, concurrency: int, clients: int, profile_client=None):
    """The load in ``clients`` processes (concurrency and prompts split among them); returns (wall, results,
    CPU seconds of all clients)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 1.5  # (spawned interpreters start meanwhile)
    procs = []
    for i in range(clients):
        share = prompts[i::clients]
        conc = concurrency // clients + (1 if i < concurrency % clients else 0)
        p = ctx.Process(target=client_main, args=(url, share, n_out, conc, start_at, q))
        p.start()
        procs.append(p)
    prof = profile_client(procs[0].pid) if profile_client else None
    got = [q.get() for _ in procs]
    for p in procs:
        p.join()
    if prof is not None:
        prof()
    results = [r for _, res, _ in got for r in res]
    return max(w for w, _, _ in got), results, sum(c for _, _, c in got)


def py_spy(pid: int, out_path: str, rate: int = 200):
    """Start py-spy on ``pid`` (raw collapsed stacks); returns a function that stops it and prints the top."""
    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    proc = subprocess.Popen([exe if os.path.exists(exe) else "py-spy", "record", "--pid", str(pid), "--format", "raw",
                             "--rate", str(rate),
                             "--output", out_path, "--nonblocking"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    time.sleep(0.5)

    def finish():
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        print_top(out_path)

    return finish


def print_top(path: str, n: int = 25) -> None:
    """Self and inclusive samples per function from py-spy's raw (collapsed) stacks."""
    own, incl, total = {}, {}, 0
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not stack:
                continue
            c = int(count)
            total += c
            frames = [fr.split(" (")[0] + " (" + fr.split(" (")[-1].split(":")[0].rsplit("/", 1)[-1]
                      for fr in stack.split(";")]
            own[frames[-1]] = own.get(frames[-1], 0) + c
            for fr in set(frames):
                incl[fr] = incl.get(fr, 0) + c
    if not total:
        print("(no samples)")
        return
    print(f"py-spy: {total} samples; self / inclusive %:")
    for fr, c in sorted(own.items(), key=lambda kv: -kv[1])[:n]:
        print(f"  self {100 * c / total:5.1f}%  incl {100 * incl[fr] / total:5.1f}%  {fr}")
    print("  inclusive only:")
    for fr, c in sorted(incl.items(), key=lambda kv: -kv[1])[:n]:
        print(f"  incl {100 * c / total:5.1f}%  {fr}")


# ---- --mode client: a bare SSE server ---------------------------------------------------------------
async def bare_sse_server(port: int, n_out: int) -> None:
    """Answers any POST with ``n_out`` one-token completion chunks, a usage chunk and [DONE] (chunked)."""
    chunk = {"id": "cmpl-x" * 6, "object": "text_completion", "created": 0, "model": "mini",
             "choices": [{"index": 0, "text": " tok", "logprobs": None, "finish_reason": None}], "usage": None}
    one = ("data: " + json.dumps(chunk) + "\n\n").encode()
    last = dict(chunk, choices=[], usage={"prompt_tokens": 1, "completion_tokens": n_out, "total_tokens": n_out})
    tail = ("data: " + json.dumps(last) + "\n\ndata: [DONE]\n\n").encode()

    def framed(b: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(b), b)

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                             b"transfer-encoding: chunked\r\n\r\n")
                for _ in range(n_out):
                    writer.write(framed(one))
                    await writer.drain()
                    await asyncio.sleep(0)
                writer.write(framed(tail) + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def bare_main(port: int, n_out: int) -> None:
    asyncio.run(bare_sse_server(port, n_out))


# ---- --mode pipe ---------------------------------------------------------------------------------------
def run_pipe(args, spec: FakeSpec) -> None:
    from dsv4.engine.sampling_params import SamplingParams
    from dsv4.serve.client import EngineClient, Sink
    from dsv4.serve.host import EngineProcess
    from dsv4.serve.messages import step_stats, step_updates

    host = EngineProcess(spec, main=fake_engine_main)
    client = EngineClient(host)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    counts = {"events": 0, "tokens": 0, "steps": 0, "batch": 0}
    on_step = client._on_step

    def counting(msg):  # the batch the engine ran: its running requests after each step
        counts["steps"] += msg.steps
        counts["batch"] += step_stats(msg).num_running + sum(u.finish_reason is not None for u in step_updates(msg))
        on_step(msg)

    client._on_step = counting

    async def one(i: int):
        q = asyncio.Queue()
        client.submit(f"r{i}", list(range(10, 10 + args.input_len)), sp, Sink(q, 0))
        while True:
            ev = await q.get()
            counts["events"] += 1
            counts["tokens"] += len(ev.update.token_ids)
            if ev.update.finish_reason is not None:
                return

    async def main():
        client.start()
        sem = asyncio.Semaphore(args.concurrency)

        async def guarded(i):
            async with sem:
                await one(i)

        c_http, c_eng = cpu_s(os.getpid()), cpu_s(host.process.pid)
        t0 = time.perf_counter()
        await asyncio.gather(*(guarded(i) for i in range(args.num_requests)))
        wall = time.perf_counter() - t0
        c_http, c_eng = cpu_s(os.getpid()) - c_http, cpu_s(host.process.pid) - c_eng
        client.stop()
        return wall, c_http, c_eng

    wall, c_http, c_eng = asyncio.run(main())
    steps = counts["steps"]
    print(f"mean batch {counts['batch'] / max(steps, 1):.1f}")
    print(f"pipe: {args.num_requests} requests x {args.output_len} tokens, c={args.concurrency}, interval"
          f" {args.interval_ms} ms: {wall:.2f} s, {counts['tokens'] / wall:.0f} tok/s, {counts['events'] / wall:.0f}"
          f" events/s, {steps / wall:.0f} steps/s (ideal {1e3 / args.interval_ms if args.interval_ms else 'inf'});"
          f" CPU s/s: reader {c_http / wall:.2f}, engine loop {c_eng / wall:.2f}; engine CPU per step"
          f" {1e6 * c_eng / steps:.0f} us")


# ---- main ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("server", "pipe", "client"), default="server")
    p.add_argument("--interval_ms", type=float, default=2.5)
    p.add_argument("--tokens_per_step", type=int, default=1)
    p.add_argument("--prefill_ms", type=float, default=0.0, help="a step that admits requests takes this long")
    p.add_argument("--batch_wait_steps", type=int, default=0, help="the engine loop's (dsv4 serve's flag)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--num_requests", type=int, default=256)
    p.add_argument("--input_len", type=int, default=128)
    p.add_argument("--output_len", type=int, default=128)
    p.add_argument("--clients", type=int, default=1)
    p.add_argument("--warmup", type=int, default=None, help="untimed requests first (default: concurrency)")
    p.add_argument("--profile", choices=("server", "engine", "client"), default=None)
    p.add_argument("--profile_out", default=None)
    p.add_argument("--cprofile", default=None, help="run the server process under cProfile, its stats to this file")
    p.add_argument("--stall_ms", type=float, default=0.0,
                   help="print the HTTP process's stack when its event loop stops for longer than this")
    p.add_argument("--no_freeze", action="store_true", help="leave the HTTP process's startup heap to the collector")
    args = p.parse_args(argv)
    spec = fake_spec(args)
    if args.mode == "pipe":
        run_pipe(args, spec)
        return 0
    port = serve_load._free_port()
    ctx = mp.get_context("spawn")
    if args.mode == "server":
        srv = ctx.Process(target=server_main, args=(spec, port, args.cprofile, args.stall_ms, not args.no_freeze))
    else:
        srv = ctx.Process(target=bare_main, args=(port, args.output_len), daemon=True)
    srv.start()
    url = f"http://127.0.0.1:{port}"
    engine_pid = None
    deadline = time.time() + 60
    while True:
        try:
            if args.mode == "client":
                socket_ok = __import__("socket").create_connection(("127.0.0.1", port), timeout=1)
                socket_ok.close()
                break
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except (httpx.HTTPError, OSError):
            pass
        if time.time() > deadline or not srv.is_alive():
            sys.exit("the server did not start")
        time.sleep(0.2)
    pids = {"server": srv.pid}
    if args.mode == "server":
        m = re.search(r'dsv4:engine_info\{[^}]*\bpid="(\d+)"', httpx.get(url + "/metrics", timeout=10).text)
        pids["engine"] = int(m.group(1))
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    warm = args.concurrency if args.warmup is None else args.warmup
    if warm:
        run_clients(url, prompts[:warm], args.output_len, args.concurrency, args.clients)
    prof = None
    if args.profile in ("server", "engine"):
        out = args.profile_out or tempfile.mktemp(prefix=f"serve_chunks_{args.profile}_", suffix=".txt")
        prof = (args.profile, pids[args.profile], out)
    cpu0 = {k: cpu_s(v) for k, v in pids.items()}
    stop_prof = py_spy(prof[1], prof[2]) if prof else None
    client_prof = None
    if args.profile == "client":
        out = args.profile_out or tempfile.mktemp(prefix="serve_chunks_client_", suffix=".txt")
        client_prof = lambda pid: py_spy(pid, out)  # noqa: E731
    wall, res, c_client = run_clients(url, prompts, args.output_len, args.concurrency, args.clients, client_prof)
    cpu = {k: cpu_s(v) - cpu0[k] for k, v in pids.items()}
    metrics_text = httpx.get(url + "/metrics", timeout=10).text if args.mode == "server" else ""
    if stop_prof:
        stop_prof()
    srv.terminate()
    srv.join(10)
    tokens = sum(r[2] for r in res)
    chunks = sum(r[3] for r in res)
    steps = tokens / args.tokens_per_step / args.concurrency
    s = serve_load.summarize("serve", wall, [r[0] for r in res], [r[1] for r in res], [r[2] for r in res])
    print(f"{args.mode}: {args.num_requests} requests x {args.output_len} tokens, c={args.concurrency},"
          f" {args.clients} client process(es), interval {args.interval_ms} ms x {args.tokens_per_step} tok:"
          f" {wall:.2f} s; {tokens / wall:.0f} tok/s, {chunks / wall:.0f} chunks/s ({tokens / max(chunks, 1):.2f}"
          f" tok/chunk); ideal {1e3 * args.concurrency * args.tokens_per_step / args.interval_ms:.0f} tok/s"
          if args.interval_ms else "")
    print(f"  TTFT p50/p90/p99 {s['ttft_ms'][50]:.1f}/{s['ttft_ms'][90]:.1f}/{s['ttft_ms'][99]:.1f} ms,"
          f" TPOT {s['tpot_ms'][50]:.2f}/{s['tpot_ms'][90]:.2f}/{s['tpot_ms'][99]:.2f} ms")
    parts = [f"{k} {v / wall:.2f} CPU-s/s, {1e6 * v / max(chunks, 1):.0f} us/chunk" for k, v in cpu.items()]
    parts.append(f"client(s) {c_client / wall:.2f} CPU-s/s, {1e6 * c_client / max(chunks, 1):.0f} us/chunk")
    print("  " + "; ".join(parts))
    if metrics_text:
        print("  server side (since start, warmup included): " + server_side(metrics_text))
        kinds = {}
        for line in metrics_text.splitlines():
            m = re.match(r'dsv4:engine_step_seconds_count\{.*kind="(\w+)".*\} (\S+)', line)
            if m:
                kinds[m.group(1)] = int(float(m.group(2)))
        print(f"  engine steps by kind (warmup included): {kinds}")
    return 0


def server_side(text: str) -> str:
    """Mean TTFT and queue time as the server measured them (from arrival at the handler)."""
    from prometheus_client.parser import text_string_to_metric_families

    v = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            v[smp.name] = v.get(smp.name, 0.0) + smp.value
    out = []
    for name, what in (("dsv4:time_to_first_token_seconds", "TTFT"), ("dsv4:request_queue_time_seconds", "queue"),
                       ("dsv4:time_per_output_token_seconds", "TPOT")):
        n = v.get(name + "_count", 0)
        if n:
            out.append(f"{what} mean {1e3 * v[name + '_sum'] / n:.1f} ms")
    return ", ".join(out)


if __name__ == "__main__":
    sys.exit(main())
