"""Driving an engine step by step in tests: traces compared between two twins (a pass against the one it stands
for), aborts at a chosen token count."""

from __future__ import annotations

import torch


def run_traced(eng, rids, rings: bool = False) -> list:
    """Step ``eng`` until it has no work; after each step every request's (drafts, output ids), and with ``rings``
    a copy of every layer's window ring without its null slot (slot 0: the rows a step does not keep, padded
    rows and a long chunk's early ones, are all written to its row 0; on a GPU which of them lands last is not
    fixed, and nothing reads it)."""
    trace = []
    S = eng.cache.layout.swa_cap
    while eng.has_unfinished_requests():
        eng.step()
        seen = [(tuple(eng.requests[r].drafts), tuple(eng.requests[r].output_ids)) for r in rids]
        trace.append((seen, [t[S:].clone() for t in eng.storage.swa]) if rings else seen)
    return trace


def run_with_aborts(eng, rids, abort_at: dict) -> dict:
    """Step ``eng`` until it has no work, aborting request ``rids[i]`` once it holds ``abort_at[i]`` tokens;
    returns the aborts that did not happen (their requests ended first)."""
    abort_at = dict(abort_at)
    while eng.has_unfinished_requests():
        eng.step()
        for i, n in list(abort_at.items()):
            req = eng.requests[rids[i]]
            if len(req.output_ids) >= n and not req.finished:
                eng.abort_request(rids[i])
                del abort_at[i]
    return abort_at


def assert_same_steps(a: list, b: list) -> None:
    """Two ``run_traced(..., rings=True)`` traces: the same drafts and tokens, every ring bit for bit, every step."""
    assert len(a) == len(b)
    for (seen, rings), (seen_b, rings_b) in zip(a, b):
        assert seen == seen_b
        assert all(torch.equal(x, y) for x, y in zip(rings, rings_b))


def ring_spans(eng, rids) -> list:
    """Per live request: (its ``mtp_stale_to``, its window-ring rows of every layer, the MTP layer's included,
    at the ring's span of positions before its committed length, oldest first)."""
    S, cache, out = eng.cache.layout.swa_cap, eng.cache, []
    for rid in rids:
        if rid not in cache._reqs:
            continue
        q = cache._reqs[rid]
        span = range(q.num_computed - S, q.num_computed)
        rows = [q.slot * S + p % S for p in span]
        out.append((max(q.mtp_stale_to - span.start, 0), [t[rows].clone() for t in eng.storage.swa]))
    return out


def assert_same_current_rows(a: list, b: list) -> int:
    """Two traces of (step outputs, ``ring_spans``): the same outputs at every step and the same ring rows from
    the first row trace ``a``'s cache calls current; returns how many rows it called stale in all."""
    assert len(a) == len(b)
    stale_rows = 0
    for (seen, spans), (seen_b, spans_b) in zip(a, b):
        assert seen == seen_b
        for (first, rows), (_, rows_b) in zip(spans, spans_b):
            stale_rows += first
            assert all(torch.equal(x[first:], y[first:]) for x, y in zip(rows, rows_b))
    return stale_rows
