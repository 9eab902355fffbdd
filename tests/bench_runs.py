"""Test helpers for a ``dsv4-bench throughput`` run stopped part way (Ctrl-C, a lost rank)."""

from __future__ import annotations


def six_request_dataset(tmp_path):
    """A dataset of 6 short requests (3-token prompts, 2 output tokens each)."""
    ds = tmp_path / "ds.jsonl"
    ds.write_text("".join(f'{{"task_id": {i}, "input_ids": [1, 2, {i + 3}], "output_tokens": 2}}\n'
                          for i in range(6)))
    return ds


def at_bench_step(monkeypatch, n: int, action) -> None:
    """Call ``action(engine)`` before the n-th engine step that holds the benchmark's timed requests."""
    from dsv4.engine.engine import LLMEngine

    real, calls = LLMEngine.step, {"n": 0}

    def step(self):
        if any(rid.startswith("bench_") for rid in self.requests):
            calls["n"] += 1
            if calls["n"] == n:
                action(self)
        return real(self)

    monkeypatch.setattr(LLMEngine, "step", step)
