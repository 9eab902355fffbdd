"""Reading and writing DeepSeek-V4 checkpoints (safetensors only).

``read_state_dict`` accepts DeepSeek-named (hub) and transformers-named files, single or sharded, plain or
quantised as DeepSeek ships them (FP8 block-128 linears, FP4 routed experts), and returns the model
state-dict (see ``schema.py``) validated against the config. Pickle formats are refused, never loaded.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..config import ModelConfig, load_config
from .names import (detect_naming, deepseek_to_model, hf_items_to_deepseek,
                    is_fp8_linear, is_fused_hf_expert, model_to_deepseek, model_to_hf, split_expert_key, to_deepseek_name)
from .quant import (FP4_BLOCK, FP8_BLOCK, dequant_fp4, dequant_fp8_block, is_e8m0, is_fp4_packed, quant_fp4,
                    quant_fp8_block)
from .schema import CheckpointError, tensor_dtype, validate_state_dict

__all__ = ["CheckpointError", "read_state_dict", "load_checkpoint", "write_checkpoint"]

INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
_PICKLE_EXTS = ("*.bin", "*.pt", "*.pth", "*.ckpt")
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_MTP = "mtp."


# ------------------------------------------------------------------------------------------------
# reading
# ------------------------------------------------------------------------------------------------
def _safetensors_files(checkpoint_dir: str) -> list[str]:
    """The checkpoint's safetensors files: those of the shard index if there is one, else all of them."""
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"checkpoint directory {checkpoint_dir!r} does not exist")
    index = os.path.join(checkpoint_dir, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a shard index ({type(e).__name__}: {e}); it needs a"
                                  ' "weight_map" of tensor name -> shard file') from None
        root = os.path.realpath(checkpoint_dir)
        paths = []
        for s in shards:
            p = os.path.realpath(os.path.join(checkpoint_dir, str(s)))
            if os.path.dirname(p) != root:  # a shard elsewhere on disk is never read
                raise CheckpointError(f"{INDEX_FILE} lists shard {s!r}, which is not a file of {checkpoint_dir!r}")
            paths.append(p)
        for p in paths:
            if not os.path.isfile(p):
                raise CheckpointError(f"{INDEX_FILE} lists shard {os.path.basename(p)!r},"
                                      f" which is not in {checkpoint_dir!r}")
        return paths
    paths = sorted(glob.glob(os.path.join(checkpoint_dir, "*.safetensors")))
    if paths:
        return paths
    pickles = sorted(os.path.basename(p) for e in _PICKLE_EXTS for p in glob.glob(os.path.join(checkpoint_dir, e)))
    if pickles:
        raise CheckpointError(f"{checkpoint_dir!r} holds only pickle weight files ({', '.join(pickles[:4])}); "
                              "safetensors is required (pickle files can run arbitrary code and are never loaded)."
                              " Convert them to *.safetensors with a trusted tool first.")
    raise CheckpointError(f"{checkpoint_dir!r} has no *.safetensors weight files")


def _scale_owner(name: str, names) -> str | None:
    """If ``name`` is a quantisation scale, the tensor it scales.

    ``X.scale`` -> ``X.weight`` (DeepSeek), ``Y_scale_inv`` -> ``Y`` (``X.weight_scale_inv``, other FP8 files).
    """
    if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in names:
        return name[: -len(".scale")] + ".weight"
    if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in names:
        return name[: -len("_scale_inv")]
    return None


def _decode(name: str, raw: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """One stored tensor (plus its scale, if quantised) -> ``dtype``."""
    try:
        if scale is not None and raw.dtype in _FP8_DTYPES:
            return dequant_fp8_block(raw, scale, dtype)
        if scale is not None and is_fp4_packed(raw) and raw.dim() == 2:
            return dequant_fp4(raw, scale, dtype)
    except ValueError as e:
        raise CheckpointError(f"tensor {name!r}: {e}") from None
    if scale is not None:
        raise CheckpointError(f"tensor {name!r} has a scale but dtype {raw.dtype} (not FP8 or packed FP4)")
    if raw.dtype in _FP8_DTYPES:
        raise CheckpointError(f"FP8 tensor {name!r} has no scale (expected a '.scale' or '_scale_inv' tensor)")
    if is_fp4_packed(raw) and dtype.is_floating_point:
        raise CheckpointError(f"tensor {name!r} is {raw.dtype} (packed FP4?) but has no '.scale' tensor")
    if raw.dtype.is_floating_point != dtype.is_floating_point:
        raise CheckpointError(f"tensor {name!r} is {raw.dtype}; it must be "
                              + ("floating point" if dtype.is_floating_point else "integer (expert ids)"))
    return raw.to(dtype)


class _Reader:
    """Open safetensors files; yields (file name, decoded tensor) pairs, quantisation scales consumed."""

    def __init__(self, paths: list[str], stack: contextlib.ExitStack):
        self.where: dict[str, object] = {}
        for path in paths:
            try:
                f = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            except Exception as e:  # safetensors' own error type (truncated, garbage, not safetensors)
                raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
            for name in f.keys():
                if name in self.where:
                    raise CheckpointError(f"tensor {name!r} appears in more than one safetensors file")
                self.where[name] = f
        self.scales = {}  # weight name -> scale name
        for name in self.where:
            owner = _scale_owner(name, self.where)
            if owner is not None:
                self.scales[owner] = name

    def names(self) -> list[str]:
        """Tensor names, scales excluded."""
        scale_names = set(self.scales.values())
        return [n for n in self.where if n not in scale_names]

    def _get(self, name: str, rows: range | None) -> torch.Tensor:
        """The tensor, or only its rows ``rows`` along dim 0 (read from the file as a slice)."""
        if rows is None:
            return self.where[name].get_tensor(name)
        return self.where[name].get_slice(name)[rows.start:rows.stop]

    def items(self, names, naming: str, dtype: torch.dtype, device, experts: range | None = None,
              keep_fp4: bool = False):
        """``experts``: transformers' fused expert tensors ([E, ...]) are read for these experts only.
        ``keep_fp4``: a routed expert stored as packed FP4 with e8m0 scales (DeepSeek naming) comes as its
        bytes and its scale's bytes, undecoded (``_kept_fp4``)."""
        for name in names:
            rows = experts if experts is not None and naming == "hf" and is_fused_hf_expert(name) else None
            raw = self._get(name, rows).to(device)
            scale_name = self.scales.get(name)
            scale = None if scale_name is None else self._get(scale_name, rows).to(device)
            ds_name = to_deepseek_name(name, naming)
            if keep_fp4 and naming == "deepseek" and _kept_fp4(name, raw, scale):
                yield name, raw.view(torch.uint8)
                yield scale_name, scale.view(torch.uint8)
                continue
            yield (name if naming == "hf" else ds_name), _decode(name, raw, scale, tensor_dtype(ds_name, dtype))


def _kept_fp4(name: str, raw: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """A per-expert weight the engine can keep as the file stores it: packed FP4 [out, in/2] with e8m0 scale
    bytes [out, in/32] (a float ``_scale_inv`` or another layout is decoded instead)."""
    if scale is None or split_expert_key(name) is None or raw.dim() != 2 or not is_fp4_packed(raw):
        return False
    if not (is_e8m0(scale) or scale.dtype == torch.uint8) or (2 * raw.shape[1]) % FP4_BLOCK:
        return False
    if tuple(scale.shape) != (raw.shape[0], 2 * raw.shape[1] // FP4_BLOCK):
        raise CheckpointError(f"tensor {name!r}: FP4 scale has shape {list(scale.shape)}; packed weight"
                              f" {list(raw.shape)} needs {[raw.shape[0], 2 * raw.shape[1] // FP4_BLOCK]}")
    return True


def _other_expert(name: str, n_experts: int, experts: range) -> bool:
    """A per-expert tensor (DeepSeek naming) of a routed expert outside ``experts``."""
    split = split_expert_key(name)
    return split is not None and split[1] < n_experts and split[1] not in experts


def read_state_dict(checkpoint_dir: str, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                    device="cpu", with_mtp: bool | None = None, experts: range | None = None,
                    keep_fp4: bool = False) -> tuple[dict[str, torch.Tensor], bool]:
    """Read a checkpoint directory into the model state-dict; returns (state_dict, has_mtp).

    * Files: ``*.safetensors``, single or sharded (``model.safetensors.index.json``); pickle is refused.
    * Naming: DeepSeek's or transformers', detected from the names; routed experts come back stacked.
    * Quantised tensors (FP8 + ``.scale`` / ``.weight_scale_inv``, packed FP4 + ``.scale``) are decoded to
      ``dtype``; hc_*, attn_sink, ape and gate.bias are float32 whatever ``dtype``; tid2eid is int64.
    * with_mtp: None = load the MTP layer if the file has one; False = skip ``mtp.*``; True = require it.
      A file without any ``mtp.*`` tensor gives has_mtp=False; a partial MTP layer is an error.
    * experts: only these routed experts are read (an expert-parallel rank's share; the stacked tensors
      are then [len(experts), ...], expert ``experts.start`` first); the other experts' bytes are never read.
    * keep_fp4: routed experts the file holds as packed FP4 with e8m0 scales (DeepSeek naming) stay so,
      stacked as the engine's ``fp4`` expert format keeps them (``w1`` [E, I, d/2] bytes and ``w1_scale``
      [E, I, d/32]), not decoded; other experts are decoded as usual.
    Any missing, unexpected or mis-shaped tensor raises CheckpointError naming it.
    """
    E = cfg.n_routed_experts
    if experts is not None and not (0 <= experts.start < experts.stop <= E and experts.step == 1):
        raise ValueError(f"experts={experts!r} is not a contiguous range inside 0..{E - 1}")
    with contextlib.ExitStack() as stack:
        reader = _Reader(_safetensors_files(checkpoint_dir), stack)
        names = reader.names()
        naming = detect_naming(names)
        has_mtp = _resolve_mtp(cfg, any(n.startswith(_MTP) for n in names), with_mtp)
        names = [n for n in names if (has_mtp or not n.startswith(_MTP))
                 and not (experts is not None and _other_expert(to_deepseek_name(n, naming), E, experts))]
        items = reader.items(names, naming, dtype, device, experts, keep_fp4=keep_fp4)
        pairs = hf_items_to_deepseek(items) if naming == "hf" else items
        state_dict = deepseek_to_model(pairs, E, experts)
    validate_state_dict(state_dict, cfg, with_mtp=has_mtp, num_experts=None if experts is None else len(experts))
    return state_dict, has_mtp


def _resolve_mtp(cfg: ModelConfig, file_has_mtp: bool, with_mtp: bool | None) -> bool:
    if with_mtp is False:
        return False
    if with_mtp and not cfg.has_mtp:
        raise CheckpointError("with_mtp=True but the config has no MTP layer (num_nextn_predict_layers = 0)")
    if file_has_mtp and not cfg.has_mtp:
        raise CheckpointError("the checkpoint has MTP tensors (mtp.*) but the config has no MTP layer"
                              " (num_nextn_predict_layers = 0); pass with_mtp=False to skip them")
    return bool(with_mtp) or file_has_mtp


def load_checkpoint(checkpoint_dir: str, dtype: torch.dtype = torch.float32, device="cpu",
                    with_mtp: bool | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor], bool]:
    """config.json + weights of a checkpoint directory: (cfg, state_dict in model naming, has_mtp)."""
    cfg = load_config(checkpoint_dir)
    state_dict, has_mtp = read_state_dict(checkpoint_dir, cfg, dtype, device, with_mtp)
    return cfg, state_dict, has_mtp


# ------------------------------------------------------------------------------------------------
# writing
# ------------------------------------------------------------------------------------------------
# DeepSeek file names of the routed experts shipped as FP4 (the FP8 linears: names.is_fp8_linear).
_FP4_NAME = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")

QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "activation_scheme": "dynamic",
                       "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}


def _quantize_deepseek(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek-named tensors -> the shipped layout: FP8 linears and FP4 experts, each with ``X.scale``."""
    out = {}
    for name, t in tensors.items():
        quant = quant_fp8_block if is_fp8_linear(name) else quant_fp4 if _FP4_NAME.search(name) else None
        if quant is None:
            out[name] = t
            continue
        q, scale = quant(t)
        out[name] = q
        out[name[: -len(".weight")] + ".scale"] = scale
    return out


def _file_tensors(cfg: ModelConfig, state_dict, naming: str, quantize: str | None) -> dict[str, torch.Tensor]:
    if naming == "hf":
        if quantize is not None:
            raise ValueError("quantize is supported for naming='deepseek' only (the layout DeepSeek ships)")
        return model_to_hf(state_dict)  # tid2eid stays int64 (a transformers buffer)
    if naming != "deepseek":
        raise ValueError(f"naming must be 'deepseek' or 'hf', got {naming!r}")
    tensors = model_to_deepseek(state_dict)
    tensors = {k: v.to(torch.int32) if k.endswith(".tid2eid") else v for k, v in tensors.items()}
    if quantize == "fp8":
        return _quantize_deepseek(tensors)
    if quantize is not None:
        raise ValueError(f"quantize must be None or 'fp8', got {quantize!r}")
    return tensors


def _config_dict(cfg: ModelConfig, naming: str, quantize: str | None, weight_dtype: torch.dtype) -> dict:
    d = cfg.to_hf_dict() if naming == "hf" else cfg.to_official_dict()
    d["model_type"] = "deepseek_v4"
    d["torch_dtype"] = str(weight_dtype).removeprefix("torch.")
    if quantize == "fp8":
        d["quantization_config"] = dict(QUANTIZATION_CONFIG)
        d["expert_dtype"] = "fp4"
    return d


def write_checkpoint(out_dir: str, cfg: ModelConfig, state_dict: dict[str, torch.Tensor], naming: str = "deepseek",
                     quantize: str | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` for a model-named state-dict.

    naming="deepseek": DeepSeek's file layout (per-expert keys, tid2eid int32, official config.json);
    naming="hf": transformers' names (fused experts, MTP under ``mtp.0.*``) and its config.json form.
    quantize="fp8" (deepseek naming only): linears as FP8 block-128 and routed experts as FP4, each with an
    e8m0 ``.scale``, as DeepSeek ships them. The state-dict is validated against the config first
    (the MTP layer is written when it has ``mtp.*`` tensors).
    """
    has_mtp = any(k.startswith(_MTP) for k in state_dict)
    validate_state_dict(state_dict, cfg, with_mtp=has_mtp)
    tensors = _file_tensors(cfg, state_dict, naming, quantize)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(_config_dict(cfg, naming, quantize, state_dict["embed.weight"].dtype), f, indent=2)
        f.write("\n")
