"""Building the ranks: what the driver tells every rank at start-up, what each rank builds, the driver's engine.

Start-up: the driver starts the ranks (``RankGroup.launch``, or they are torchrun's), loads its own shard,
sizes the cache, then sends one ``RankSetup`` to every rank. Each rank loads the full state dict, keeps its
share (``build_shard``), allocates its ONE cache (target layers and the MTP layer, R1) with the driver's
slot and block counts, and reports ready (a gather: a rank that failed makes it fail). Then the workers
``follow`` the driver's steps; the driver runs a ``DistributedEngine``.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from dataclasses import dataclass

import torch

from .. import env
from ..cache.manager import KVCacheManager
from ..engine.build import make_storage
from ..engine.mtp_rows import max_kept_rows
from ..engine.engine import LLMEngine
from ..engine.graphs import build_graphs
from ..engine.resolved import ResolvedConfig
from ..engine.scheduler import Scheduler
from ..model.loader import load_state, model_config
from .comm import RankGroup
from .executor import DistributedRunner, LaneRunner, StopMsg, follow
from .lanes import DataParallelScheduler, LaneCaches
from .mapping import ParallelMapping
from .shard import build_shard, rank_experts

log = logging.getLogger("dsv4")

FAIL_ENV = env.INJECT_FAILURE  # test hook: "<rank>:<setup|forward|propose>[:<n>]" makes that rank raise


@dataclass(frozen=True)
class RankSetup:
    """What every rank is built from: the driver's resolved config, whole (dtype, KV dtype, cache layout and
    sizing, graph buckets, settings), so no rank decides anything again."""

    model: str  # checkpoint directory or preset name
    resolved: ResolvedConfig
    mapping: ParallelMapping
    with_mtp: bool  # the checkpoint's MTP layer is loaded (the driver's model has it)


def torchrun_rank() -> int | None:
    """This process's rank if torchrun (or a compatible launcher) started it, else None."""
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ["RANK"])
    return None


def start_group(mapping: ParallelMapping, device: str) -> RankGroup:
    if torchrun_rank() is not None:
        return RankGroup.from_torchrun(mapping.world_size, device)
    return RankGroup.launch(mapping.world_size, device)


def load_rank_model(model: str, group: RankGroup, mapping: ParallelMapping, dtype, with_mtp, seed,
                    expert_format: str = "dequantized", linear_format: str = "dequantized"):
    """(config, this rank's model shard). Only the rank's routed experts are read from a checkpoint."""
    device = group.device_of_rank()
    m = mapping.with_rank(group.rank)
    cfg, sd, has_mtp = load_state(model, device, dtype, with_mtp, seed, experts=rank_experts(model_config(model), m),
                                  expert_format=expert_format, linear_format=linear_format)
    return cfg, build_shard(cfg, sd, has_mtp, m, group.collectives, device)


def _maybe_fail(rank: int, where: str, count: int) -> None:
    spec = env.text(FAIL_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if int(parts[0]) == rank and parts[1] == where and count == (int(parts[2]) if len(parts) > 2 else 1):
        raise RuntimeError(f"injected failure ({FAIL_ENV}={spec}) on rank {rank} at {where} #{count}")


def serve(group: RankGroup) -> None:
    """A worker rank: set up from the driver's RankSetup, report ready, follow the steps until stop."""
    setup = group.recv()
    if isinstance(setup, StopMsg):  # the driver gave up before sending the setup
        return
    _maybe_fail(group.rank, "setup", 1)
    if group.backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // group.world_size))
    r = setup.resolved
    _, model = load_rank_model(setup.model, group, setup.mapping, r.dtype, setup.with_mtp, r.engine.seed,
                               r.engine.moe_config.expert_format, r.engine.linear_format)
    device = group.device_of_rank()
    storage = make_storage(r, device)
    runner = LaneRunner(model, storage, device, r.engine.attention_backend, r.engine.batch_invariant)
    runner.lane_settings(setup.mapping.attention_dp)  # (as the driver's: DistributedRunner)
    runner.mtp_rows_max = max_kept_rows(r.engine.max_num_tokens, r.engine.max_batch_size, r.layout.swa_cap)
    build_graphs(runner, r.graphs)  # with the driver and every rank: same buckets, same order
    group.gather("ready")
    counts = {}

    def on_message(msg):
        kind = {"ForwardMsg": "forward", "ProposeMsg": "propose"}.get(type(msg).__name__)
        if kind:
            counts[kind] = counts.get(kind, 0) + 1
            _maybe_fail(group.rank, kind, counts[kind])

    follow(group, runner, r.layout, r.num_slots, setup.mapping.attention_dp, on_message)


def run_worker(join) -> None:
    """Join (``join()`` -> RankGroup), serve, exit the process: 0 after stop, 1 after a failure."""
    group = None
    try:
        group = join()
        serve(group)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the driver
        if group is not None:
            group.exit_worker(e)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve_torchrun(device: str, mapping: ParallelMapping) -> None:
    """A rank >= 1 under torchrun: serve the driver (rank 0), then end this process."""
    run_worker(lambda: RankGroup.from_torchrun(mapping.world_size, device))


class DistributedEngine(LLMEngine):
    """The engine on the driver: LLMEngine whose runner announces every pass to the other ranks; under
    attention DP its scheduler and cache are the per-rank compositions of ``lanes.py``."""

    def __init__(self, model, r: ResolvedConfig, storage, tokenizer, group: RankGroup, mapping: ParallelMapping):
        lanes = mapping.dp_size
        engine_cfg = r.engine
        managers = [KVCacheManager(r.layout, r.num_slots, r.num_blocks) for _ in range(lanes)]
        lane_of: dict = {}
        cache = managers[0] if lanes == 1 else LaneCaches(managers, lane_of, r.layout, r.num_slots)
        runner = DistributedRunner(model, storage, r.device, engine_cfg.attention_backend, group, mapping,
                                   batch_invariant=engine_cfg.batch_invariant)
        runner.lane_of = lane_of
        scheduler = None if lanes == 1 else DataParallelScheduler(
            [Scheduler(m, engine_cfg.max_batch_size, engine_cfg.max_num_tokens) for m in managers], lane_of)
        super().__init__(model, model.cfg, cache, storage, engine_cfg, r.max_seq_len, tokenizer=tokenizer,
                         runner=runner, scheduler=scheduler)
        self.group, self.mapping = group, mapping
        self.num_lanes = lanes  # warmup fills every lane


def start_ranks(group: RankGroup, setup: RankSetup, model, tokenizer) -> DistributedEngine:
    """Driver: send the setup, build its own cache and engine, wait until every rank is ready."""
    r = setup.resolved
    try:
        group.send(setup)
        engine = DistributedEngine(model, r, make_storage(r, r.device), tokenizer, group, setup.mapping)
        group.on_destroy(engine.runner.release_graphs)
        if build_graphs(engine.runner, r.graphs) is not None:
            log.info("CUDA graphs on %d ranks: batch sizes %s x %d rows per request%s", group.world_size,
                     list(r.graphs.buckets), r.graphs.rows_per_seq, " per lane" if setup.mapping.attention_dp else "")
        group.gather("ready")
    except BaseException as e:
        raise group.fail(e) from e
    log.info("%d ranks ready: %s", group.world_size, setup.mapping.describe())
    return engine
