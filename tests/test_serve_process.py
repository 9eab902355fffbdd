"""``dsv4 serve``'s engine process: a killed server leaves no engine behind, a dead engine fails the open requests
and refuses new ones, and ``build_app(llm)`` serves an ``LLM`` built in the caller's process instead."""

from __future__ import annotations

import json
import os
import signal

import httpx

from dsv4 import LLM

from .serve_server import (engine_pids, engine_pids_of, gone_within, greedy, launch, needs_proc, stop,
                           text_of, wait_healthy)

SMALL = ["--max_batch_size", "4", "--max_num_tokens", "128", "--max_seq_len", "256"]


@needs_proc
def test_a_killed_server_leaves_no_engine_behind(tmp_path):
    """SIGKILL gives the server no chance to stop its engine: the engine sees its connection close and ends."""
    proc, url, log_path = launch(tmp_path, SMALL)
    try:
        wait_healthy(proc, url, log_path)
        engine, _ = engine_pids(url)
        r = httpx.post(url + "/v1/completions", json={"model": "mini", "prompt": "def f(x):", "max_tokens": 4},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        proc.kill()
        proc.wait(10)
        assert gone_within(engine, 10), f"the engine process {engine} outlived its killed server"
    finally:
        if proc.poll() is None:
            proc.kill()


@needs_proc
def test_a_dead_engine_fails_open_requests_and_refuses_new_ones(tmp_path):
    """The engine process killed mid-stream: the stream ends with an error event, /health says 503, a new
    request gets a 503 in OpenAI's error shape; SIGINT still stops the server cleanly."""
    proc, url, log_path = launch(tmp_path, SMALL)
    try:
        wait_healthy(proc, url, log_path)
        engine, _ = engine_pids(url)
        body = {"model": "mini", "prompt": "def f(x):", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert json.loads(next(line for line in lines if line.startswith("data: "))[6:])["choices"]
            os.kill(engine, signal.SIGKILL)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        err = json.loads(rest[-2][6:])["error"]
        assert err["type"] == "server_error" and "engine" in err["message"], err
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"
        r = httpx.post(url + "/v1/completions", json={"model": "mini", "prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert stop(proc, signal.SIGINT) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = open(log_path).read()
    assert "the engine process has ended" in log and "Traceback" not in log, log


def test_build_app_serves_an_llm_built_in_this_process():
    """``build_app(llm)``: the engine loop in a thread of this process (no engine process), same answers."""
    from fastapi.testclient import TestClient

    from dsv4.serve import build_app

    small = LLM("mini", max_batch_size=4, max_num_tokens=128, max_seq_len=256)
    ids = small.tokenizer.encode("def f(x):").ids
    want = text_of(small, greedy(small, ids, 6).token_ids)
    app = build_app(small, "mini")
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"model": "mini", "prompt": ids, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert engine_pids_of(c.get("/metrics").text) == (os.getpid(), os.getpid())
    assert c.app.state.dsv4.engine.error is not None  # stopped with the app
    assert not small.engine.has_unfinished_requests()
