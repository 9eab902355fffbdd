"""Serving overhead: the same requests through ``dsv4 serve`` (HTTP, streamed) and through ``LLM.generate`` in
this process; output tok/s of each, their ratio, and TTFT / TPOT / latency percentiles.

Each request: ``--input_len`` random token ids (seeded), ``--output_len`` tokens generated (greedy, EOS
ignored), at most ``--concurrency`` in flight; the server and the engine both run with max_batch_size =
concurrency, so neither batches more than the other. The server is started as a subprocess (or ``--url``
names a running one), loaded with ``--num_requests`` streamed ``/v1/completions`` requests after
``--warmup`` untimed ones, and stopped; then the engine is built here with the same settings and times
``LLM.generate`` on the same token ids. TTFT / TPOT of generate come from the engine's own request times
(all its requests arrive at the call, so its TTFT includes waiting for a batch slot; the server's counts from
each request's send, once the client's concurrency limit lets it go).

    python bench/serve_load.py --model mini --device cuda --concurrency 32 --num_requests 256 \\
        --input_len 128 --output_len 128 --extra_llm_api_options examples/mtp.yml

On the CPU, small: ``--model mini --device cpu --num_requests 8 --concurrency 4 --input_len 16 --output_len 8``.

The load client is lean, so that it measures the server and not itself: ``--clients`` processes (default 2), each
with its share of the concurrency as keep-alive HTTP/1.1 connections on asyncio streams (no HTTP library), each
sending its next request when its last one ends; the SSE is split into events on the bytes and only the first and
last events (and any naming an error) are parsed. (httpx with json.loads on every chunk, one process, as this
script had it: 113 us of client CPU a chunk against a bare SSE server on a 2-core CPU, 250 us against dsv4 serve,
as much as the server's own work; its connection pool alone was a third of it. Now 10 and 70-100 us.)

Besides the table it prints what the timed load did: chunks and tokens per chunk (more than 1 when the HTTP
side lags and coalesces), CPU seconds per second of the HTTP process, the engine process and the clients (near
1.0: that process caps the rate), the engine's steps by kind on both paths (graph / eager / prefill /
readback: their count, share of the wall time and durations; the server's from /metrics), and the server log's
steps slower than 1 s.

The server needs fastapi, starlette, pydantic,
pydantic-core, uvicorn, annotated-types, annotated-doc, typing-inspection and opentelemetry-api; a GPU machine
without a package index gets them as wheels made elsewhere for its Python and platform, e.g.
``pip download --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 -d wheels fastapi uvicorn``
then ``pip install --no-deps wheels/*.whl`` there (prometheus-client, h11, anyio, click and httpx are usually
present already).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse

import httpx


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def summarize(name: str, wall_s: float, ttft: list[float], e2e: list[float], out_lens: list[int]) -> dict:
    tpot = [(e - t) / (n - 1) for t, e, n in zip(ttft, e2e, out_lens) if n > 1]
    return {"path": name, "requests": len(e2e), "wall_s": wall_s, "output_tok_s": sum(out_lens) / wall_s,
            "ttft_ms": {q: 1e3 * _pct(ttft, q) for q in (50, 90, 99)},
            "tpot_ms": {q: 1e3 * _pct(tpot, q) for q in (50, 90, 99)},
            "e2e_s": {q: _pct(e2e, q) for q in (50, 90, 99)}, "mean_ttft_ms": 1e3 * statistics.fmean(ttft)}


# ---- the server side ---------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, yaml_path: str | None) -> tuple[subprocess.Popen, str, str]:
    port = args.port or _free_port()
    log_path = os.path.join(tempfile.mkdtemp(prefix="dsv4_serve_load_"), "server.log")
    cmd = [sys.executable, "-m", "dsv4.cli", "serve", args.model, "--port", str(port), "--device", args.device,
           "--max_batch_size", str(args.concurrency), "--max_num_tokens", str(args.max_num_tokens),
           "--max_seq_len", str(args.max_seq_len)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if yaml_path:
        cmd += ["--extra_llm_api_options", yaml_path]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    cmd += shlex.split(args.server_args)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.start_timeout
    while True:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({proc.returncode}); its log:\n{open(log_path).read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url, log_path
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            proc.kill()
            sys.exit(f"the server did not start in {args.start_timeout} s; its log:\n{open(log_path).read()}")
        time.sleep(0.5)


class _Connection:
    """One keep-alive HTTP/1.1 connection of the load client, on asyncio streams (no HTTP library: httpx's
    connection pool alone cost the client more per request than the server spends, measured on a 2-core CPU)."""

    def __init__(self, url: str):
        u = urllib.parse.urlsplit(url)
        self.host, self.port = u.hostname, u.port or 80
        self.reader = self.writer = None

    async def post_stream(self, path: str, body: bytes, headers: dict):
        """POST ``body`` (JSON); yields the response body's pieces as they arrive (status != 200: raises)."""
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = [f"POST {path} HTTP/1.1", f"Host: {self.host}:{self.port}", "Content-Type: application/json",
                f"Content-Length: {len(body)}", "Accept: text/event-stream"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self.writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body)
        r = self.reader
        try:
            status_and_headers = (await r.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            status = int(status_and_headers[0].split()[1])
            fields = {k.strip().lower(): v.strip()
                      for k, _, v in (h.partition(":") for h in status_and_headers[1:] if h)}
            if fields.get("transfer-encoding", "").lower() == "chunked":
                whole = []
                while True:
                    size = int((await r.readuntil(b"\r\n")).split(b";")[0], 16)
                    if size == 0:
                        while await r.readuntil(b"\r\n") != b"\r\n":  # (trailers)
                            pass
                        break
                    data = (await r.readexactly(size + 2))[:-2]
                    if status == 200:
                        yield data
                    else:
                        whole.append(data)
                data = b"".join(whole)
            else:
                data = await r.readexactly(int(fields.get("content-length", 0)))
                if status == 200:
                    yield data
            if fields.get("connection", "").lower() == "close":
                self.close()
        except BaseException:
            self.close()  # (a stream left part read cannot carry the next request)
            raise
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {data.decode(errors='replace')[:300]}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


async def _one(conn: _Connection, model: str, ids: list[int], n_out: int, headers: dict):
    """One streamed request: (TTFT, latency, completion tokens, chunks with choices). The SSE is split into events
    on the bytes; only the first event, the last (the usage chunk) and any naming an error are parsed as JSON."""
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": n_out, "temperature": 0, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    t0 = time.perf_counter()
    first, last, n_events, buf = None, None, 0, b""
    async for data in conn.post_stream("/v1/completions", body, headers):
        *events, buf = (buf + data).split(b"\n\n")
        for ev in events:
            if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                continue
            if first is None or b'"error"' in ev:
                chunk = json.loads(ev[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                if first is None and chunk["choices"]:
                    first = time.perf_counter()
            n_events += 1
            last = ev
    if first is None or last is None:
        raise RuntimeError("the stream ended without a token")
    end = json.loads(last[6:])
    if end["choices"] or not end.get("usage"):
        raise RuntimeError("the stream's last chunk is not the usage chunk")
    return first - t0, time.perf_counter() - t0, end["usage"]["completion_tokens"], n_events - 1


async def load(url: str, model: str, prompts: list[list[int]], n_out: int, concurrency: int, api_key: str | None):
    """``prompts`` through ``concurrency`` connections, each sending its next request when its last one ends
    (results in the prompts' order); returns (wall seconds, results)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results: list = [None] * len(prompts)
    todo = iter(range(len(prompts)))

    async def worker():
        conn = _Connection(url)
        try:
            for i in todo:
                results[i] = await _one(conn, model, prompts[i], n_out, headers)
        finally:
            conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(prompts)))))
    return time.perf_counter() - t0, results


# ---- the engine side ---------------------------------------------------------------------------------
def run_generate(args, settings, prompts: list[list[int]], warm: list[list[int]]):
    import torch

    from dsv4 import LLM, SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, config=settings.config)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    if warm:
        llm.generate(warm, sp)
    steps = time_steps(llm.engine)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    ttft = [o.metrics["first_token_time"] - o.metrics["arrival_time"] for o in outs]
    e2e = [o.metrics["finish_time"] - o.metrics["arrival_time"] for o in outs]
    spec = llm.get_stats().get("speculative")
    llm.shutdown()
    return summarize("LLM.generate", wall, ttft, e2e, [len(o.outputs[0].token_ids) for o in outs]), spec, steps


def time_steps(engine) -> dict[str, list[float]]:
    """Wrap ``engine.step`` (this process's engine): each call's wall seconds, by what the step ran (the server's
    engine loop reports the same kinds, ``dsv4.serve.loop.StepKinds``)."""
    from dsv4.serve.loop import StepKinds

    kinds, step, times = StepKinds(engine), engine.step, {}

    def timed():
        t0 = time.perf_counter()
        out = step()
        times.setdefault(kinds(), []).append(time.perf_counter() - t0)
        return out

    engine.step = timed
    return times


# ---- what the run did: engine steps, CPU, chunks ----------------------------------------------------------
def metric_samples(url: str) -> dict:
    """The server's /metrics as {(name, labels tuple): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for smp in fam.samples:
            key = (smp.name, tuple(sorted((k, v) for k, v in smp.labels.items() if k != "model_name")))
            out[key] = out.get(key, 0.0) + smp.value
    return out


def server_steps(before: dict, after: dict) -> dict[str, dict]:
    """The engine's step-time histogram over the timed load (after - before), by kind: count, sum and the
    cumulative buckets (upper bound -> count)."""
    out = {}
    for (name, labels), v in after.items():
        if not name.startswith("dsv4:engine_step_seconds"):
            continue
        lab = dict(labels)
        d = out.setdefault(lab.get("kind", "?"), {"count": 0.0, "sum": 0.0, "buckets": {}})
        v -= before.get((name, labels), 0.0)
        if name.endswith("_count"):
            d["count"] = v
        elif name.endswith("_sum"):
            d["sum"] = v
        elif name.endswith("_bucket"):
            d["buckets"][float(lab["le"])] = v
    return {k: d for k, d in out.items() if d["count"] > 0}


def _bucket_pct(buckets: dict[float, float], count: float, q: float) -> float:
    """The upper bound of the histogram bucket holding the q-th percentile (an upper estimate)."""
    for le in sorted(buckets):
        if buckets[le] >= q / 100 * count:
            return le
    return float("inf")


def step_rows(wall: float, served: dict[str, dict], gen_wall: float, generated: dict[str, list[float]]) -> list[str]:
    rows = ["| path | step kind | steps | share of the wall time | mean (ms) | p50 / p90 / p99 (ms) |",
            "|---|---|---|---|---|---|"]
    for kind, d in sorted(served.items()):
        p = [1e3 * _bucket_pct(d["buckets"], d["count"], q) for q in (50, 90, 99)]
        rows.append(f"| dsv4 serve | {kind} | {d['count']:.0f} | {d['sum'] / wall:.2f} |"
                    f" {1e3 * d['sum'] / d['count']:.2f}"
                    f" | <= {p[0]:g} / {p[1]:g} / {p[2]:g} (bucket bounds) |")
    for kind, v in sorted(generated.items()):
        p = [1e3 * _pct(v, q) for q in (50, 90, 99)]
        rows.append(f"| LLM.generate | {kind} | {len(v)} | {sum(v) / gen_wall:.2f} |"
                    f" {1e3 * sum(v) / len(v):.2f} | {p[0]:.2f} / {p[1]:.2f} / {p[2]:.2f} |")
    return rows


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of a process of this machine (Linux), None when it cannot be read."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


# ---- several client processes ----------------------------------------------------------------------------
def _client_process(i, url, model, prompts, n_out, concurrency, api_key, start_at, q) -> None:
    time.sleep(max(0.0, start_at - time.time()))
    c0 = time.process_time()
    try:
        wall, res = asyncio.run(load(url, model, prompts, n_out, concurrency, api_key))
        q.put((i, wall, res, time.process_time() - c0, None))
    except Exception as e:
        q.put((i, 0.0, [], time.process_time() - c0, f"{type(e).__name__}: {e}"))


def run_load(url: str, model: str, prompts, n_out: int, concurrency: int, api_key, clients: int):
    """The load from ``clients`` processes (prompts and concurrency shared out, started together); returns
    (wall seconds, results in the prompts' order, the clients' CPU seconds)."""
    if clients <= 1:
        c0 = time.process_time()
        wall, res = asyncio.run(load(url, model, prompts, n_out, concurrency, api_key))
        return wall, res, time.process_time() - c0
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    start_at = time.time() + 2.0  # (the interpreters start meanwhile)
    shares = [list(range(i, len(prompts), clients)) for i in range(clients)]
    procs = [ctx.Process(target=_client_process, args=(i, url, model, [prompts[j] for j in share], n_out,
                                                       concurrency // clients + (i < concurrency % clients),
                                                       api_key, start_at, q), daemon=True)
             for i, share in enumerate(shares)]
    for pr in procs:
        pr.start()
    got = [q.get() for _ in procs]
    for pr in procs:
        pr.join()
    errors = [e for *_, e in got if e]
    if errors:
        raise RuntimeError(f"a load client failed: {errors[0]}")
    results: list = [None] * len(prompts)
    for i, _, res, _, _ in got:
        for j, r in zip(shares[i], res):
            results[j] = r
    return max(g[1] for g in got), results, sum(g[3] for g in got)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mini")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default=None)
    p.add_argument("--num_requests", type=int, default=256)
    p.add_argument("--warmup", type=int, default=None, help="untimed requests first (default: concurrency)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input_len", type=int, default=128)
    p.add_argument("--output_len", type=int, default=128)
    p.add_argument("--max_num_tokens", type=int, default=8192)
    p.add_argument("--max_seq_len", type=int, default=None, help="default: input_len + output_len")
    p.add_argument("--extra_llm_api_options", "--config", dest="config", default=None)
    p.add_argument("--url", default=None, help="a running server (its settings must match these)")
    p.add_argument("--api_key", default=None)
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start_timeout", type=float, default=900)
    p.add_argument("--report_json", default=None)
    p.add_argument("--clients", type=int, default=2, help="load client processes (concurrency shared out)")
    p.add_argument("--server_args", default="", help="more flags for dsv4 serve, e.g. '--batch_wait_steps 4'")
    p.add_argument("--no_generate", action="store_true", help="the server's part only (no LLM.generate row)")
    p.add_argument("--passes", type=int, default=1,
                   help="timed loads of the same requests on the same server (a second pass runs on whatever the"
                        " first compiled or captured for the first time)")
    args = p.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # (what was printed survives a timeout)
    args.max_seq_len = args.max_seq_len or args.input_len + args.output_len
    warmup = args.concurrency if args.warmup is None else args.warmup

    from dsv4.bench.options import load_yaml, resolve
    from dsv4.model.loader import model_config
    from dsv4.builtin import resolve_model

    from dsv4.serve.launch import serve_defaults

    # (generate runs with the server's settings, its defaults included: the same engine on both paths)
    settings = resolve({"max_batch_size": args.concurrency, "max_num_tokens": args.max_num_tokens,
                        "max_seq_len": args.max_seq_len, "device": args.device, "dtype": args.dtype},
                       load_yaml(args.config) if args.config else {}, args.config,
                       derived=serve_defaults(args.device))
    vocab = model_config(resolve_model(args.model)).vocab_size
    rng = random.Random(args.seed)
    # ids from 10 up: clear of the special tokens at the start of the vocabulary
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    warm = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(warmup)]

    proc, log_path = None, None
    if args.url:
        url, name = args.url.rstrip("/"), None
    else:
        proc, url, log_path = start_server(args, args.config)
    passes = []
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        name = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        if warm:
            run_load(url, name, warm, args.output_len, args.concurrency, args.api_key, args.clients)
        pids = {"HTTP process": proc.pid if proc is not None else None, "engine process": _engine_pid(url)}
        for _ in range(args.passes):
            passes.append(timed_pass(args, url, name, prompts, pids, log_path))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    for i, ps in enumerate(passes):
        res = ps["results"]
        ps["summary"] = summarize("dsv4 serve (HTTP, streamed)" + (f", pass {i + 1}" if args.passes > 1 else ""),
                                  ps["wall"], [r[0] for r in res], [r[1] for r in res], [r[2] for r in res])
    title = (f"\n{args.num_requests} requests, {args.input_len} in / {args.output_len} out, concurrency"
             f" {args.concurrency}, {args.model} on {args.device}" + (f", {args.config}" if args.config else ""))
    print(title)  # (the server's part first: it is there even if building generate's engine fails)
    print_table([ps["summary"] for ps in passes])
    for i, ps in enumerate(passes):
        wall, res = ps["wall"], ps["results"]
        tokens, chunks = sum(r[2] for r in res), sum(r[3] for r in res)
        usage = [f"{k} {v / wall:.2f}" for k, v in ps["cpu"].items() if v is not None]
        usage.append(f"load client ({args.clients} process{'es' if args.clients > 1 else ''})"
                     f" {ps['client_cpu'] / wall:.2f}")
        print(f"\nserver, timed load{f' (pass {i + 1})' if len(passes) > 1 else ''}: {chunks} chunks"
              f" ({chunks / wall:.0f}/s), {tokens / max(chunks, 1):.2f} tokens per chunk; CPU seconds per second: "
              + ", ".join(usage))
        print("\n".join(step_rows(wall, ps["steps"], 0.0, {})))
        print(f"steps slower than 1 s in the server's log during this pass: {len(ps['slow'])}")
        for line in ps["slow"][:10]:
            print("  " + line)
    if args.no_generate:
        if args.report_json:
            with open(args.report_json, "w") as f:
                json.dump({"args": vars(args), "passes": [{k: v for k, v in ps.items() if k != "results"}
                                                          for ps in passes]}, f, indent=1)
        return 0
    offline, spec, gen_steps = run_generate(args, settings, prompts, warm)
    print("\nLLM.generate's steps:")
    print("\n".join(step_rows(0.0, {}, offline["wall_s"], gen_steps)))
    print(title)
    print_table([ps["summary"] for ps in passes] + [offline])
    ratios = [ps["summary"]["output_tok_s"] / offline["output_tok_s"] for ps in passes]
    print("\nserver / LLM.generate output tok/s: " + ", ".join(f"{r:.3f}" for r in ratios)
          + (" (passes 1..)" if len(ratios) > 1 else "") + " (goal: >= 0.90)")
    if spec:
        print(f"MTP (generate): acceptance {spec['acceptance_rate']:.2f}, mean accepted length"
              f" {spec['mean_accepted_len']:.2f}")
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump({"args": vars(args), "generate": offline, "ratios": ratios, "mtp": spec,
                       "passes": [{k: v for k, v in ps.items() if k != "results"} for ps in passes],
                       "generate_steps": {k: len(v) for k, v in gen_steps.items()}}, f, indent=1)
    return 0


def print_table(rows: list[dict]) -> None:
    print("| path | output tok/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | latency p50 / p99 (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        t, o, e = r["ttft_ms"], r["tpot_ms"], r["e2e_s"]
        print(f"| {r['path']} | {r['output_tok_s']:.1f} | {t[50]:.1f} / {t[90]:.1f} / {t[99]:.1f} |"
              f" {o[50]:.2f} / {o[90]:.2f} / {o[99]:.2f} | {e[50]:.2f} / {e[99]:.2f} |")


def timed_pass(args, url: str, name: str, prompts, pids: dict, log_path: str | None) -> dict:
    """One timed load of ``prompts``: its results, wall time, the processes' CPU seconds, the engine's steps
    (from /metrics) and the slow-step lines the server logged meanwhile."""
    log_at = os.path.getsize(log_path) if log_path else 0
    before = metric_samples(url)
    cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
    wall, res, client_cpu = run_load(url, name, prompts, args.output_len, args.concurrency, args.api_key,
                                     args.clients)
    cpu = {k: (c - cpu0[k]) if (c := cpu_seconds(pids[k])) is not None and cpu0[k] is not None else None
           for k in pids}
    steps = server_steps(before, metric_samples(url))
    slow = []
    if log_path:
        with open(log_path, errors="replace") as f:
            f.seek(log_at)
            slow = [line.rstrip() for line in f if "took" in line and "engine step" in line]
    return {"results": res, "wall": wall, "cpu": cpu, "client_cpu": client_cpu, "steps": steps, "slow": slow}


def _engine_pid(url: str) -> int | None:
    for (name, labels), _ in metric_samples(url).items():
        if name == "dsv4:engine_info":
            return int(dict(labels)["pid"])
    return None


if __name__ == "__main__":
    sys.exit(main())
