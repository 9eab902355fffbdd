"""A rank that stops, a driver that dies, a rank killed during a benchmark (CPU, gloo, 2 ranks, ``tiny``).

Issue 18, item 6: a stopped rank is found by its missing heartbeat within ``DSV4_HEARTBEAT_TIMEOUT_S`` (not the
collective's 300 s timeout) and blamed; a killed driver takes its workers with it, each saying at most one line;
a benchmark whose rank dies keeps the report of what finished. (A killed or raising rank: test_multidevice.py.)
"""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.parallel.comm import RankError

from .bench_runs import at_bench_step, six_request_dataset

KW = dict(max_batch_size=4, max_num_tokens=48, max_seq_len=256, kv_cache_config={"max_tokens": 2048})
PROMPTS = [[1, 2, 3] * 20] * 4
SP = SamplingParams(max_tokens=32, ignore_eos=True)


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie may wait for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_gone(pids, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(_running(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_stopped_rank_is_found_by_its_heartbeat_and_blamed(monkeypatch):
    """SIGSTOP keeps rank 1's sockets open, so no collective fails: only the missing heartbeat shows it."""
    timeout = 3.0
    monkeypatch.setenv("DSV4_HEARTBEAT_TIMEOUT_S", str(timeout))
    llm = LLM("tiny", tensor_parallel_size=2, warmup=False, **KW)
    victim = llm._group.procs[0]
    stopped = {}

    def stop():
        stopped["at"] = time.monotonic()
        victim.send_signal(signal.SIGSTOP)

    threading.Timer(0.3, stop).start()
    with pytest.raises(RankError, match=r"rank 1 failed: stopped responding \(no heartbeat for") as ei:
        for _ in range(100):  # until the stop lands
            llm.generate(PROMPTS, SP)
    took = time.monotonic() - stopped["at"]
    assert ei.value.rank == 1 and timeout - 1.0 < took < timeout + 3.0, took
    assert _wait_gone(ei.value.pids, 5.0)
    e = llm.engine  # nothing of the failed call is left queued or holding the cache
    assert not e.requests and not e.has_unfinished_requests()
    assert e.cache.num_free_slots == e.cache.num_slots and e.cache.num_free_blocks == e.cache.num_blocks
    t0 = time.monotonic()
    with pytest.raises(RankError, match="rank 1 failed: stopped responding"):  # the LLM is dead, and says so at once
        llm.generate(PROMPTS[:1], SP)
    assert time.monotonic() - t0 < 1.0
    llm.shutdown()


DRIVER = """
import os
from dsv4 import LLM, SamplingParams
llm = LLM("tiny", tensor_parallel_size=2, warmup=False, max_batch_size=4, max_num_tokens=48, max_seq_len=256,
          kv_cache_config={"max_tokens": 2048})
print("PIDS", " ".join(str(p.pid) for p in llm._group.procs), flush=True)
while True:
    llm.generate([[1, 2, 3] * 20] * 4, SamplingParams(max_tokens=32, ignore_eos=True))
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_killed_driver_takes_its_workers_quietly(sig):
    """The driver dies mid-run without a word: every worker exits within seconds, saying one line at most
    (it used to print the store's C++ stack)."""
    p = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("PIDS"), line + p.stderr.read()
        workers = [int(w) for w in line.split()[1:]]
        time.sleep(0.5)  # into a step
        p.send_signal(sig)
        p.wait(timeout=10)
        assert _wait_gone(workers, 5.0), "a worker outlived its driver"
        err = p.stderr.read()
    finally:
        p.kill()
    assert err.splitlines() == [f"dsv4 rank 1: the driver (pid {p.pid}) exited; stopping"], err


STORE_CLIENT = """
import datetime, subprocess, sys
import torch.distributed as dist
host = subprocess.Popen([sys.executable, "-c", "import datetime, time, torch.distributed as d;"
                         " s = d.TCPStore('127.0.0.1', 0, 2, is_master=True, wait_for_workers=False,"
                         " timeout=datetime.timedelta(seconds=30)); print(s.port, flush=True); time.sleep(60)"],
                        stdout=subprocess.PIPE, text=True)
client = dist.TCPStore("127.0.0.1", int(host.stdout.readline()), 2, is_master=False,
                       timeout=datetime.timedelta(seconds=5))
client.add("beat", 1)
host.kill()
host.wait()
try:
    client.add("beat", 1)
except Exception as e:
    print(type(e).__name__)
"""


@pytest.mark.parametrize("quiet", [True, False], ids=["worker-env", "default-env"])
def test_a_worker_s_store_client_says_nothing_when_the_store_dies(quiet):
    """The race behind a killed driver's workers: the store's sockets close before the workers are
    re-parented, so a heartbeat can fail first. In a worker's environment the failure is only the exception the
    monitor handles; c10d's C++ warning (with its stack) is what the default environment prints."""
    import os

    from dsv4.parallel.comm import worker_env

    env = worker_env() if quiet else {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    r = subprocess.run([sys.executable, "-c", STORE_CLIENT], env=env, capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "DistNetworkError", r.stdout + r.stderr
    assert (r.stderr == "") == quiet, r.stderr


def test_a_bench_run_whose_rank_dies_keeps_the_finished_requests(tmp_path, monkeypatch, capsys):
    """SIGKILL of rank 1 during the timed run: the report covers the requests that finished before it, the
    failure is one error line naming rank 1, and the exit status is 3."""
    from dsv4.bench import cli

    ds = six_request_dataset(tmp_path)

    def kill_rank_1(engine):
        victim = engine.group.procs[0]
        victim.kill()
        victim.wait()

    at_bench_step(monkeypatch, 5, kill_rank_1)  # two requests at a time, two tokens each: some have finished
    report = tmp_path / "report.json"
    rc = cli.main(["--model", "tiny", "throughput", "--dataset", str(ds), "--tp", "2", "--concurrency", "2",
                   "--warmup", "0", "--no_progress", "--report_json", str(report)])
    out, err = capsys.readouterr()
    assert rc == cli.EXIT_RANK_FAILED == 3, err
    errors = [x for x in err.splitlines() if x.startswith("dsv4-bench: error:")]
    assert len(errors) == 1 and "rank 1 failed: the rank's process exited with code -9" in errors[0], err
    assert "Traceback" not in err
    finished = int(errors[0].split("covers the ")[1].split()[0])
    assert 0 < finished < 6
    assert "(completed / failed):" in out and f"6 ({finished} / {6 - finished})" in out
    assert "the run stopped before it finished (rank 1 failed)" in out
    rep = json.loads(report.read_text())
    assert rep["requests"]["num_completed"] == finished and "rank 1 failed" in rep["requests"]["stopped_early"]
    assert sum(r["error"] is None for r in rep["per_request"]) == finished
