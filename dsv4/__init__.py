"""dsv4: an inference engine for DeepSeek-V4 models with MTP speculative decoding."""

__version__ = "0.1.0"
