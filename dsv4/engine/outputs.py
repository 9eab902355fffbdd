"""What generate() and the streaming interface return (vLLM's shape: outputs[i].outputs[0].token_ids)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    error: str | None = None
    metrics: dict = field(default_factory=dict)  # arrival / first_token / finished times (time.perf_counter)
