"""The cache's shape: which layers hold which state, and how many rows each ring and block has.

Everything here is derived from the model config plus two engine settings (``max_draft_len``,
``tokens_per_block``) and validated once, at construction (R7): a setting that would make the index
arithmetic of ``plan.py`` wrong is refused here with a message that says what to change.

Units: ``*_cap`` are ring capacities in tokens (rows per request), ``entries_per_block`` counts compressed
entries (one per ``r`` tokens) held by one block of ``tokens_per_block`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsv4.config import ModelConfig, kind_spec


class CacheConfigError(ValueError):
    """A cache setting that cannot work with this model; the message says which value to change."""


@dataclass(frozen=True)
class CacheLayout:
    cfg: ModelConfig
    max_draft_len: int
    tokens_per_block: int

    def __post_init__(self):
        tpb, ratios = self.tokens_per_block, self.cfg.ratios
        if not isinstance(tpb, int) or tpb <= 0:
            raise CacheConfigError(f"tokens_per_block must be a positive int, got {tpb!r}")
        bad = [r for r in ratios if tpb % r]
        if bad:
            lcm = 1
            for r in ratios:
                lcm = lcm * r // _gcd(lcm, r)
            raise CacheConfigError(
                f"tokens_per_block={tpb} is not a multiple of the compress ratio(s) {bad} of this model "
                f"(ratios {ratios}); a block must hold whole compressed entries: use a multiple of {lcm}")
        if not isinstance(self.max_draft_len, int) or self.max_draft_len < 0:
            raise CacheConfigError(f"max_draft_len must be an int >= 0, got {self.max_draft_len!r}")
        if self.max_draft_len > 0 and not self.cfg.has_mtp:
            raise CacheConfigError(
                f"max_draft_len={self.max_draft_len} needs an MTP layer, but this model has "
                "num_nextn_predict_layers=0; set max_draft_len=0 (speculative decoding off)")

    # ---- sizes shared by all layers ------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.cfg.head_dim

    @property
    def index_head_dim(self) -> int:
        return self.cfg.index_head_dim

    @property
    def window(self) -> int:
        return self.cfg.window_size

    @property
    def swa_cap(self) -> int:
        """Rows of one request's SWA ring (every main layer and the MTP layer): window + max_draft_len (R4)."""
        return self.cfg.window_size + self.max_draft_len

    @property
    def num_swa_layers(self) -> int:
        """Main layers plus the MTP layer; the MTP layer is SWA layer ``cfg.num_layers`` (R1)."""
        return self.cfg.num_layers + self.cfg.num_mtp_layers

    @property
    def mtp_layer(self) -> int | None:
        """SWA layer index of the MTP layer, or None without one."""
        return self.cfg.num_layers if self.cfg.has_mtp else None

    @property
    def ratios(self) -> tuple[int, ...]:
        return self.cfg.ratios

    # ---- per compress ratio ----------------------------------------------------------------------------
    def _check_ratio(self, r: int) -> None:
        if r not in self.cfg.ratios:
            raise KeyError(f"compress ratio {r} is not used by this model (ratios {self.cfg.ratios})")

    def coff(self, r: int) -> int:
        """2 for the overlapping CSA compressor (ratio 4), 1 for HCA (``config.kind_spec``)."""
        self._check_ratio(r)
        return kind_spec(r).coff

    def state_cap(self, r: int) -> int:
        """Rows of one request's compressor-state ring: coff*r + max_draft_len (R4)."""
        return self.coff(r) * r + self.max_draft_len

    @staticmethod
    def step_base(cap: int, num_slots: int) -> int:
        """Rows of a per-slot ring of ``cap`` rows (null slot 0 included): in a step plan's combined index
        space, indices at or above this are the step's own rows (plan.py)."""
        return (num_slots + 1) * cap

    def entries_per_block(self, r: int) -> int:
        self._check_ratio(r)
        return self.tokens_per_block // r

    def compressed_layers(self, r: int) -> tuple[int, ...]:
        """Main layer ids with compress ratio ``r``."""
        self._check_ratio(r)
        return tuple(i for i, x in enumerate(self.cfg.compress_ratios) if x == r)

    @property
    def all_compressed_layers(self) -> tuple[int, ...]:
        return tuple(i for i, x in enumerate(self.cfg.compress_ratios) if x > 0)

    @property
    def csa_layers(self) -> tuple[int, ...]:
        """Layers with the overlapping ratio-4 compressor and a lightning indexer."""
        return tuple(i for i, x in enumerate(self.cfg.compress_ratios) if kind_spec(x).has_indexer)

    def ratio_of(self, layer: int) -> int:
        return self.cfg.compress_ratios[layer]

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks that cover positions [0, num_tokens)."""
        return -(-num_tokens // self.tokens_per_block)


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a
