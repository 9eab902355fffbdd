"""Per-request sampling settings, named as in vLLM / TensorRT-LLM."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

GREEDY_BELOW = 1e-5  # a temperature under this samples as greedy (vLLM's _SAMPLING_EPS)
MAX_LOGPROBS = 20  # the most top logprobs a request may ask for (vLLM's default max_logprobs, OpenAI's top_logprobs)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # 64 bits, signed or unsigned (sampler.request_key folds them to 32)


def is_int(x) -> bool:
    """An integer (any numbers.Integral), not a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def plain_ints(xs) -> bool:
    """Whether every element of xs is a plain int (not a subclass: bool is not), by the set of their types: an 8k
    prompt on the CPU machine in 0.19 ms, against 0.6 for a generator of ``type(t) is int``."""
    return set(map(type, xs)) <= {int}


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    detokenize: bool = True  # False: outputs carry token ids only (text None), as vLLM's flag
    # None: no logprobs; n >= 0: each output token's logprob and the n most likely tokens' (as vLLM's field),
    # from the target model's raw distribution (log_softmax of its logits, before temperature / top-k / top-p)
    logprobs: int | None = None

    def __post_init__(self):
        """Refuse at construction what a step could not run (a NaN temperature, a fractional top_k), naming
        the field. As vLLM: a temperature below 1e-5 means greedy, top_k -1 means off."""
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite number >= 0 (0 = greedy), got"
                             f" {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be an integer >= 0 (0 or -1 = off), got {self.top_k!r}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"SamplingParams.seed must be an integer or None (an integer in [-2**63, 2**64 - 1]),"
                             f" got {self.seed!r}")
        for name in ("ignore_eos", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name} must be True or False, got {getattr(self, name)!r}")
        stops = tuple(self.stop_token_ids) if isinstance(self.stop_token_ids, (list, tuple)) else None
        if stops is None or not all(is_int(t) and t >= 0 for t in stops):
            raise ValueError(f"SamplingParams.stop_token_ids must be a list of token ids (integers >= 0), got"
                             f" {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"SamplingParams.logprobs must be None or an integer in [0, {MAX_LOGPROBS}] (0: the"
                             f" chosen token's logprob only; n: also the top n), got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
