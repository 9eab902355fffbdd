"""Deterministic random checkpoints for tests and benchmarks.

Every parameter is random, including the ones transformers initialises to zero (tid2eid, ape, attn_sink,
mHC base vectors, gate.bias; model doc, "Testing against transformers", gotcha 2), at scales that keep
activations O(1) so that no path of the model is trivially dead or saturated.
"""

from __future__ import annotations

import math
import re

import torch

from ..config import ModelConfig, get_preset
from .io import write_checkpoint
from .schema import checkpoint_schema, is_int_tensor, tensor_dtype

# name patterns (model naming) -> how the tensor is drawn; the first match wins
_NORM = re.compile(r"(^|\.)(\w*norm)\.weight$")  # attn_norm, q_norm, kv_norm, compressor.norm, enorm, norm, ...
_HC_FN = re.compile(r"(^|\.)hc_\w+_fn$")
_HC_SCALE = re.compile(r"(^|\.)hc_\w+_scale$")
_HALF_STD = re.compile(r"(^|\.)(hc_\w+_base|attn_sink|ape)$")


def _normal(shape, std: float, gen: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device) * std + mean


def _tid2eid(shape, n_experts: int, gen: torch.Generator) -> torch.Tensor:
    """[V, k] int64: for each token, k DISTINCT experts chosen uniformly at random."""
    vocab, k = shape
    keys = torch.rand((vocab, n_experts), generator=gen, device=gen.device)  # a random permutation per row = argsort of keys
    return keys.topk(k, dim=1).indices.to(torch.int64)


def _draw(name: str, shape: tuple[int, ...], cfg: ModelConfig, gen: torch.Generator) -> torch.Tensor:
    """One float32 (or int64) tensor for ``name``."""
    if is_int_tensor(name):
        return _tid2eid(shape, cfg.n_routed_experts, gen)
    if _NORM.search(name):
        return _normal(shape, 0.1, gen, mean=1.0)
    if _HC_FN.search(name):
        # mixing logits = fn . x over n*d inputs of RMS ~1: std 0.3 / sqrt(n*d) keeps them ~0.3
        return _normal(shape, 0.3 / math.sqrt(shape[1]), gen)
    if _HC_SCALE.search(name):
        return _normal(shape, 0.1, gen, mean=0.5)
    if _HALF_STD.search(name):
        return _normal(shape, 0.5, gen)
    if name.endswith(".gate.bias"):
        return _normal(shape, 0.1, gen)
    if name == "embed.weight":
        return _normal(shape, 1.0, gen)
    # every remaining tensor is a linear weight [..., out, in] (stacked experts included): unit-variance
    # inputs give unit-variance outputs; head.weight gets 1/sqrt(d) the same way
    return _normal(shape, 1.0 / math.sqrt(shape[-1]), gen)


def random_state_dict(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                      device="cpu", transform=None) -> dict[str, torch.Tensor]:
    """A random model state-dict (model naming, MTP included when the config has it).

    Deterministic: one torch.Generator seeded once, tensors drawn in sorted-name order in float32, then
    cast to ``dtype`` (hc_*, attn_sink, ape, gate.bias stay float32; tid2eid is int64). ``device`` picks
    where they are drawn: the same seed gives the same weights on the same device type (a CUDA generator
    draws other numbers than the CPU one; use it for big benchmark models). ``transform(name, tensor)`` -> a
    dict of tensors to keep in its place, applied as each is drawn (packing the experts of a model whose
    dequantised experts would not fit).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    schema = checkpoint_schema(cfg, with_mtp=True)
    out = {}
    for name in sorted(schema):
        t = _draw(name, schema[name], cfg, gen).to(tensor_dtype(name, dtype))
        out.update(transform(name, t) if transform is not None else {name: t})
    return out


def init_random_checkpoint(cfg_or_preset_name: ModelConfig | str, out_dir: str, seed: int = 0,
                           dtype: torch.dtype = torch.float32, naming: str = "deepseek") -> ModelConfig:
    """Write a random checkpoint (config.json + model.safetensors, MTP weights included) to ``out_dir``.

    Returns the config. Same arguments -> byte-identical model.safetensors.
    """
    cfg = get_preset(cfg_or_preset_name) if isinstance(cfg_or_preset_name, str) else cfg_or_preset_name
    write_checkpoint(out_dir, cfg, random_state_dict(cfg, seed, dtype), naming=naming)
    return cfg
