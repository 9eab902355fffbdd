"""CUDA graphs for decode and verify steps: one graph per padded batch size, rows per request fixed
(1 without MTP, 1 + k with it).

A graph replays fixed addresses, so each bucket owns a static copy of the plan's per-row vector (C, n,
slot, draft length, block table; ``PlanShape.row_vector_size`` ints) and the target graph expands it into
every table the forward reads (``expand_rows``, captured with the forward): loading a step is one copy,
and the host never builds the tables of a graphed step. The MTP catch-up and draft graphs read the tables
the target graph of the same step expanded. The forward is captured once on inert inputs (every row has no
tokens and points at the cache's null slot/block, R3); padded rows of a real step are inert the same way:
they write the null rows and read nothing valid. The captured forward must not synchronise with the host
(MoE runs the device-side grouped path for this reason).

With ``capture=False`` (CPU, or tests) the same static buffers run eagerly: bucketing, padding, the
static copy and the expansion are exercised without a GPU.

The MTP graphs read what the same step's target graph left in the bucket (its tables, its streams), so a
bucket remembers which plan it holds and which of that step's graphs have run: ``mtp(plan)`` and
``draft(plan, j)`` refuse a plan the bucket does not hold, or a call out of order (target, mtp, draft 2, 3,
...), instead of writing another step's MTP rows (``GraphOrderError``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..cache.plan import DraftTables, PlanShape, expand_rows, padded_shape
from .cuda_backend import CudaBackend
from .resolved import GraphSpec


class GraphOrderError(RuntimeError):
    """An MTP graph was asked to replay for a step whose earlier graphs did not run on its bucket."""


@dataclass
class _Bucket:
    batch: int
    ids: torch.Tensor
    next_ids: torch.Tensor
    shape: PlanShape  # the static shapes (those of a plan built with the bucket's padding)
    rows: torch.Tensor  # the static per-row vector
    new_lens: torch.Tensor  # [B] committed lengths after acceptance (draft steps)
    draft_ids: dict  # j -> [B] the token each request feeds draft step j
    target_out: tuple | None = None  # (streams [N, n, d], logits [N, V])
    mtp_out: tuple | None = None
    draft_out: dict = field(default_factory=dict)  # j -> (streams [B, n, d], logits [B, V])
    tables: object = None  # PlanTables expanded by the target graph (read by the MTP graphs)
    draft_in: torch.Tensor | None = None  # [B, n, d] streams feeding draft step 2
    graphs: dict = field(default_factory=dict)
    plan: object = None  # the step whose tables and outputs the bucket holds (set by target)
    ran: list = field(default_factory=list)  # the graphs that step has run, in order


class GraphRunner:
    def __init__(self, model, storage, spec: GraphSpec, capture: bool):
        self.model, self.storage = model, storage
        self.rows, self.enable_padding = spec.rows_per_seq, spec.enable_padding
        self.buckets = sorted(spec.buckets)
        self.max_entries, self.max_blocks = spec.max_entries, spec.max_blocks
        self.with_mtp, self.capture, self.draft_len = spec.with_mtp, capture, spec.draft_len
        self._b: dict[int, _Bucket] = {}
        self.pool = None
        self.num_replays = 0
        self.released = False

    # ---- which steps -------------------------------------------------------------------------------
    def bucket_for(self, num_seqs: int, num_new: list[int]) -> int | None:
        """Steps where every request adds exactly ``rows`` tokens (decode / verify; a prefill chunk of that
        size is fine too: the decode-like attention path is valid for up to 1 + max_draft_len rows)."""
        if any(n != self.rows for n in num_new):
            return None
        fits = [b for b in self.buckets if b >= num_seqs]
        if not fits:
            return None
        b = fits[0]
        return b if (b == num_seqs or self.enable_padding) else None

    def matches(self, plan) -> bool:
        """Was this plan built with one of the buckets' padding?"""
        bk = self._b.get(plan.shape.batch)
        return bk is not None and plan.shape == bk.shape and all(n == self.rows for n in plan.num_new)

    def padding(self, bucket: int) -> dict:
        return {"pad_batch_to": bucket, "pad_tokens_to": bucket * self.rows, "max_entries": self.max_entries,
                "max_blocks": self.max_blocks}

    # ---- static buffers ------------------------------------------------------------------------------
    def _shape(self, B: int) -> PlanShape:
        return padded_shape(self.storage.layout, B, B * self.rows, self.max_blocks, self.max_entries)

    @property
    def _swa_base(self) -> int:
        lay = self.storage.layout
        return lay.step_base(lay.swa_cap, self.storage.num_slots)

    def _backend(self, t) -> CudaBackend:
        return CudaBackend.for_step(t, self.storage, self._swa_base)

    def _target(self, bk: _Bucket):
        st = self.storage
        bk.tables = expand_rows(st.layout, bk.shape, bk.rows, st.num_slots)
        X = self.model.streams(bk.ids, self._backend(bk.tables))
        return X, self.model.logits_from_streams(X)

    def _mtp(self, bk: _Bucket):
        X = self.model.mtp_streams(bk.target_out[0], bk.next_ids, self._backend(bk.tables))
        return X, self.model.mtp_logits_from_streams(X)

    def _draft(self, bk: _Bucket, j: int):
        """Draft step j >= 2: one token per request, tables computed on the device from the static inputs."""
        t, lay = bk.tables, self.storage.layout
        tables = DraftTables(slots=t.slots, draft_lens=t.draft_lens, max_draft_len=self.draft_len,
                             window=lay.window, swa_cap=lay.swa_cap, swa_step_base=self._swa_base)
        st = tables.step_tables(j, bk.new_lens)
        X_in = bk.draft_in if j == 2 else bk.draft_out[j - 1][0]
        X = self.model.mtp_streams(X_in, bk.draft_ids[j], CudaBackend.for_draft(st, self.storage, self._swa_base))
        return X, self.model.mtp_logits_from_streams(X)

    def _run(self, bk: _Bucket, name: str, fn):
        """Replay the captured graph ``name`` (or run ``fn`` eagerly on the static buffers)."""
        if self.capture:
            bk.graphs[name].replay()
            return None
        return fn()

    # ---- capture (largest bucket first, one shared memory pool) --------------------------------------
    @torch.no_grad()
    def prepare(self):
        dev = self.storage.device
        n, d = self.model.cfg.hc_mult, self.model.cfg.hidden_size
        for B in sorted(self.buckets, reverse=True):
            N = B * self.rows
            zl = lambda *s: torch.zeros(*s, dtype=torch.long, device=dev)  # noqa: E731
            shape = self._shape(B)
            bk = _Bucket(B, zl(N), zl(N), shape, zl(shape.row_vector_size), zl(B),
                         {j: zl(B) for j in range(2, self.draft_len + 1)})
            bk.draft_in = torch.zeros(B, n, d, dtype=self.model.embed.weight.dtype, device=dev)
            self._b[B] = bk
            steps = [("target", lambda: self._target(bk), "target_out")]
            if self.with_mtp:
                steps.append(("mtp", lambda: self._mtp(bk), "mtp_out"))
                for j in range(2, self.draft_len + 1):
                    steps.append((f"draft{j}", (lambda j=j: self._draft(bk, j)), j))
            for name, fn, slot in steps:  # eager first: the static outputs exist, kernels are loaded
                self._store(bk, slot, fn())
            if not self.capture:
                continue
            torch.cuda.synchronize()
            for name, fn, slot in steps:  # capture, largest bucket first, one shared pool
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self.pool):
                    self._store(bk, slot, fn())
                self.pool = g.pool()
                bk.graphs[name] = g
            torch.cuda.synchronize()

    @staticmethod
    def _store(bk: _Bucket, slot, value):
        if isinstance(slot, int):
            bk.draft_out[slot] = value
        else:
            setattr(bk, slot, value)

    # ---- replay ------------------------------------------------------------------------------------------
    def _after(self, plan, name: str, previous: str):
        """The bucket of ``plan`` for graph ``name``, which must follow ``previous`` of the same step."""
        bk = self._b.get(plan.shape.batch)
        if bk is None:
            raise GraphOrderError(f"{name}: no graph bucket of batch {plan.shape.batch}")
        if bk.plan is not plan:
            raise GraphOrderError(f"{name}: bucket {bk.batch} holds the tables of another step; replay target(plan)"
                                  f" of this step first")
        if not bk.ran or bk.ran[-1] != previous:
            raise GraphOrderError(f"{name}: this step's graphs so far are {bk.ran}; {name} runs after {previous}")
        bk.ran.append(name)
        return bk

    @torch.no_grad()
    def target(self, plan, ids: torch.Tensor):
        """-> (streams [N, n, d], logits [N, V]) of every row of the padded step."""
        bk = self._b[plan.shape.batch]
        bk.plan, bk.ran = plan, ["target"]
        bk.rows.copy_(plan.rows)
        bk.ids.copy_(ids)
        self.num_replays += 1
        out = self._run(bk, "target", lambda: self._target(bk))
        if out is not None:
            bk.target_out = out
        return bk.target_out

    @torch.no_grad()
    def mtp(self, plan, next_ids: torch.Tensor):
        """The MTP catch-up pass of the same step (tables already loaded by ``target``)."""
        bk = self._after(plan, "mtp", "target")
        bk.next_ids.copy_(next_ids)
        out = self._run(bk, "mtp", lambda: self._mtp(bk))
        if out is not None:
            bk.mtp_out = out
        return bk.mtp_out

    @torch.no_grad()
    def draft(self, plan, j: int, new_lens: torch.Tensor, ids: torch.Tensor, X_in: torch.Tensor | None = None):
        """Draft step j of the same step: (streams [B, n, d], logits [B, V]). X_in feeds step 2."""
        bk = self._after(plan, f"draft{j}", "mtp" if j == 2 else f"draft{j - 1}")
        if j == 2:
            bk.new_lens.copy_(new_lens)
            bk.draft_in.copy_(X_in)
        bk.draft_ids[j].copy_(ids)
        out = self._run(bk, f"draft{j}", lambda: self._draft(bk, j))
        if out is not None:
            bk.draft_out[j] = out
        return bk.draft_out[j]

    def release(self) -> None:
        """Destroy the captured graphs and their pool (before the NCCL groups go, see RankGroup.on_destroy).
        No plan matches a bucket afterwards (steps would run eagerly); buckets and counts stay for reports."""
        if self.capture:
            torch.cuda.synchronize()
        for bk in self._b.values():
            for g in bk.graphs.values():
                g.reset()
            bk.graphs.clear()
        self._b.clear()
        self.pool = None
        self.released = True


def build_graphs(runner, spec: GraphSpec | None, capture: bool = True) -> GraphRunner | None:
    """Give ``runner`` its GraphRunner for ``spec`` (the resolved config's) and prepare it: after the cache is
    sized, before warmup. Nothing when ``spec`` is None or the runner is not on the kernel path. Multi-rank
    runs call this on every rank with the same spec, at the same point, so the captures (and the collectives
    inside them) line up, largest bucket first."""
    if spec is None or not runner.use_kernels:
        return None
    runner.graphs = GraphRunner(runner.model, runner.storage, spec,
                                capture=capture and runner.storage.device.type == "cuda")
    with runner.pass_context():  # captured under the same GEMM row counts as the eager passes
        runner.graphs.prepare()
    return runner.graphs
