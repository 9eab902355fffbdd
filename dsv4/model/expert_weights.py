"""The routed experts' stacked weights in one of two formats (the engine's ``moe_config.expert_format``):

* ``dequantized`` (the default): w1/w3 [E, I, d] and w2 [E, d, I] as parameters in the model's dtype (a
  checkpoint's FP4 experts are decoded at load);
* ``fp4``: the checkpoint's own format kept on the device: w1/w3 [E, I, d/2], w2 [E, d, I/2] as packed e2m1
  bytes (lower nibble the even input) with ``w1_scale`` ... [E, out, in/32] e8m0 scale bytes, a quarter of the
  bf16 bytes plus 1/64 for the scales. The grouped GEMM decodes them in its inner loop (weight-only: the products
  are the dequantised weights' products, exact in bf16), the CPU loop decodes one expert at a time.

The format travels with the state dict: a checkpoint's FP4 experts are read as the file stores them (DeepSeek
naming, e8m0 scales: no decode), ``pack_experts`` packs any others (a bf16 checkpoint, a preset's random draw),
and a model built from such a state dict switches its expert modules to the packed layout (``adopt_layout``)
before adopting the tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from ..checkpoint.names import is_stacked_expert
from ..checkpoint.quant import FP4_BLOCK, pack_fp4_stacked
from ..kernels.fp4 import unpack_fp4

EXPERT_FORMATS = ("dequantized", "fp4")
NAMES = ("w1", "w2", "w3")
SCALE_SUFFIX = "_scale"


class StackedExperts(nn.Module):
    """Base of the routed-expert modules (``Experts``, the parallel ``ParallelExperts``): w1/w3 [E, I, d] and
    w2 [E, d, I], as parameters or, after ``use_fp4``, packed FP4 buffers with their scales."""

    fp4 = False
    fold = False  # every scale byte allows the tensor-core GEMM's one-product decode (``note_scales``)

    def _make_weights(self, E: int, inter: int, d: int) -> None:
        self.w1 = nn.Parameter(torch.empty(E, inter, d))
        self.w2 = nn.Parameter(torch.empty(E, d, inter))
        self.w3 = nn.Parameter(torch.empty(E, inter, d))

    def use_fp4(self) -> None:
        """Switch to the packed layout (on the meta device, before a packed state dict is adopted)."""
        if self.fp4:
            return
        for name in NAMES:
            E, rows, cols = getattr(self, name).shape
            device = getattr(self, name).device
            del self._parameters[name]
            self.register_buffer(name, torch.empty(E, rows, cols // 2, dtype=torch.uint8, device=device))
            self.register_buffer(name + SCALE_SUFFIX, torch.empty(E, rows, cols // FP4_BLOCK, dtype=torch.uint8,
                                                                   device=device))
        self.fp4 = True

    def note_scales(self) -> None:
        """After loading: whether every scale byte of the packed weights is at most
        ``kernels.fp4_gemv.FOLD_MAX_SCALE`` (``fold``; one read of the bytes, a host sync)."""
        from ..kernels.fp4_gemv import fold_scales  # lazy: kernels import model.ops

        self.fold = self.fp4 and fold_scales(*self.scales())

    def expert_weight(self, name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert ``e``'s ``name`` weight [out, in] in ``dtype`` (decoded when packed): the CPU loop's operand."""
        w = getattr(self, name)[e]
        if not self.fp4:
            return w
        return unpack_fp4(w, getattr(self, name + SCALE_SUFFIX)[e], dtype)

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert ``e``'s (w1, w2, w3) in ``dtype`` (``expert_weight`` of each)."""
        return tuple(self.expert_weight(n, e, dtype) for n in NAMES)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(w1, w2, w3) scale bytes for the grouped GEMM, None when the weights are not packed."""
        return tuple(getattr(self, n + SCALE_SUFFIX) for n in NAMES) if self.fp4 else None


def is_scale_key(name: str) -> bool:
    return name.endswith(SCALE_SUFFIX) and is_stacked_expert(name[: -len(SCALE_SUFFIX)])


def is_expert_tensor(name: str) -> bool:
    """A stacked routed-expert tensor [E, ...]: a weight, or the scale of a packed one."""
    return is_stacked_expert(name) or is_scale_key(name)


def is_packed(state_dict: dict) -> bool:
    """Whether a model-named state dict holds packed routed experts."""
    return any(is_scale_key(k) for k in state_dict)


def check_fp4_shapes(hidden_size: int, inter: int, where: str = "") -> None:
    """Packed experts need whole scale blocks along every input width: d and the (per-rank) I."""
    for what, n in (("hidden_size", hidden_size), (f"moe_inter_dim{where}", inter)):
        if n % FP4_BLOCK:
            raise ValueError(f"moe_config.expert_format 'fp4' needs {what} to be a multiple of {FP4_BLOCK}"
                             f" (got {n}); use expert_format 'dequantized' for this model")


def pack_experts(state_dict: dict) -> dict:
    """The stacked routed experts of a model-named state dict as packed FP4 (``pack_fp4_stacked``), each with
    its ``_scale`` tensor; one tensor at a time, its dequantised form released as it goes. Experts read packed
    already (``read_state_dict(keep_fp4=True)``: they have their ``_scale``) and all other tensors unchanged."""
    out = {}
    for name in list(state_dict):
        t = state_dict.pop(name)
        kept = name + SCALE_SUFFIX in state_dict or name + SCALE_SUFFIX in out  # read packed already
        out.update({name: t} if kept else pack_tensor(name, t))
    return out


def pack_tensor(name: str, t: torch.Tensor) -> dict:
    """{name: t}, or for a stacked routed-expert weight its packed bytes and ``_scale``."""
    if not is_stacked_expert(name):
        return {name: t}
    packed, scale = pack_fp4_stacked(t)
    return {name: packed, name + SCALE_SUFFIX: scale}


def adopt_layout(model: nn.Module, state_dict: dict) -> None:
    """Before ``load_state_dict``: a packed state dict switches every expert module to the packed layout."""
    if is_packed(state_dict):
        for m in model.modules():
            if isinstance(m, StackedExperts):
                m.use_fp4()
