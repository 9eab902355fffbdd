"""Which rank holds which part of the model: the parallel mapping, validated once (R7).

The world is ``max(tp, ep)`` ranks (``pipeline_parallel_size`` must be 1). Per rank ``r``:

* attention: with ``tp == world`` (and attention DP off) the heads are split in ``tp`` contiguous shares
  of whole output groups (``wq_b`` rows, ``attn_sink``, ``wo_a`` groups, ``wo_b`` input columns) and the
  partial outputs are summed after ``wo_b``; the single shared K=V head (``wkv``, ``kv_norm``), ``wq_a`` /
  ``q_norm``, the compressors and the indexer are replicated. With ``tp == 1`` attention is replicated.
* attention data parallel (``enable_attention_dp``, needs ``ep == world``): attention is replicated and
  every rank runs it on its own requests with its own cache.
* MoE: the routed experts are split in ``ep`` contiguous shares of ``E / ep`` experts; when ``ep < world``
  the remaining factor ``moe_tp = world / ep`` splits each expert's intermediate dimension, so every
  (expert, intermediate slice) lives on exactly one rank and the routed output is the sum over ranks. The
  gate (routing) and the shared expert are replicated.
* embedding, lm head, norms, mHC and the MTP module's projections are replicated; the MTP block's
  attention and experts follow the same split as the target layers.

TensorRT-LLM users' ``--tp 4 --ep 4`` is world 4 with heads and experts both split 4 ways; ``--tp 1 --ep 2``
(expert parallel only) is world 2 with attention replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..engine.config import EngineConfig, EngineConfigError


@dataclass(frozen=True)
class ParallelMapping:
    world_size: int = 1
    rank: int = 0
    tp: int = 1  # tensor_parallel_size as given
    ep: int = 1  # moe_expert_parallel_size
    attention_dp: bool = False

    @classmethod
    def from_engine_config(cls, cfg: EngineConfig, rank: int = 0) -> "ParallelMapping":
        """The mapping the settings ask for; refuses what this engine cannot run (the model is checked by
        ``check_model``, the devices by ``check_devices``)."""
        tp, ep, pp = cfg.tensor_parallel_size, cfg.moe_expert_parallel_size, cfg.pipeline_parallel_size
        for name, v in (("tensor_parallel_size", tp), ("moe_expert_parallel_size", ep),
                        ("pipeline_parallel_size", pp)):
            if not isinstance(v, int) or v < 1:
                raise EngineConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if pp != 1:
            raise EngineConfigError(f"pipeline_parallel_size={pp}: pipeline parallelism is not implemented;"
                                    " use tensor_parallel_size / moe_expert_parallel_size to spread the model"
                                    " over several devices (set pipeline_parallel_size: 1)")
        world = max(tp, ep)
        if tp not in (1, world):
            raise EngineConfigError(f"tensor_parallel_size={tp} with moe_expert_parallel_size={ep}: the world is"
                                    f" max(tp, ep) = {world} ranks and attention is either split over all of"
                                    f" them or replicated; use tensor_parallel_size 1 or {world}")
        if world % ep:
            raise EngineConfigError(f"moe_expert_parallel_size={ep} must divide the world size {world}"
                                    " (the rest of the world splits each expert's intermediate dimension)")
        if cfg.enable_attention_dp and (world < 2 or ep != world):
            raise EngineConfigError(
                f"enable_attention_dp needs several ranks with the experts split over all of them: set"
                f" moe_expert_parallel_size to the world size (got tensor_parallel_size={tp},"
                f" moe_expert_parallel_size={ep}, world {world}); e.g. --tp 2 --ep 2 with enable_attention_dp")
        if not 0 <= rank < world:
            raise EngineConfigError(f"rank {rank} outside the world of {world} ranks")
        return cls(world_size=world, rank=rank, tp=tp, ep=ep, attention_dp=bool(cfg.enable_attention_dp))

    def with_rank(self, rank: int) -> "ParallelMapping":
        return ParallelMapping(self.world_size, rank, self.tp, self.ep, self.attention_dp)

    # ---- derived -------------------------------------------------------------------------------------
    @property
    def attn_tp(self) -> int:
        """Ways the attention heads are split (1 = replicated)."""
        return 1 if self.attention_dp else self.tp

    @property
    def dp_size(self) -> int:
        """Attention data-parallel lanes: ranks that run attention on requests of their own."""
        return self.world_size if self.attention_dp else 1

    @property
    def moe_tp(self) -> int:
        """Ways each routed expert's intermediate dimension is split."""
        return self.world_size // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp

    def describe(self) -> dict:
        return {"world_size": self.world_size, "tp": self.tp, "ep": self.ep, "attention_dp": self.attention_dp,
                "attention_tp": self.attn_tp, "attention_dp_size": self.dp_size, "moe_ep": self.ep,
                "moe_tp": self.moe_tp}

    # ---- checks against the model and the machine -------------------------------------------------------
    def check_model(self, m: ModelConfig) -> None:
        t = self.attn_tp
        if t > 1 and (m.num_heads % t or m.o_groups % t):
            raise EngineConfigError(f"tensor_parallel_size={t} must divide the attention heads ({m.num_heads}) and"
                                    f" the output-projection groups (o_groups={m.o_groups}): heads are split by"
                                    " whole groups; pick a tp that divides both, or tp 1 (with ep for experts)")
        if m.n_routed_experts % self.ep:
            raise EngineConfigError(f"moe_expert_parallel_size={self.ep} must divide the routed experts"
                                    f" ({m.n_routed_experts})")
        if m.moe_inter_dim % self.moe_tp:
            raise EngineConfigError(f"world size {self.world_size} / moe_expert_parallel_size {self.ep} ="
                                    f" {self.moe_tp} must divide the experts' intermediate size"
                                    f" ({m.moe_inter_dim})")

    def check_devices(self, device: str) -> None:
        if self.world_size == 1 or not str(device).startswith("cuda"):
            return
        import torch

        have = torch.cuda.device_count()
        base = torch.device(device).index or 0
        if base + self.world_size > have:
            raise EngineConfigError(f"{self.world_size} ranks need {self.world_size} CUDA devices from cuda:{base},"
                                    f" but this machine has {have}; lower tensor_parallel_size /"
                                    " moe_expert_parallel_size")
