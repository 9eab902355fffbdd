"""Test helpers for ``dsv4 serve``: starting a real server process on a free port, stopping it, and reading the
process table (the engine runs in a process of its own); what the server's answers are compared with."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dsv4 import SamplingParams
from dsv4.env import CHECK_CACHE

EOS = 1
needs_proc = pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads the process table from /proc")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(d, args: list[str]) -> tuple[subprocess.Popen, str, str]:
    """``dsv4 serve mini`` with these arguments on a free port (its output in ``d/server.log``)."""
    port = free_port()
    log_path = str(d / "server.log")
    env = dict(os.environ, **{CHECK_CACHE: "1"})  # the cache's integrity check after every step and when idle
    cmd = [sys.executable, "-m", "dsv4.cli", "serve", "mini", "--port", str(port), "--threads", "1"] + args
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, f"http://127.0.0.1:{port}", log_path


def wait_healthy(proc: subprocess.Popen, url: str, log_path: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"the server exited ({proc.returncode}):\n{open(log_path).read()}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            raise AssertionError(f"the server did not start:\n{open(log_path).read()}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, sig=signal.SIGTERM) -> int:
    proc.send_signal(sig)
    try:
        return proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError("the server did not stop within 20 s of its signal") from None


def engine_pids(url: str) -> tuple[int, int]:
    """(the engine's pid, the HTTP server's pid), from /metrics' ``dsv4:engine_info``."""
    return engine_pids_of(httpx.get(url + "/metrics", timeout=10).text)


def engine_pids_of(metrics_text: str) -> tuple[int, int]:
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == "dsv4:engine_info":
                return int(s.labels["pid"]), int(s.labels["server_pid"])
    raise AssertionError("/metrics has no dsv4:engine_info")


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not ended (a zombie waiting to be reaped has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


def parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def gone_within(pid: int, seconds: float) -> bool:
    deadline = time.time() + seconds
    while running(pid):
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


def greedy(llm, ids, max_tokens, **kw):
    return llm.generate([list(ids)], SamplingParams(max_tokens=max_tokens, **kw))[0].outputs[0]


def text_of(llm, ids: list[int]) -> str:
    """What the server returns for these output ids: the text without the EOS that ended it."""
    if ids and ids[-1] == EOS:
        ids = ids[:-1]
    return llm.tokenizer.decode(ids)
