"""Tensor-name conversions between the three namings a DeepSeek-V4 state-dict comes in.

* **deepseek** (checkpoint files on the hub, model doc 1.2): routed experts one key each,
  ``layers.{i}.ffn.experts.{e}.w1.weight [I, d]``.
* **model** (our nn.Module, see ``schema.py``): the same names with each layer's experts stacked,
  ``layers.{i}.ffn.experts.w1 [E, I, d]``.
* **hf** (transformers' ``DeepseekV4ForCausalLM``): ``model.layers.{i}.self_attn.q_a_proj.weight`` etc.,
  experts fused as ``mlp.experts.gate_up_proj [E, 2I, d]`` (w1 rows, then w3 rows) and
  ``mlp.experts.down_proj [E, d, I]``. transformers has no MTP module: MTP tensors in an hf-named file
  keep their DeepSeek names (``mtp.0.*``, per-expert keys).

Names a table does not know pass through unchanged, so that validation can report them as unexpected.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from .schema import MTP_PREFIX, CheckpointError

# deepseek per-expert key; its ``.scale`` stacks too where the engine keeps the experts packed (``w1_scale``)
_EXPERT_KEY = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")
_STACKED_KEY = re.compile(r"^(.*\.ffn\.experts)\.(w[123])$")  # model stacked key
# the linears DeepSeek ships as FP8 block-128 (the same name in DeepSeek's and the model's naming)
_FP8_LINEAR = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.shared_experts\.w[123]"
                         r"|^mtp\.\d+\.(e_proj|h_proj))\.weight$")

# ---- deepseek <-> hf, top level
_TOP_TO_HF = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# ---- deepseek <-> hf, inside a layer (``layers.{i}.`` <-> ``model.layers.{i}.``)
_LAYER_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
_TOP_FROM_HF = {v: k for k, v in _TOP_TO_HF.items()}
_LAYER_FROM_HF = {v: k for k, v in _LAYER_TO_HF.items()}
_DS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HF_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def detect_naming(names: Iterable[str]) -> str:
    """"hf" for transformers' module names (``model.layers.N.self_attn.*``, ``lm_head.*``), "hf-deepseek" for
    the layout newer transformers (5.2x) write: DeepSeek's module names under a ``model.`` prefix
    (``model.layers.N.attn.*``, unfused ``ffn.experts.E.w1``), else "deepseek"."""
    names = list(names)
    if not any(n.startswith(("model.", "lm_head.")) for n in names):
        return "deepseek"
    return "hf-deepseek" if any(_HFDS_LAYER.match(n) for n in names) else "hf"


_HFDS_LAYER = re.compile(r"^model\.layers\.\d+\.(attn|ffn)\.")  # transformers' own: self_attn. / mlp.
_HFDS_TOP = {"model.embed_tokens.weight": "embed.weight", "model.hc_head.hc_base": "hc_head_base",
             "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_scale": "hc_head_scale",
             "lm_head.weight": "head.weight"}
_HFDS_KV_NORM = re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$")


def hf_deepseek_to_deepseek_name(name: str) -> str:
    """A name of the "hf-deepseek" layout -> DeepSeek's: the ``model.`` prefix dropped, and the few modules
    transformers renamed (``embed_tokens``, ``hc_head.hc_*``, the attention's ``norm``, which DeepSeek calls
    ``kv_norm``) named back."""
    if name in _HFDS_TOP:
        return _HFDS_TOP[name]
    name = name[len("model."):] if name.startswith("model.") else name
    return _HFDS_KV_NORM.sub(r"\1.kv_norm.weight", name)


def to_deepseek_name(name: str, naming: str) -> str:
    """A file's tensor name in ``naming`` -> DeepSeek's (routed experts of "hf" stay fused: see
    ``hf_items_to_deepseek``)."""
    if naming == "hf":
        return hf_to_deepseek_name(name)
    if naming == "hf-deepseek":
        return hf_deepseek_to_deepseek_name(name)
    return name


# ------------------------------------------------------------------------------------------------
# single names
# ------------------------------------------------------------------------------------------------
def deepseek_to_hf_name(name: str) -> str:
    """One non-routed-expert DeepSeek name -> transformers' name; ``mtp.*`` and unknown names unchanged."""
    if name in _TOP_TO_HF:
        return _TOP_TO_HF[name]
    m = _DS_LAYER.match(name)
    if m and m.group(2) in _LAYER_TO_HF:
        return f"model.layers.{m.group(1)}.{_LAYER_TO_HF[m.group(2)]}"
    return name


def hf_to_deepseek_name(name: str) -> str:
    """Inverse of ``deepseek_to_hf_name``; unknown names unchanged."""
    if name in _TOP_FROM_HF:
        return _TOP_FROM_HF[name]
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _LAYER_FROM_HF:
        return f"layers.{m.group(1)}.{_LAYER_FROM_HF[m.group(2)]}"
    return name


def expert_key(stacked_name: str, expert: int) -> str:
    """``layers.0.ffn.experts.w1``, 3 -> ``layers.0.ffn.experts.3.w1.weight``."""
    prefix, w = stacked_name.rsplit(".", 1)
    return f"{prefix}.{expert}.{w}.weight"


def split_expert_key(name: str) -> tuple[str, int] | None:
    """``layers.0.ffn.experts.3.w1.weight`` -> (``layers.0.ffn.experts.w1``, 3), its ``.scale`` ->
    (``layers.0.ffn.experts.w1_scale``, 3); None for other names."""
    m = _EXPERT_KEY.match(name)
    if not m:
        return None
    return f"{m.group(1)}.{m.group(3)}" + ("_scale" if m.group(4) == "scale" else ""), int(m.group(2))


def is_fp8_linear(name: str) -> bool:
    """A weight DeepSeek ships as FP8 e4m3 with block-128 scales (attention, indexer query, shared expert and
    MTP projections)."""
    return _FP8_LINEAR.search(name) is not None


def is_stacked_expert(name: str) -> bool:
    return bool(_STACKED_KEY.match(name))


# ------------------------------------------------------------------------------------------------
# deepseek <-> model: stacking routed experts
# ------------------------------------------------------------------------------------------------
def _items(sd) -> Iterable[tuple[str, torch.Tensor]]:
    return sd.items() if isinstance(sd, Mapping) else sd


def _put(out: dict, name: str, t: torch.Tensor) -> None:
    if name in out:
        raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint")
    out[name] = t


def deepseek_to_model(sd, n_experts: int, experts: range | None = None) -> dict[str, torch.Tensor]:
    """Stack per-expert keys ``*.ffn.experts.{e}.wK.weight [..]`` into ``*.ffn.experts.wK [E, ..]``.

    ``sd`` is a dict or an iterable of (name, tensor) pairs (tensors are copied into one preallocated
    stack per weight as they arrive, so a lazy iterable never holds two copies of a layer's experts).
    ``experts``: stack only these (an expert-parallel rank's share, [len(experts), ..]; default all).
    Keys of other experts are kept unstacked (validation reports them as unexpected; ``read_state_dict``
    never reads them); already-stacked keys pass through. A missing expert or one of a different shape
    raises CheckpointError.
    """
    want = range(n_experts) if experts is None else experts
    out: dict[str, torch.Tensor] = {}
    filled: dict[str, set[int]] = {}
    for name, t in _items(sd):
        split = split_expert_key(name)
        if split is None or split[1] not in want:
            _put(out, name, t)
            continue
        stacked, e = split
        if stacked not in filled:
            _put(out, stacked, torch.empty((len(want), *t.shape), dtype=t.dtype, device=t.device))
            filled[stacked] = set()
        buf = out[stacked]  # [E, out, in]
        if tuple(t.shape) != tuple(buf.shape[1:]) or t.dtype != buf.dtype:
            raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)} {t.dtype}; the other experts of this"
                                  f" layer have {list(buf.shape[1:])} {buf.dtype}")
        if e in filled[stacked]:
            raise CheckpointError(f"tensor {name!r} appears twice in the checkpoint")
        buf[e - want.start].copy_(t)
        filled[stacked].add(e)
    for stacked, have in filled.items():
        missing = [expert_key(stacked, e) for e in want if e not in have]
        if missing:
            raise CheckpointError(f"missing tensor(s): {', '.join(missing[:8])}"
                                  + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return out


def model_to_deepseek(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Unstack ``*.ffn.experts.wK [E, ..]`` into per-expert keys (each a contiguous copy)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if is_stacked_expert(name):
            for e in range(t.shape[0]):
                out[expert_key(name, e)] = t[e].clone()
        else:
            out[name] = t
    return out


# ------------------------------------------------------------------------------------------------
# model <-> hf
# ------------------------------------------------------------------------------------------------
def model_to_hf(sd: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Model naming -> transformers naming (``mtp.*`` keeps DeepSeek's per-expert names)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if name.startswith(MTP_PREFIX):
            out.update(model_to_deepseek({name: t}))
            continue
        m = _STACKED_KEY.match(name)
        if m is None:
            out[deepseek_to_hf_name(name)] = t
            continue
        prefix, w = m.groups()  # "layers.{i}.ffn.experts", "w1" | "w2" | "w3"
        hf_prefix = "model." + prefix.replace(".ffn.", ".mlp.")
        if w == "w2":
            out[hf_prefix + ".down_proj"] = t  # [E, d, I]
        elif w == "w1":
            if prefix + ".w3" not in sd:
                raise CheckpointError(f"missing tensor {prefix + '.w3'!r} (needed to build gate_up_proj)")
            out[hf_prefix + ".gate_up_proj"] = torch.cat([t, sd[prefix + ".w3"]], dim=1)  # [E, 2I, d]
        elif prefix + ".w1" not in sd:
            raise CheckpointError(f"missing tensor {prefix + '.w1'!r} (needed to build gate_up_proj)")
    return out


def is_fused_hf_expert(name: str) -> bool:
    """transformers' per-layer expert tensors ``mlp.experts.gate_up_proj`` / ``down_proj`` ([E, ...])."""
    return bool(_HF_EXPERTS.match(name))


def hf_items_to_deepseek(sd) -> Iterable[tuple[str, torch.Tensor]]:
    for name, t in _items(sd):
        m = _HF_EXPERTS.match(name)
        if m is None:
            yield hf_to_deepseek_name(name), t
            continue
        prefix = f"layers.{m.group(1)}.ffn.experts"
        if m.group(2) == "down_proj":
            yield prefix + ".w2", t
            continue
        if t.dim() != 3 or t.shape[1] % 2:
            raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)}; expected [E, 2*I, d]")
        inter = t.shape[1] // 2
        yield prefix + ".w1", t[:, :inter].contiguous()  # [E, I, d]
        yield prefix + ".w3", t[:, inter:].contiguous()


def hf_to_model(sd, n_experts: int) -> dict[str, torch.Tensor]:
    """transformers naming (dict or iterable of pairs) -> model naming; ``mtp.*`` per-expert keys get stacked."""
    return deepseek_to_model(hf_items_to_deepseek(sd), n_experts)


def deepseek_to_hf(sd, n_experts: int) -> dict[str, torch.Tensor]:
    """DeepSeek file naming -> transformers naming."""
    return model_to_hf(deepseek_to_model(sd, n_experts))


def hf_to_deepseek(sd, n_experts: int) -> dict[str, torch.Tensor]:
    """transformers naming -> DeepSeek file naming."""
    return model_to_deepseek(hf_to_model(sd, n_experts))
