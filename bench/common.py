"""Shared helpers of the benchmark scripts: timing on the GPU, a short table, an entry in BENCHMARKS.md."""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

import torch


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeat: int = 1):
    """Median wall time (s) of fn() with the device synchronised around each call; returns (median, last)."""
    times, out = [], None
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


LAUNCHES = 24  # back-to-back launches per sample of median_us


def median_us(fn, copies: int) -> float:
    """Median over 5 samples of the mean time (us, CUDA events) of LAUNCHES launches ``fn(i % copies)``: the
    host's launch cost is hidden, and cycling over ``copies`` copies of the weights keeps them out of L2."""
    fn(0)
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for i in range(LAUNCHES):
            fn(i % copies)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / LAUNCHES)
    return sorted(times)[len(times) // 2]


def graph_us(fn, copies: int) -> float:
    """GPU time (us) per call of ``fn(i % copies)``: LAUNCHES calls captured in one CUDA graph, its replay timed
    with CUDA events, median of 5. The host's launch cost (Python, Triton's launcher) is out of the figure, as
    it is inside the engine's graphs."""
    fn(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES):
            fn(i % copies)
    graph.replay()
    times = []
    for _ in range(5):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / LAUNCHES)
    return sorted(times)[len(times) // 2]


def event_ms(fn, repeat: int = 5) -> float:
    """Median GPU time (ms, CUDA events) of single calls of fn after one untimed call: for launches long enough
    (prefill sizes) that the host's launch cost does not matter."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (median of 10)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    t, _ = timed(lambda: b.copy_(a), repeat=10)
    return 2 * nbytes / t


def kernel_run(ap) -> tuple:
    """A kernel benchmark's start: ``ap``'s arguments with ``--append`` added, the copy bandwidth measured now, and
    the seeded CUDA generator its random inputs come from."""
    ap.add_argument("--append", default=None)
    return ap.parse_args(), copy_bandwidth(), torch.Generator(device="cuda").manual_seed(0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__})"
    return f"CPU (torch {torch.__version__})"


def table(headers: list[str], rows: list[list]) -> str:
    fmt = [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(r) + " |" for r in fmt]
    return "\n".join(lines)


def report(title: str, text: str, append: str | None, notes: str = ""):
    """Print the table and append a dated entry (hardware, exact command) to a markdown file."""
    print(text)
    if not append:
        return
    cmd = " ".join(["python"] + sys.argv)
    entry = (f"\n## {title}\n\n{datetime.date.today().isoformat()} · {hardware()}\n\n"
             f"    {cmd}\n\n{text}\n" + (f"\n{notes}\n" if notes else ""))
    os.makedirs(os.path.dirname(os.path.abspath(append)), exist_ok=True)
    with open(append, "a") as f:
        f.write(entry)


def keep_whole_span(keep_rows):
    """A ``DraftPause.keep_rows`` that keeps the MTP ring's whole span wherever ``keep_rows`` keeps any row: the
    keep-up rule before the thirty-third session, for A/B runs against the current one."""
    return lambda self, margin: margin if keep_rows(self, margin) > 0 else 0
