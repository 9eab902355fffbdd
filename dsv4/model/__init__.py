"""The DeepSeek-V4 model. ``load_model(dir)`` -> ``model(input_ids)`` is the dense reference path."""

from .loader import build_model, load_model
from .model import DeepseekV4, MTPUnavailableError

__all__ = ["DeepseekV4", "MTPUnavailableError", "build_model", "load_model"]
