"""Building a model from a checkpoint directory (or a preset with random weights)."""

from __future__ import annotations

import torch

from ..builtin import resolve_model
from ..checkpoint.init_random import random_state_dict
from ..checkpoint.io import read_state_dict
from ..config import ModelConfig, get_preset, is_checkpoint_dir, is_preset, load_config
from .expert_weights import EXPERT_FORMATS, adopt_layout, check_fp4_shapes, is_expert_tensor, pack_experts, pack_tensor
from .linear_weights import LINEAR_FORMATS, adopt_linear_layout, quantize_linear, quantize_linears
from .model import DeepseekV4


def _transform(fp4: bool, fp8: bool):
    """A random draw's tensors as the formats keep them (packed experts, FP8 linears), one at a time."""
    if not (fp4 or fp8):
        return None

    def transform(name: str, t: torch.Tensor) -> dict:
        if fp4 and is_expert_tensor(name):
            return pack_tensor(name, t)
        return quantize_linear(name, t) if fp8 else {name: t}

    return transform


def build_model(cfg: ModelConfig, state_dict: dict, has_mtp: bool, device="cpu") -> DeepseekV4:
    """Instantiate on the meta device and adopt the given tensors (no double allocation)."""
    with torch.device("meta"):
        model = DeepseekV4(cfg, with_mtp=has_mtp)
        adopt_layout(model, state_dict)
        adopt_linear_layout(model, state_dict)
    model.load_state_dict({k: v.to(device) for k, v in state_dict.items()}, strict=True, assign=True)
    return model.finish_loading(device)


def load_model(checkpoint_dir: str, device="cpu", dtype: torch.dtype = torch.float32,
               with_mtp: bool | None = None, seed: int = 0, expert_format: str = "dequantized",
               linear_format: str = "dequantized") -> DeepseekV4:
    """A checkpoint directory (config.json + safetensors), a built-in checkpoint (``mini``), or a preset name (``tiny``, ``flash-L4-E32``, ...)
    which gets deterministic random weights from ``seed`` (drawn on ``device``). ``expert_format``: the routed
    experts' weights in ``dtype`` or packed FP4 (``dsv4.model.expert_weights``); ``linear_format``: the FP8-shipped
    linears in ``dtype`` or FP8 (``dsv4.model.linear_weights``)."""
    cfg, sd, has_mtp = load_state(checkpoint_dir, device, dtype, with_mtp, seed, expert_format=expert_format,
                                  linear_format=linear_format)
    return build_model(cfg, sd, has_mtp, device)


def model_config(checkpoint_dir: str) -> ModelConfig:
    """The config of a checkpoint directory, built-in checkpoint or preset, without reading any weights."""
    checkpoint_dir = resolve_model(checkpoint_dir)
    if is_checkpoint_dir(checkpoint_dir):
        return load_config(checkpoint_dir)
    if is_preset(checkpoint_dir):
        return get_preset(checkpoint_dir)
    raise FileNotFoundError(f"{checkpoint_dir!r} is neither a checkpoint directory nor a preset name")


def load_state(checkpoint_dir: str, device="cpu", dtype: torch.dtype = torch.float32,
               with_mtp: bool | None = None, seed: int = 0,
               experts: range | None = None, expert_format: str = "dequantized",
               linear_format: str = "dequantized") -> tuple[ModelConfig, dict, bool]:
    """(config, state dict, has_mtp) as ``load_model`` reads them. ``experts``: only these routed experts
    (stacked tensors [len(experts), ...]); an expert-parallel rank reads just its share of a checkpoint, and
    slices the rest of its share from what it read (``dsv4.parallel.shard``). A built-in name (``mini``) reads
    the checkpoint shipped in the package. ``expert_format`` "fp4": the routed experts come back packed (each
    with its ``_scale``); a checkpoint's FP4 experts are then what the file holds (the decode at read and the
    packing are exact inverses), a preset's random ones are rounded to FP4. ``linear_format`` "fp8": the same
    for the FP8-shipped linears (``X.weight`` e4m3 with ``X.scale``)."""
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format {expert_format!r}: use one of {', '.join(EXPERT_FORMATS)}")
    if linear_format not in LINEAR_FORMATS:
        raise ValueError(f"linear_format {linear_format!r}: use one of {', '.join(LINEAR_FORMATS)}")
    checkpoint_dir = resolve_model(checkpoint_dir)
    if not (is_checkpoint_dir(checkpoint_dir) or is_preset(checkpoint_dir)):
        raise FileNotFoundError(f"{checkpoint_dir!r} is neither a checkpoint directory nor a preset name")
    cfg = load_config(checkpoint_dir) if is_checkpoint_dir(checkpoint_dir) else get_preset(checkpoint_dir)
    fp4, fp8 = expert_format == "fp4", linear_format == "fp8"
    if fp4:
        check_fp4_shapes(cfg.hidden_size, cfg.moe_inter_dim)
    if is_checkpoint_dir(checkpoint_dir):
        sd, has_mtp = read_state_dict(checkpoint_dir, cfg, dtype=dtype, device="cpu", with_mtp=with_mtp,
                                      experts=experts, keep_fp4=fp4)
        sd = pack_experts(sd) if fp4 else sd
        return cfg, quantize_linears(sd) if fp8 else sd, has_mtp
    has_mtp = cfg.has_mtp if with_mtp is None else with_mtp
    # big presets draw on the GPU when the model goes there (seconds instead of minutes); every expert is
    # drawn (the same weights as one process), then the share is kept. Packed experts are packed as they are
    # drawn, one stacked tensor at a time (a model whose dequantised experts would not fit still loads).
    sd = random_state_dict(cfg, seed=seed, dtype=dtype, device=device if str(device).startswith("cuda") else "cpu",
                           transform=_transform(fp4, fp8))
    if not has_mtp:
        sd = {k: v for k, v in sd.items() if not k.startswith("mtp.")}
    if experts is not None:
        sd = {k: (v[experts.start:experts.stop].clone() if is_expert_tensor(k) else v) for k, v in sd.items()}
    return cfg, sd, has_mtp
