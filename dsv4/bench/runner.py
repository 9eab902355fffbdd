"""The timed run: the dataset's requests through ``LLMEngine`` at a fixed concurrency.

At most ``concurrency`` requests are in flight (-1: all at once; the engine's scheduler still runs at most
``max_batch_size`` of them per step); a new one is added whenever one finishes. Every request asks for exactly
its ``output_tokens`` (``ignore_eos``). Times are ``time.perf_counter()`` taken here, where a caller sees them:
arrival just before ``add_request``, and each token's arrival when the ``step()`` that returns it returns
(so MTP's several tokens from one step share a time; with the overlap scheduler that is the call after the
one that launched its step). A request the engine refuses gets its error and the
others go on. ``--warmup`` requests run first through the same loop, untimed and unreported. Ctrl-C or a failed
rank (a multi-device run) stops the timed run: the requests that finished keep their results, the others get
an error saying why they did not finish.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO

from ..engine.engine import RequestError
from ..engine.sampling_params import SamplingParams
from ..kernels.compiles import COMPILES
from ..parallel.comm import RankError
from .dataset import DatasetRequest

log = logging.getLogger("dsv4.bench")

# a step loop with requests in flight that makes no progress this many times in a row is a stuck engine
_MAX_IDLE_STEPS = 1000


@dataclass
class RequestRecord:
    index: int  # position in the run
    task_id: object
    line: int
    input_len: int
    output_tokens: int  # asked for
    arrival: float | None = None
    first_token: float | None = None
    finish: float | None = None
    token_times: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens that arrived then)
    output_len: int = 0
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish is not None


@dataclass
class RunResult:
    records: list[RequestRecord]
    start: float
    end: float
    num_steps: int
    num_preemptions: int
    spec: dict | None  # draft acceptance over the timed run (None without MTP)
    num_warmup: int
    interrupted: bool = False  # SIGINT stopped the timed run: the records hold what finished before it
    rank_error: str | None = None  # a rank failed and stopped the timed run (its error); likewise
    compiles: list = field(default_factory=list)  # Triton kernels compiled during the timed run (Compile)


def _spec_counts(engine) -> dict:
    s, pause = engine.spec_stats, engine.pause
    return {"verify": s.num_verify_steps, "drafts": s.num_draft_tokens, "accepted": s.num_accepted_tokens,
            "proposed_per_pos": list(s.proposed_per_pos), "accepted_per_pos": list(s.accepted_per_pos),
            "pause": None if pause is None else pause.as_dict()}


def _spec_delta(before: dict, after: dict) -> dict:
    verify = after["verify"] - before["verify"]
    drafts = after["drafts"] - before["drafts"]
    accepted = after["accepted"] - before["accepted"]
    per_pos = []
    for j, (p, a) in enumerate(zip(after["proposed_per_pos"], after["accepted_per_pos"])):
        p0 = before["proposed_per_pos"][j] if j < len(before["proposed_per_pos"]) else 0
        a0 = before["accepted_per_pos"][j] if j < len(before["accepted_per_pos"]) else 0
        per_pos.append((a - a0) / (p - p0) if p > p0 else 0.0)
    pause = after["pause"]
    if pause is not None and before["pause"] is not None:  # (the drafting pause's counts over the run too)
        pause = {**pause, **{k: pause[k] - before["pause"][k]
                             for k in ("num_pauses", "num_resumes", "num_paused_steps")}}
    return {"num_verify_steps": verify, "num_draft_tokens": drafts, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "mean_accepted_len": (accepted + verify) / verify if verify else 0.0,
            "per_position_acceptance": per_pos, "pause": pause}


def _drive(engine, reqs: list[DatasetRequest], records: list[RequestRecord] | None, concurrency: int,
           prefix: str, on_finish=None, iteration_log: IO[str] | None = None, t0: float = 0.0) -> None:
    """Feed ``reqs`` through the engine keeping at most ``concurrency`` in flight, until all are done."""
    pending = deque(range(len(reqs)))
    inflight: dict[str, int] = {}
    seen: dict[str, int] = {}
    idle = 0
    iteration = 0
    while pending or inflight:
        while pending and (concurrency < 0 or len(inflight) < concurrency):
            i = pending.popleft()
            r = reqs[i]
            rec = records[i] if records is not None else None
            sp = SamplingParams(max_tokens=r.output_tokens, ignore_eos=True, detokenize=False)  # ids are counted
            now = time.perf_counter()
            try:
                rid = engine.add_request(r.input_ids, sp, request_id=f"{prefix}{i}", prompt=r.prompt)
            except RequestError as e:
                if rec is None:  # warmup: the timed run reports it
                    continue
                rec.arrival, rec.error = now, str(e)
                if on_finish:
                    on_finish()
                continue
            if rec is not None:
                rec.arrival = now
            inflight[rid] = i
            seen[rid] = 0
        if not inflight:
            break
        steps_before = engine.num_steps
        t_start = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        progressed = engine.num_steps != steps_before
        # (a call that only read back an overlapped step's tokens logs as a step of no seqs)
        if (progressed or outs) and iteration_log is not None:
            iteration += 1
            entry = {"iteration": iteration, **engine.last_step, "step_time_ms": (now - t_start) * 1e3,
                     "elapsed_s": now - t0, "num_in_flight": len(inflight), "num_waiting_to_add": len(pending)}
            iteration_log.write(json.dumps(entry) + "\n")
        idle = 0 if (progressed or outs) else idle + 1
        if idle >= _MAX_IDLE_STEPS:
            raise RuntimeError(f"the engine made no progress in {_MAX_IDLE_STEPS} steps with {len(inflight)}"
                               " requests in flight")
        for out in outs:
            i = inflight.get(out.request_id)
            if i is None:
                continue
            comp = out.outputs[0]
            n = len(comp.token_ids)
            rec = records[i] if records is not None else None
            if rec is not None and n > seen[out.request_id]:
                if rec.first_token is None:
                    rec.first_token = now
                rec.token_times.append((now, n - seen[out.request_id]))
            seen[out.request_id] = n
            if out.finished:
                del inflight[out.request_id]
                engine.requests.pop(out.request_id, None)  # the engine keeps finished requests until told
                if rec is not None:
                    rec.finish, rec.output_len, rec.finish_reason = now, n, comp.finish_reason
                    if comp.finish_reason in ("error", "abort") or out.error:
                        rec.error = out.error or f"the engine ended the request ({comp.finish_reason})"
                    elif n != rec.output_tokens:
                        rec.error = (f"generated {n} tokens, asked for {rec.output_tokens}"
                                     f" (finish reason {comp.finish_reason})")
                if on_finish:
                    on_finish()


def run_benchmark(llm, requests: list[DatasetRequest], *, concurrency: int = -1, warmup: int = 0,
                  iteration_log: IO[str] | None = None, progress: bool = True) -> RunResult:
    engine = llm.engine
    if warmup > 0:
        warm = [requests[i % len(requests)] for i in range(warmup)]
        t = time.perf_counter()
        _drive(engine, warm, None, concurrency, prefix="__bench_warmup_")
        log.info("%d warmup requests in %.1f s (untimed)", warmup, time.perf_counter() - t)
    records = [RequestRecord(index=i, task_id=r.task_id, line=r.line, input_len=r.input_len,
                             output_tokens=r.output_tokens) for i, r in enumerate(requests)]
    spec_before = _spec_counts(engine)
    stats_before = engine.get_stats()
    compiled_before = len(COMPILES.compiles)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(requests), desc="requests", unit="req", dynamic_ncols=True)
    start = time.perf_counter()
    interrupted, rank_error = False, None
    try:
        _drive(engine, requests, records, concurrency, prefix="bench_",
               on_finish=(lambda: bar.update(1)) if bar is not None else None, iteration_log=iteration_log,
               t0=start)
    except KeyboardInterrupt:  # Ctrl-C: keep what finished, abort the rest, report both
        interrupted = True
        _stop_run(engine, records, "interrupted (SIGINT) before it finished")
    except RankError as e:  # every rank has been stopped: likewise
        rank_error = str(e)
        _stop_run(engine, records, f"the run stopped before it finished (rank {e.rank} failed)")
    finally:
        if bar is not None:
            bar.close()
    end = max([r.finish for r in records if r.finish is not None], default=time.perf_counter())
    stats_after = engine.get_stats()
    return RunResult(records=records, start=start, end=end,
                     num_steps=stats_after["num_steps"] - stats_before["num_steps"],
                     num_preemptions=stats_after["num_preemptions"] - stats_before["num_preemptions"],
                     spec=_spec_delta(spec_before, _spec_counts(engine)) if engine.draft_len else None,
                     num_warmup=max(warmup, 0), interrupted=interrupted, rank_error=rank_error,
                     compiles=COMPILES.since(compiled_before))


def _stop_run(engine, records: list[RequestRecord], why: str) -> None:
    """The timed run stopped early: abort its requests still in the engine; those unfinished get ``why``."""
    for rid in [rid for rid in engine.requests if rid.startswith("bench_")]:
        engine.abort_request(rid)
    for rec in records:
        if rec.finish is None and rec.error is None:
            rec.error = why
