"""The model configuration: one frozen dataclass, one adapter from a checkpoint's ``config.json``.

Two ``config.json`` forms exist in the wild and both are read here:

* the official one shipped with DeepSeek's checkpoints: ``compress_ratios`` (one entry per layer, plus a
  trailing entry for the MTP layer), ``num_hash_layers``, ``qk_rope_head_dim``, ``rope_scaling``;
* transformers' ``DeepseekV4Config``: ``layer_types`` + ``compress_rates``, ``mlp_layer_types``,
  ``partial_rotary_factor``, ``rope_parameters`` (flat, or nested ``{"main": ..., "compress": ...}``).

Both are normalised once, here, into ``ModelConfig.compress_ratios`` (one int per main layer) from which
the per-layer kinds (``"swa"``, ``"csa"``, ``"hca"``) are derived. Nothing downstream reads the raw dicts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field

SWA, CSA, HCA = "swa", "csa", "hca"

# transformers' layer-type names <-> ours
_HF_LAYER_TYPES = {
    "sliding_attention": SWA,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}


class ConfigError(ValueError):
    """A config.json or preset that cannot describe a DeepSeek-V4 model; the message names the key."""


@dataclass(frozen=True)
class YarnScaling:
    """YaRN frequency interpolation of the compressed layers' RoPE (no attention-magnitude factor)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    # One compress ratio per main layer: 0 = sliding window only, 4 = CSA (overlapping compressor +
    # lightning indexer), anything else > 0 = HCA (non-overlapping compressor, all entries visible).
    compress_ratios: tuple[int, ...]
    num_mtp_layers: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_experts_per_tok: int
    n_shared_experts: int
    moe_inter_dim: int
    route_scale: float
    num_hash_layers: int
    swiglu_limit: float
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnScaling | None = field(default_factory=YarnScaling)
    max_position_embeddings: int = 1048576
    score_func: str = "sqrtsoftplus"
    bos_token_id: int = 0
    eos_token_id: int = 1
    # DeepSeek's code clamps the routed experts only; transformers also clamps the shared expert.
    shared_expert_clamp: bool = False

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ConfigError(msg)

        need(len(self.compress_ratios) == self.num_layers,
             f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_layers} layers")
        need(all(r >= 0 for r in self.compress_ratios), f"compress ratios must be >= 0, got {self.compress_ratios}")
        need(self.head_dim % 2 == 0 and 0 < self.rope_dim <= self.head_dim and self.rope_dim % 2 == 0,
             f"rope_dim ({self.rope_dim}) must be even and <= head_dim ({self.head_dim})")
        need(self.num_heads % self.o_groups == 0,
             f"num_heads ({self.num_heads}) must be divisible by o_groups ({self.o_groups})")
        need(self.n_experts_per_tok <= self.n_routed_experts,
             f"n_experts_per_tok ({self.n_experts_per_tok}) > n_routed_experts ({self.n_routed_experts})")
        need(self.n_shared_experts in (0, 1), f"n_shared_experts must be 0 or 1, got {self.n_shared_experts}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "window_size",
                     "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts", "n_experts_per_tok",
                     "moe_inter_dim", "hc_mult", "q_lora_rank", "o_lora_rank", "o_groups"):
            need(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        need(0 <= self.eos_token_id < self.vocab_size,
             f"eos_token_id {self.eos_token_id} is outside the vocabulary [0, {self.vocab_size})")
        need(self.max_position_embeddings >= 2,
             f"max_position_embeddings must be >= 2, got {self.max_position_embeddings}")
        need(self.score_func in ("sqrtsoftplus", "sigmoid", "softmax"), f"unknown scoring_func {self.score_func!r}")
        need(0 <= self.num_hash_layers <= self.num_layers,
             f"num_hash_layers ({self.num_hash_layers}) outside 0..{self.num_layers}")
        need(self.num_mtp_layers in (0, 1), f"num_nextn_predict_layers must be 0 or 1, got {self.num_mtp_layers}")
        need(self.hc_mult >= 1, "hc_mult must be >= 1")

    # ---- derived values -------------------------------------------------------------------------
    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(kind_of_ratio(r) for r in self.compress_ratios)

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def ratios(self) -> tuple[int, ...]:
        """The distinct non-zero compress ratios, sorted."""
        return tuple(sorted({r for r in self.compress_ratios if r > 0}))

    @property
    def has_mtp(self) -> bool:
        return self.num_mtp_layers > 0

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ---- serialisation -------------------------------------------------------------------------
    def to_official_dict(self) -> dict:
        """The official (DeepSeek hub) ``config.json`` form, trailing MTP ratio included."""
        d = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window_size,
            "compress_ratios": list(self.compress_ratios) + [0] * self.num_mtp_layers,
            "compress_rope_theta": self.compress_rope_theta,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.n_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_inter_dim,
            "scoring_func": self.score_func,
            "topk_method": "noaux_tc",
            "norm_topk_prob": True,
            "routed_scaling_factor": self.route_scale,
            "num_hash_layers": self.num_hash_layers,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.norm_eps,
            "num_nextn_predict_layers": self.num_mtp_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
        }
        if self.yarn is not None:
            d["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.yarn)}
        if self.shared_expert_clamp:
            d["dsv4_shared_expert_clamp"] = True
        return d

    def to_hf_dict(self) -> dict:
        """transformers' ``DeepseekV4Config`` keyword form (layer_types / compress_rates / rope_parameters)."""
        names = {v: k for k, v in _HF_LAYER_TYPES.items()}
        hca_rates = {r for r in self.compress_ratios if r > 0 and r != 4}
        if len(hca_rates) > 1:
            raise ConfigError(f"transformers supports one HCA rate, this config has {sorted(hca_rates)}")
        d = self.to_official_dict()
        for k in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "topk_method",
                  "dsv4_shared_expert_clamp"):
            d.pop(k, None)
        d["layer_types"] = [names[k] for k in self.layer_kinds]
        d["compress_rates"] = {"compressed_sparse_attention": 4,
                               "heavily_compressed_attention": hca_rates.pop() if hca_rates else 128}
        d["mlp_layer_types"] = ["hash_moe" if self.is_hash_layer(i) else "moe" for i in range(self.num_layers)]
        d["partial_rotary_factor"] = self.rope_dim / self.head_dim
        if self.yarn is not None:
            d["rope_parameters"] = {"rope_type": "yarn", **dataclasses.asdict(self.yarn)}
        return d


CSA_RATIO = 4  # the compress ratio of compressed sparse attention (overlapping windows, a lightning indexer)


@dataclass(frozen=True)
class KindSpec:
    """What a layer kind needs, derived once from its compress ratio; the model, the checkpoint schema and the
    cache read it here instead of testing the ratio again.

    coff: compressor rows per token (CSA's windows overlap, so each token emits two halves; HCA's one; 0 for
    SWA, which has no compressor). has_indexer: a lightning indexer picks the entries each query sees (CSA)."""

    kind: str
    ratio: int
    coff: int
    has_indexer: bool


def kind_spec(ratio: int) -> KindSpec:
    if ratio == 0:
        return KindSpec(SWA, 0, 0, False)
    csa = ratio == CSA_RATIO
    return KindSpec(CSA if csa else HCA, ratio, 2 if csa else 1, csa)


def kind_of_ratio(ratio: int) -> str:
    return kind_spec(ratio).kind


# ------------------------------------------------------------------------------------------------
# config.json adapter
# ------------------------------------------------------------------------------------------------
def from_config_dict(raw: dict) -> ModelConfig:
    """Normalise an official or transformers-style config dict (see module docstring)."""
    d = dict(raw)
    if d.get("model_type", "deepseek_v4") != "deepseek_v4":
        raise ConfigError(f"model_type is {d.get('model_type')!r}; this engine runs deepseek_v4 only")

    def get(*names, default=None, required=True):
        for n in names:
            if n in d and d[n] is not None:
                return d[n]
        if required and default is None:
            raise ConfigError(f"config.json has no {names[0]!r}")
        return default

    def iget(*names, default=None, required=True) -> int:
        """An integer field: 64 or 64.0, never 64.9, "64" or true."""
        v = get(*names, default=default, required=required)
        if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, float) and v.is_integer())):
            raise ConfigError(f"config.json: {names[0]!r} must be an integer, got {v!r}")
        return int(v)

    def fget(*names, default=None, required=True) -> float:
        v = get(*names, default=default, required=required)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"config.json: {names[0]!r} must be a number, got {v!r}")
        return float(v)

    n_layers = iget("num_hidden_layers", "n_layers")
    n_mtp = iget("num_nextn_predict_layers", "n_mtp_layers", default=0, required=False)

    # ---- per-layer compress ratios
    if d.get("compress_ratios") is not None:
        ratios = [int(r) for r in d["compress_ratios"]]
        if len(ratios) == n_layers + n_mtp:
            main, mtp = ratios[:n_layers], ratios[n_layers:]
            if any(r != 0 for r in mtp):
                raise ConfigError(f"compress_ratios: the MTP layer entries must be 0, got {mtp}")
        elif len(ratios) == n_layers:
            main = ratios
        else:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries; expected {n_layers} layers"
                              f" (+{n_mtp} MTP)")
    elif d.get("layer_types") is not None:
        types = list(d["layer_types"])[:n_layers]
        if len(types) != n_layers:
            raise ConfigError(f"layer_types has {len(types)} entries for {n_layers} layers")
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        rates.update(d.get("compress_rates") or {})
        if "compress_rate_csa" in d:
            rates["compressed_sparse_attention"] = d["compress_rate_csa"]
        if "compress_rate_hca" in d:
            rates["heavily_compressed_attention"] = d["compress_rate_hca"]
        main = []
        for t in types:
            if t not in _HF_LAYER_TYPES:
                raise ConfigError(f"layer_types entry {t!r} is not one of {sorted(_HF_LAYER_TYPES)}")
            main.append(0 if t == "sliding_attention" else int(rates[t]))
        if rates["compressed_sparse_attention"] != 4:
            raise ConfigError("compress_rates['compressed_sparse_attention'] must be 4 (the overlapping CSA"
                              f" compressor is defined for ratio 4), got {rates['compressed_sparse_attention']}")
    else:
        raise ConfigError("config.json has neither 'compress_ratios' (official) nor 'layer_types' (transformers)")
    for i, r in enumerate(main):
        if kind_of_ratio(r) == HCA and r < 2:
            raise ConfigError(f"layer {i}: compress ratio {r} is not supported")

    # ---- hash layers
    if d.get("num_hash_layers") is not None:
        n_hash = int(d["num_hash_layers"])
    elif d.get("mlp_layer_types") is not None:
        kinds = list(d["mlp_layer_types"])[:n_layers]
        n_hash = sum(1 for k in kinds if k == "hash_moe")
        if kinds[:n_hash] != ["hash_moe"] * n_hash:
            raise ConfigError("mlp_layer_types: hash_moe layers must come first")
    else:
        n_hash = 3

    # ---- rope
    head_dim = iget("head_dim")
    if d.get("qk_rope_head_dim") is not None:
        rope_dim = int(d["qk_rope_head_dim"])
    elif d.get("partial_rotary_factor") is not None:
        rope_dim = int(round(head_dim * float(d["partial_rotary_factor"])))
    else:
        rope_dim = 64
    rope_theta = fget("rope_theta", default=10000.0, required=False)
    compress_theta = fget("compress_rope_theta", default=160000.0, required=False)
    scaling = d.get("rope_scaling")
    rp = d.get("rope_parameters")
    if isinstance(rp, dict):
        if isinstance(rp.get("compress"), dict):
            main_rp, comp_rp = rp.get("main") or {}, rp["compress"]
            rope_theta = float(main_rp.get("rope_theta", rope_theta))
            compress_theta = float(comp_rp.get("rope_theta", compress_theta))
            if "partial_rotary_factor" in comp_rp and d.get("qk_rope_head_dim") is None:
                rope_dim = int(round(head_dim * float(comp_rp["partial_rotary_factor"])))
            scaling = comp_rp
        else:
            scaling = rp
    yarn = None
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "yarn":
            yarn = YarnScaling(
                factor=float(scaling.get("factor", 16.0)),
                original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 65536)),
                beta_fast=float(scaling.get("beta_fast", 32.0)),
                beta_slow=float(scaling.get("beta_slow", 1.0)),
            )
            if scaling.get("mscale") not in (None, 1, 1.0, 0) or scaling.get("attention_factor") not in (None, 1, 1.0):
                raise ConfigError("rope_scaling: DeepSeek-V4 uses YaRN without an attention (mscale) factor")
        elif kind != "default":
            raise ConfigError(f"rope_scaling type {kind!r} is not supported (yarn or none)")

    if iget("num_key_value_heads", default=1, required=False) != 1:
        raise ConfigError("num_key_value_heads must be 1 (DeepSeek-V4 has a single shared K=V head)")

    eos = get("eos_token_id", default=1, required=False)
    if isinstance(eos, list):
        eos = eos[0]
    return ModelConfig(
        vocab_size=iget("vocab_size"),
        hidden_size=iget("hidden_size", "dim"),
        num_layers=n_layers,
        num_heads=iget("num_attention_heads", "n_heads"),
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=iget("q_lora_rank"),
        o_groups=iget("o_groups"),
        o_lora_rank=iget("o_lora_rank"),
        window_size=iget("sliding_window", "window_size"),
        compress_ratios=tuple(main),
        num_mtp_layers=n_mtp,
        index_n_heads=iget("index_n_heads"),
        index_head_dim=iget("index_head_dim"),
        index_topk=iget("index_topk"),
        n_routed_experts=iget("n_routed_experts"),
        n_experts_per_tok=iget("num_experts_per_tok", "n_activated_experts"),
        n_shared_experts=iget("n_shared_experts", default=1, required=False),
        moe_inter_dim=iget("moe_intermediate_size", "moe_inter_dim"),
        route_scale=fget("routed_scaling_factor", "route_scale", default=1.0, required=False),
        num_hash_layers=n_hash,
        swiglu_limit=fget("swiglu_limit", default=0.0, required=False),
        hc_mult=iget("hc_mult", default=4, required=False),
        hc_sinkhorn_iters=iget("hc_sinkhorn_iters", default=20, required=False),
        hc_eps=fget("hc_eps", default=1e-6, required=False),
        norm_eps=fget("rms_norm_eps", "norm_eps", default=1e-6, required=False),
        rope_theta=rope_theta,
        compress_rope_theta=compress_theta,
        yarn=yarn,
        max_position_embeddings=iget("max_position_embeddings", default=1048576, required=False),
        score_func=str(get("scoring_func", "score_func", default="sqrtsoftplus", required=False)),
        bos_token_id=iget("bos_token_id", default=0, required=False),
        eos_token_id=int(eos),
        shared_expert_clamp=bool(d.get("dsv4_shared_expert_clamp", False)),
    )


def load_config(checkpoint_dir: str) -> ModelConfig:
    path = os.path.join(checkpoint_dir, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{checkpoint_dir!r} has no config.json; pass a checkpoint directory or a preset name"
                          f" ({', '.join(PRESET_NAMES)})")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a JSON object of settings, got {type(raw).__name__}")
    return from_config_dict(raw)


# ------------------------------------------------------------------------------------------------
# presets
# ------------------------------------------------------------------------------------------------
def _tiny(hca_ratio: int) -> ModelConfig:
    # The model doc's tiny config: one layer of each kind (SWA, CSA, HCA, CSA), hash + scored MoE, MTP.
    return ModelConfig(
        vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, head_dim=32, rope_dim=8, q_lora_rank=32,
        o_groups=2, o_lora_rank=16, window_size=8, compress_ratios=(0, 4, hca_ratio, 4), num_mtp_layers=1,
        index_n_heads=16, index_head_dim=16, index_topk=3, n_routed_experts=8, n_experts_per_tok=2,
        n_shared_experts=1, moe_inter_dim=32, route_scale=1.5, num_hash_layers=1, swiglu_limit=10.0,
        yarn=YarnScaling(factor=16.0, original_max_position_embeddings=64, beta_fast=32.0, beta_slow=1.0),
        max_position_embeddings=4096,
    )


FLASH = ModelConfig(
    vocab_size=129280, hidden_size=4096, num_layers=43, num_heads=64, head_dim=512, rope_dim=64,
    q_lora_rank=1024, o_groups=8, o_lora_rank=1024, window_size=128,
    compress_ratios=(0, 0) + (4, 128) * 20 + (4,), num_mtp_layers=1, index_n_heads=64, index_head_dim=128,
    index_topk=512, n_routed_experts=256, n_experts_per_tok=6, n_shared_experts=1, moe_inter_dim=2048,
    route_scale=1.5, num_hash_layers=3, swiglu_limit=10.0,
)

PRO = FLASH.replace(
    hidden_size=7168, num_layers=61, num_heads=128, q_lora_rank=1536, o_groups=16,
    compress_ratios=(128, 128) + (4, 128) * 29 + (4,), index_topk=1024, n_routed_experts=384,
    moe_inter_dim=3072, route_scale=2.5,
)


def flash_reduced(num_layers: int = 4, num_experts: int = 32) -> ModelConfig:
    """Flash's per-layer dimensions with fewer layers and experts (for benchmarks on one GPU).

    Layer pattern: one SWA-only layer, then CSA / HCA alternating (every kind present from 3 layers on);
    one hash layer; experts per token stays 6.
    """
    if num_layers < 1 or num_experts < FLASH.n_experts_per_tok:
        raise ConfigError(f"flash_reduced needs >= 1 layer and >= {FLASH.n_experts_per_tok} experts")
    ratios = (0,) + tuple(4 if i % 2 == 0 else 128 for i in range(num_layers - 1))
    return FLASH.replace(num_layers=num_layers, compress_ratios=ratios, n_routed_experts=num_experts,
                         num_hash_layers=min(1, num_layers))


PRESETS = {
    "tiny": lambda: _tiny(16),
    "tiny-r128": lambda: _tiny(128),
    "flash": lambda: FLASH,
    "pro": lambda: PRO,
}
PRESET_NAMES = tuple(PRESETS) + ("flash-L<layers>-E<experts>", "flash-E<experts>")
_REDUCED = re.compile(r"^flash-L(\d+)-E(\d+)$")
_FULL_DEPTH = re.compile(r"^flash-E(\d+)$")  # Flash's own 43 layers (layer kinds, hash layers, MTP), fewer experts


def is_preset(name: str) -> bool:
    return name in PRESETS or bool(_REDUCED.match(name) or _FULL_DEPTH.match(name))


def is_checkpoint_dir(name: str) -> bool:
    """Whether ``name`` names a checkpoint directory: a directory, unless it is a preset's bare name (the preset
    wins whatever the working directory holds; ``./tiny`` names the directory)."""
    return os.path.isdir(name) and not is_preset(name)


def get_preset(name: str) -> ModelConfig:
    """``tiny`` (HCA ratio 16), ``tiny-r128``, ``flash``, ``pro``, ``flash-L4-E32`` (reduced Flash: its layer
    dimensions, fewer layers and experts) or ``flash-E128`` (Flash's whole layer stack with fewer experts: with
    ``moe_config.expert_format: fp4`` it fits one H200, about 75 GB of experts and 15 GB of the rest in bf16;
    all 256 experts are 151 GB in FP4)."""
    if name in PRESETS:
        return PRESETS[name]()
    m = _REDUCED.match(name)
    if m:
        return flash_reduced(int(m.group(1)), int(m.group(2)))
    m = _FULL_DEPTH.match(name)
    if m:
        if int(m.group(1)) < FLASH.n_experts_per_tok:
            raise ConfigError(f"{name}: needs >= {FLASH.n_experts_per_tok} experts")
        return FLASH.replace(n_routed_experts=int(m.group(1)))
    raise ConfigError(f"unknown preset {name!r}; known: {', '.join(PRESET_NAMES)}")
