"""What generate() and the streaming interface return (vLLM's shape: outputs[i].outputs[0].token_ids)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str | None = None
    finish_reason: str | None = None  # "length" | "stop" | "abort" | "error"
    # with SamplingParams.logprobs: one dict per token of token_ids, token id -> logprob (the chosen token and
    # the top n, raw model distribution); None when the request did not ask
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt: str | None = None
    error: str | None = None
    # arrival / first_scheduled / first_token / finish times (time.perf_counter), num_preemptions
    metrics: dict = field(default_factory=dict)
