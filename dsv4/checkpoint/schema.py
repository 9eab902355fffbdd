"""The model state-dict: every tensor name and shape a ``ModelConfig`` implies, and the dtypes kept fixed.

Model naming = DeepSeek's checkpoint naming (model doc section 1.2) with the routed experts of a layer
stacked: ``layers.{i}.ffn.experts.w1 [E, I, d]`` instead of ``layers.{i}.ffn.experts.{e}.w1.weight [I, d]``.
"""

from __future__ import annotations

import re

import torch

from ..config import ModelConfig, kind_spec
from ..kernels.fp4 import BLOCK as FP4_BLOCK

Shape = tuple[int, ...]

MTP_PREFIX = "mtp.0."


class CheckpointError(ValueError):
    """A checkpoint that does not match the config: the message names the tensor (and the shapes)."""


def _attention(cfg: ModelConfig, ratio: int) -> dict[str, Shape]:
    d, H, D, q = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    g, o = cfg.o_groups, cfg.o_lora_rank
    s = {
        "attn.wq_a.weight": (q, d),
        "attn.q_norm.weight": (q,),
        "attn.wq_b.weight": (H * D, q),
        "attn.wkv.weight": (D, d),
        "attn.kv_norm.weight": (D,),
        "attn.wo_a.weight": (g * o, H * D // g),
        "attn.wo_b.weight": (d, g * o),
        "attn.attn_sink": (H,),
    }
    if ratio > 0:
        c = kind_spec(ratio).coff  # the ratio-4 compressor overlaps windows: two halves per entry
        s.update({
            "attn.compressor.wkv.weight": (c * D, d),
            "attn.compressor.wgate.weight": (c * D, d),
            "attn.compressor.ape": (ratio, c * D),
            "attn.compressor.norm.weight": (D,),
        })
    if kind_spec(ratio).has_indexer:
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        s.update({
            "attn.indexer.wq_b.weight": (nI * dI, q),
            "attn.indexer.weights_proj.weight": (nI, d),
            "attn.indexer.compressor.wkv.weight": (2 * dI, d),
            "attn.indexer.compressor.wgate.weight": (2 * dI, d),
            "attn.indexer.compressor.ape": (4, 2 * dI),
            "attn.indexer.compressor.norm.weight": (dI,),
        })
    return s


def _moe(cfg: ModelConfig, hash_routed: bool) -> dict[str, Shape]:
    d, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_inter_dim
    s = {"ffn.gate.weight": (E, d)}
    if hash_routed:
        s["ffn.gate.tid2eid"] = (cfg.vocab_size, cfg.n_experts_per_tok)
    else:
        s["ffn.gate.bias"] = (E,)
    s.update({"ffn.experts.w1": (E, I, d), "ffn.experts.w2": (E, d, I), "ffn.experts.w3": (E, I, d)})
    if cfg.n_shared_experts == 1:
        s.update({
            "ffn.shared_experts.w1.weight": (I, d),
            "ffn.shared_experts.w2.weight": (d, I),
            "ffn.shared_experts.w3.weight": (I, d),
        })
    return s


def _hc(cfg: ModelConfig, which: str, rows: int, scales: int) -> dict[str, Shape]:
    n, d = cfg.hc_mult, cfg.hidden_size
    return {f"hc_{which}_fn": (rows, n * d), f"hc_{which}_base": (rows,), f"hc_{which}_scale": (scales,)}


def _block(cfg: ModelConfig, ratio: int, hash_routed: bool) -> dict[str, Shape]:
    """One transformer block (main layer or the MTP layer's block), names relative to its prefix."""
    d, n = cfg.hidden_size, cfg.hc_mult
    s = {"attn_norm.weight": (d,), "ffn_norm.weight": (d,)}
    s.update(_hc(cfg, "attn", (2 + n) * n, 3))
    s.update(_hc(cfg, "ffn", (2 + n) * n, 3))
    s.update(_attention(cfg, ratio))
    s.update(_moe(cfg, hash_routed))
    return s


def mtp_schema(cfg: ModelConfig) -> dict[str, Shape]:
    """The MTP layer's tensors (``mtp.0.*``): an SWA-only, score-routed block plus its own projections."""
    d = cfg.hidden_size
    s = _block(cfg, ratio=0, hash_routed=False)
    s.update({"e_proj.weight": (d, d), "h_proj.weight": (d, d), "enorm.weight": (d,), "hnorm.weight": (d,),
              "norm.weight": (d,)})
    s.update(_hc(cfg, "head", cfg.hc_mult, 1))
    return {MTP_PREFIX + k: v for k, v in s.items()}


def checkpoint_schema(cfg: ModelConfig, with_mtp: bool = True) -> dict[str, Shape]:
    """Every tensor of the model state-dict (model naming) -> its shape.

    The MTP layer is included when ``with_mtp`` and the config has one (``num_mtp_layers == 1``).
    """
    d, V = cfg.hidden_size, cfg.vocab_size
    s: dict[str, Shape] = {"embed.weight": (V, d), "head.weight": (V, d), "norm.weight": (d,)}
    s.update(_hc(cfg, "head", cfg.hc_mult, 1))
    for i, ratio in enumerate(cfg.compress_ratios):
        block = _block(cfg, ratio, cfg.is_hash_layer(i))
        s.update({f"layers.{i}.{k}": v for k, v in block.items()})
    if with_mtp and cfg.has_mtp:
        s.update(mtp_schema(cfg))
    return s


# ------------------------------------------------------------------------------------------------
# dtypes that do not follow the load dtype
# ------------------------------------------------------------------------------------------------
_FP32_NAME = re.compile(r"(^|\.)(hc_\w+|attn_sink|ape)$|\.gate\.bias$")


def is_fp32_tensor(name: str) -> bool:
    """hc_*, attn_sink, ape and gate.bias are float32 in DeepSeek's model whatever the weight dtype."""
    return bool(_FP32_NAME.search(name))


def is_int_tensor(name: str) -> bool:
    return name.endswith(".tid2eid")


def tensor_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a model-named tensor is held in when weights are loaded as ``dtype``."""
    if is_int_tensor(name):
        return torch.int64
    return torch.float32 if is_fp32_tensor(name) else dtype


# ------------------------------------------------------------------------------------------------
# validation
# ------------------------------------------------------------------------------------------------
_STACKED_EXPERTS = re.compile(r"\.ffn\.experts\.w[123]$")  # a model-named stacked routed-expert tensor


def _describe(name: str) -> str:
    if _STACKED_EXPERTS.search(name):  # say which file keys a stacked tensor came from
        prefix, w = name.rsplit(".", 1)
        return f"{name!r} (file keys {prefix}.{{e}}.{w}.weight)"
    return repr(name)


def validate_state_dict(state_dict, cfg: ModelConfig, with_mtp: bool, num_experts: int | None = None) -> None:
    """Compare a model-named state-dict with ``checkpoint_schema(cfg, with_mtp)``.

    Raises CheckpointError listing every missing, unexpected or mis-shaped tensor by name (with shapes),
    and any ``tid2eid`` entry that is not an expert id. ``num_experts``: the stacked routed-expert tensors
    hold only that many experts (an expert-parallel rank's share).
    """
    want = checkpoint_schema(cfg, with_mtp)
    if num_experts is not None:
        want = {k: ((num_experts,) + v[1:] if _STACKED_EXPERTS.search(k) else v) for k, v in want.items()}
    for k in [k for k in want if _STACKED_EXPERTS.search(k) and k + "_scale" in state_dict]:  # kept packed FP4
        E, rows, cols = want[k]
        want[k], want[k + "_scale"] = (E, rows, cols // 2), (E, rows, cols // FP4_BLOCK)
    problems = []
    for name in sorted(set(want) - set(state_dict)):
        problems.append(f"missing tensor {_describe(name)} of shape {list(want[name])}")
    for name in sorted(set(state_dict) - set(want)):
        problems.append(f"unexpected tensor {name!r} of shape {list(state_dict[name].shape)}")
    for name in sorted(set(want) & set(state_dict)):
        got = tuple(state_dict[name].shape)
        if got != want[name]:
            problems.append(f"tensor {_describe(name)} has shape {list(got)}, expected {list(want[name])}")
        elif is_int_tensor(name):
            ids = state_dict[name]
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= cfg.n_routed_experts):
                problems.append(f"tensor {name!r} holds expert ids outside 0..{cfg.n_routed_experts - 1}")
    if problems:
        shown = "; ".join(problems[:20]) + (f"; and {len(problems) - 20} more" if len(problems) > 20 else "")
        raise CheckpointError(f"checkpoint does not match the config ({len(problems)} problem(s)): {shown}")
