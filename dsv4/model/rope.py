"""RoPE frequency tables: plain for sliding-window-only layers (and the MTP layer), YaRN for compressed ones."""

from __future__ import annotations

import math

import torch

from ..config import ModelConfig


def inv_freq(rope_dim: int, base: float) -> torch.Tensor:
    """theta_i = base^(-2i/R), i < R/2 (fp32)."""
    return 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def yarn_inv_freq(rope_dim: int, base: float, factor: float, original_max_pos: int, beta_fast: float,
                  beta_slow: float) -> torch.Tensor:
    """YaRN frequency interpolation: low frequencies divided by ``factor``, high ones kept, a linear ramp
    between the floor/ceil correction dimensions. No magnitude (mscale) factor: DeepSeek-V4 has none."""
    freqs = inv_freq(rope_dim, base)

    def correction_dim(num_rotations: float) -> float:
        return rope_dim * math.log(original_max_pos / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1 = keep the original (extrapolate), 0 = interpolate
    return freqs / factor * (1 - keep) + freqs * keep


def layer_inv_freq(cfg: ModelConfig, compress_ratio: int) -> torch.Tensor:
    """The table a layer uses for q, kv, its compressed entries and its indexer."""
    if compress_ratio == 0:
        return inv_freq(cfg.rope_dim, cfg.rope_theta)
    if cfg.yarn is None:
        return inv_freq(cfg.rope_dim, cfg.compress_rope_theta)
    y = cfg.yarn
    return yarn_inv_freq(cfg.rope_dim, cfg.compress_rope_theta, y.factor, y.original_max_position_embeddings,
                         y.beta_fast, y.beta_slow)
