"""dsv4: an inference engine for DeepSeek-V4 models with MTP speculative decoding.

``from dsv4 import LLM, SamplingParams`` is the public API (imported lazily, so ``dsv4.config`` and
``dsv4.model`` stay light).
"""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from .llm import LLM

        return LLM
    if name == "SamplingParams":
        from .engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'dsv4' has no attribute {name!r}")
