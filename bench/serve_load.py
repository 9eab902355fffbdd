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

The client is httpx (asyncio), not the openai package. The server needs fastapi, starlette, pydantic,
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
import socket
import statistics
import subprocess
import sys
import tempfile
import time

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


async def _one(client: httpx.AsyncClient, url: str, model: str, ids: list[int], n_out: int, headers: dict):
    body = {"model": model, "prompt": ids, "max_tokens": n_out, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, n_tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                n_tokens = chunk["usage"]["completion_tokens"]
    return first - t0, time.perf_counter() - t0, n_tokens


async def load(url: str, model: str, prompts: list[list[int]], n_out: int, concurrency: int, api_key: str | None):
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def guarded(ids):
            async with sem:
                return await _one(client, url, model, ids, n_out, headers)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
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
    return summarize("LLM.generate", wall, ttft, e2e, [len(o.outputs[0].token_ids) for o in outs]), spec


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
    args = p.parse_args(argv)
    args.max_seq_len = args.max_seq_len or args.input_len + args.output_len
    warmup = args.concurrency if args.warmup is None else args.warmup

    from dsv4.bench.options import load_yaml, resolve
    from dsv4.model.loader import model_config
    from dsv4.builtin import resolve_model

    settings = resolve({"max_batch_size": args.concurrency, "max_num_tokens": args.max_num_tokens,
                        "max_seq_len": args.max_seq_len, "device": args.device, "dtype": args.dtype},
                       load_yaml(args.config) if args.config else {}, args.config)
    vocab = model_config(resolve_model(args.model)).vocab_size
    rng = random.Random(args.seed)
    # ids from 10 up: clear of the special tokens at the start of the vocabulary
    prompts = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    warm = [[rng.randrange(10, vocab) for _ in range(args.input_len)] for _ in range(warmup)]

    proc = None
    if args.url:
        url, name = args.url.rstrip("/"), None
    else:
        proc, url, log_path = start_server(args, args.config)
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        name = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        if warm:
            asyncio.run(load(url, name, warm, args.output_len, args.concurrency, args.api_key))
        wall, res = asyncio.run(load(url, name, prompts, args.output_len, args.concurrency, args.api_key))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    served = summarize("dsv4 serve (HTTP, streamed)", wall, [r[0] for r in res], [r[1] for r in res],
                       [r[2] for r in res])
    offline, spec = run_generate(args, settings, prompts, warm)

    rows = [served, offline]
    print(f"\n{args.num_requests} requests, {args.input_len} in / {args.output_len} out, concurrency"
          f" {args.concurrency}, {args.model} on {args.device}" + (f", {args.config}" if args.config else ""))
    print("| path | output tok/s | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | latency p50 / p99 (s) |")
    print("|---|---|---|---|---|")
    for r in rows:
        t, o, e = r["ttft_ms"], r["tpot_ms"], r["e2e_s"]
        print(f"| {r['path']} | {r['output_tok_s']:.1f} | {t[50]:.1f} / {t[90]:.1f} / {t[99]:.1f} |"
              f" {o[50]:.2f} / {o[90]:.2f} / {o[99]:.2f} | {e[50]:.2f} / {e[99]:.2f} |")
    ratio = served["output_tok_s"] / offline["output_tok_s"]
    print(f"\nserver / LLM.generate output tok/s: {ratio:.3f} (goal: >= 0.90)")
    if spec:
        print(f"MTP (generate): acceptance {spec['acceptance_rate']:.2f}, mean accepted length"
              f" {spec['mean_accepted_len']:.2f}")
    if args.report_json:
        with open(args.report_json, "w") as f:
            json.dump({"args": vars(args), "served": served, "generate": offline, "ratio": ratio, "mtp": spec}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
