"""Several devices: tensor, expert and attention-data parallelism over torch.distributed (NCCL / gloo).

* ``mapping``  — ParallelMapping: world = max(tp, ep) ranks, which rank holds which heads and experts; refusals.
* ``shard``    — this rank's slice of the state dict and the split modules (wo_b + all-reduce, local experts).
* ``comm``     — launching the ranks (worker processes, or torchrun's), the data and control groups, failure.
* ``executor`` — the step protocol: the driver's runner announces each pass, the other ranks follow.
* ``lanes``    — attention DP on the driver: per-rank schedulers and cache bookkeeping, padded lockstep.
* ``driver``   — start-up (RankSetup), the driver's DistributedEngine, a worker's serve loop.
* ``worker``   — ``python -m dsv4.parallel.worker``: a worker rank's process.

``LLM(model, tensor_parallel_size=2, moe_expert_parallel_size=2, enable_attention_dp=...)`` uses all this.
"""
