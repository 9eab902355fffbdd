"""CUDA graphs for decode and verify steps: one graph per padded batch size, rows per request fixed
(1 without MTP, 1 + k with it); and for one request's prefill chunks, one graph per padded token count.

A graph replays fixed addresses, so each bucket owns a static copy of the plan's per-row vector (C, n,
slot, draft length, block table; ``PlanShape.row_vector_size`` ints) and the target graph expands it into
every table the forward reads (``expand_rows``, captured with the forward): loading a step is one copy,
and the host never builds the tables of a graphed step. The MTP catch-up and draft graphs read the tables
the target graph of the same step expanded. The forward is captured once on inert inputs (every row has no
tokens and points at the cache's null slot/block, R3); padded rows of a real step are inert the same way:
they write the null rows and read nothing valid. The captured forward must not synchronise with the host
(MoE runs the device-side grouped path for this reason).

Prefill graphs: one request's prefill chunk of up to T tokens (``GraphSpec.prefill_tokens``) replays the
target pass and the MTP passes captured for T tokens, padded with inert rows; its window is read from a copy
of the ring with the step's rows appended (``PrefillCudaBackend``), as the eager prefill on the kernels reads
it. Those graphs return streams only: the runner computes the logits of the rows it samples (one per request
at a prefill) from them, outside the graph, instead of the graph computing T rows of logits.

With ``capture=False`` (CPU, or tests) the same static buffers run eagerly: bucketing, padding, the
static copy and the expansion are exercised without a GPU.

The MTP graphs read what the same step's target graph left in the bucket (its tables, its streams), so a
bucket remembers which plan it holds and which of that step's graphs have run: ``mtp(plan)`` and
``draft(plan, j)`` refuse a plan the bucket does not hold, or a call out of order (target, mtp, draft 2, 3,
...), instead of writing another step's MTP rows (``GraphOrderError``).
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field, replace

import torch

from ..cache.plan import DraftTables, PlanShape, expand_rows, padded_shape
from ..transfer import HostCopy
from .cuda_backend import CudaBackend, PrefillCudaBackend
from .mtp_rows import MtpRows, one_request_keep, select
from .resolved import GraphSpec
from .sampler import greedy_tokens
from .runner import uniform_draft_inputs
from .spec import accept_uniform


@dataclass(frozen=True)
class StepGraphOut:
    """What a bucket's whole-step graph leaves (static tensors, overwritten by its next replay): the target
    pass, the greedy verdict of every row (``spec.accept_uniform``) and the MTP drafts from it. ``packed`` =
    target ids [N] | accepted rows [B] | checked drafts [N] | drafts [B * k] (``offsets``), the one tensor copied
    to the host (``host``, queued right after each replay)."""

    streams: torch.Tensor  # [N, n, d]
    logits: torch.Tensor  # [N, V]
    target_ids: torch.Tensor  # [N] the target's argmax at every row
    accepted_drafts: torch.Tensor  # [B]
    accepted_rows: torch.Tensor  # [B] 1 + accepted drafts
    last_ids: torch.Tensor  # [B] the token each row emits last (the bonus)
    drafts: torch.Tensor  # [B, k] the next step's drafts
    new_lens: torch.Tensor  # [B] committed length after acceptance (C + accepted rows)
    packed: torch.Tensor
    host: HostCopy | None = None

    @property
    def offsets(self) -> tuple[int, int, int]:
        """Where the accepted rows, the checked drafts and the drafts start in ``packed``."""
        N, B = self.target_ids.shape[0], self.accepted_rows.shape[0]
        return N, N + B, 2 * N + B

    def drafts_host(self, num_seqs: int):
        """The first ``num_seqs`` rows' drafts, read from ``host`` (as ``HostCopy.tolist`` would give them)."""
        k, at = self.drafts.shape[1], self.offsets[2]
        return self.host.part(at, at + num_seqs * k, k)


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
    step_out: StepGraphOut | None = None  # the whole-step graph's outputs
    ran: list = field(default_factory=list)  # the graphs that step has run, in order
    prefill: bool = False  # a prefill bucket: one request, up to shape.tokens tokens, streams only
    keep_out: None = None  # (the keep-up pass returns nothing: it only stores the MTP layer's window rows)
    keep_consts: tuple | None = None  # (zeros, ones, -1) [B]: the known acceptance columns of a keep-up step
    bare_out: StepGraphOut | None = None  # a keep-up runner's whole step without its keep-up pass


class GraphRunner:
    # a keep-up runner's whole step leaves out the acceptance kernels whose results are known (``_keep_step``);
    # False: it runs them as a drafting step does (its twin in the tests, and the bench's A/B)
    slim_keep_step = True

    def __init__(self, model, storage, spec: GraphSpec, capture: bool, whole_step: bool = True,
                 keep_up: bool = False, tail_rows: bool = True):
        """``keep_up``: also the MTP layer's keep-up pass (``keep``: its window rows only), for the steps whose drafting
        is paused (a runner of one row per request beside the main one, see ``build_graphs``). ``tail_rows``: a
        prefill bucket's MTP pass over its request's last swa_cap rows only (``ModelRunner.mtp_tail_rows``)."""
        self.model, self.storage = model, storage
        self.keep_up, self.tail_rows = keep_up, tail_rows
        self.rows, self.enable_padding = spec.rows_per_seq, spec.enable_padding
        self.buckets = sorted(spec.buckets)
        self.max_entries, self.max_blocks = spec.max_entries, spec.max_blocks
        self.with_mtp, self.capture, self.draft_len = spec.with_mtp, capture, spec.draft_len
        # with MTP, one graph per bucket for a whole greedy step (verify, accept, the k draft passes); set
        # False to replay the separate graphs (target, MTP catch-up, draft j) with acceptance eager between
        self.whole_step = spec.with_mtp and whole_step
        self._b: dict[int, _Bucket] = {}
        self.prefill_tokens = sorted(spec.prefill_tokens)
        self._p: dict[int, _Bucket] = {}  # prefill buckets by token count
        self.pool = None
        self.num_replays = 0
        self.num_prefill_replays = 0  # replays of a prefill bucket's target graph (counted in num_replays too)
        self.num_whole_steps = 0  # replays of the whole-step graph (counted in num_replays too)
        self.num_bare_steps = 0  # of those, a keep-up runner's without its keep-up pass (plan.mtp_keep_up False)
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

    def prefill_bucket_for(self, num_seqs: int, num_new: list[int]) -> int | None:
        """The prefill graph (its token count) for a step of one request adding more tokens than a decode step:
        the smallest that holds them (None: eager)."""
        if num_seqs != 1 or num_new[0] <= self.rows:
            return None
        return next((T for T in self.prefill_tokens if T >= num_new[0]), None)

    def _bucket(self, plan) -> _Bucket | None:
        """The bucket whose shapes ``plan`` was built with (a prefill one, else the decode one of its batch)."""
        bk = self._p.get(plan.shape.tokens) if plan.shape.batch == 1 else None
        if bk is not None and plan.shape == bk.shape:
            return bk
        return self._b.get(plan.shape.batch)

    def matches(self, plan) -> bool:
        """Was this plan built with one of the buckets' padding?"""
        bk = self._bucket(plan)
        if bk is None or plan.shape != bk.shape:
            return False
        return plan.num_seqs == 1 if bk.prefill else all(n == self.rows for n in plan.num_new)

    def is_prefill(self, plan) -> bool:
        """Does ``plan`` replay a prefill bucket (whose graphs leave the logits to the runner)?"""
        bk = self._bucket(plan)
        return self.matches(plan) and bk.prefill

    def padding(self, bucket: int) -> dict:
        return {"pad_batch_to": bucket, "pad_tokens_to": bucket * self.rows, "max_entries": self.max_entries,
                "max_blocks": self.max_blocks}

    def prefill_padding(self, tokens: int) -> dict:
        return {"pad_batch_to": 1, "pad_tokens_to": tokens, "max_entries": self.max_entries,
                "max_blocks": self.max_blocks}

    # ---- static buffers ------------------------------------------------------------------------------
    def _shape(self, B: int, tokens: int | None = None) -> PlanShape:
        return padded_shape(self.storage.layout, B, B * self.rows if tokens is None else tokens, self.max_blocks,
                            self.max_entries)

    @property
    def _swa_base(self) -> int:
        lay = self.storage.layout
        return lay.step_base(lay.swa_cap, self.storage.num_slots)

    def _backend(self, t, prefill: bool = False) -> CudaBackend:
        return (PrefillCudaBackend if prefill else CudaBackend).for_step(t, self.storage, self._swa_base)

    def _forward(self, bk: _Bucket):
        """-> (tables, streams, logits; None in a prefill bucket) of the target pass on the bucket's static inputs."""
        st = self.storage
        tables = expand_rows(st.layout, bk.shape, bk.rows, st.num_slots)
        X = self.model.streams(bk.ids, self._backend(tables, bk.prefill))
        return tables, X, None if bk.prefill else self.model.logits_from_streams(X)

    def _target(self, bk: _Bucket):
        bk.tables, X, logits = self._forward(bk)
        return X, logits

    def _mtp_pass(self, tables, X, next_ids, prefill: bool = False):
        """-> (MTP streams, their logits (None in a prefill bucket), None or, where the pass ran over a prefill
        bucket's last swa_cap rows only (``mtp_rows.py``), the subset row of each step row)."""
        sub = self._tail(tables) if prefill else None
        if sub is None:
            X = self.model.mtp_streams(X, next_ids, self._backend(tables, prefill))
            return X, None if prefill else self.model.mtp_logits_from_streams(X), None
        backend = PrefillCudaBackend.for_draft(sub, self.storage, self._swa_base)
        return self.model.mtp_streams(sub.rows(X), sub.ids(next_ids), backend), None, sub.inv

    def _tail(self, tables) -> MtpRows | None:
        """A prefill bucket's MTP rows: its request's last swa_cap (None: the bucket holds no more)."""
        cap = self.storage.layout.swa_cap
        if not (self.tail_rows and self.model.mtp_window_only) or tables.positions.shape[0] <= cap:
            return None
        return select(tables, one_request_keep(tables.num_new, cap), self._swa_base)

    def _mtp(self, bk: _Bucket):
        return self._mtp_pass(bk.tables, bk.target_out[0], bk.next_ids, bk.prefill)

    def _keep(self, bk: _Bucket):
        self.model.mtp_keep_up(bk.target_out[0], bk.next_ids, self._backend(bk.tables))

    def _draft_pass(self, t, j: int, new_lens, X_in, ids):
        """Draft step j >= 2 on the tables ``t`` of the step: one token per request, its tables computed on the
        device from ``new_lens``."""
        lay = self.storage.layout
        tables = DraftTables(slots=t.slots, draft_lens=t.draft_lens, max_draft_len=self.draft_len,
                             window=lay.window, swa_cap=lay.swa_cap, swa_step_base=self._swa_base)
        st = tables.step_tables(j, new_lens)
        X = self.model.mtp_streams(X_in, ids, CudaBackend.for_draft(st, self.storage, self._swa_base))
        return X, self.model.mtp_logits_from_streams(X)

    def _draft(self, bk: _Bucket, j: int):
        X_in = bk.draft_in if j == 2 else bk.draft_out[j - 1][0]
        return self._draft_pass(bk.tables, j, bk.new_lens, X_in, bk.draft_ids[j])

    def _step(self, bk: _Bucket) -> StepGraphOut:
        """A whole greedy MTP step on the bucket's static inputs, as the separate graphs with acceptance between
        them compute it (``spec.accept_on_device`` and ``runner.device_draft_inputs`` on these shapes: every
        batch row verifies k drafts; the same kernels on the same shapes, so the same numbers): the target
        pass, each row's accepted drafts, the MTP catch-up pass over the accepted rows (later rows get input 0:
        their writes are rolled back), draft 1 from the row of each request's newest committed position,
        draft passes 2..k. Padded batch rows (no drafts) feed zeros to the draft passes, as there. A keep-up
        runner's step (``step_drafts`` 0: drafting paused) verifies nothing and drafts nothing: its one row a
        request emits the target's token, which feeds the MTP layer's keep-up pass (``keep``)."""
        tables, X, logits = self._forward(bk)
        B, k = bk.batch, self.step_drafts
        G = greedy_tokens(logits)
        if k == 0 and self.slim_keep_step:
            return self._keep_step(bk, tables, X, logits, G)
        a, last, checks = accept_uniform(G, bk.ids, B, k)
        inp = uniform_draft_inputs(G.view(-1, k + 1)[:B], a, tables.computed_lens)
        rows = 1 + a
        if k == 0:
            self.model.mtp_keep_up(X, inp.next_ids, self._backend(tables))
            packed = torch.cat([G, rows, checks.reshape(-1)])
            return StepGraphOut(X, logits, G, a, rows, last, G.new_zeros(B, 0), inp.new_lens, packed)
        X_mtp, mtp_logits, _ = self._mtp_pass(tables, X, inp.next_ids)
        live = tables.draft_lens > 0
        tok = torch.where(live, greedy_tokens(mtp_logits[inp.picks]), 0)
        X_prev = torch.where(live[:, None, None], X_mtp[inp.picks], 0)
        drafts = [tok]
        for j in range(2, k + 1):
            X_prev, lg = self._draft_pass(tables, j, inp.new_lens, X_prev, drafts[-1])
            drafts.append(torch.where(live, greedy_tokens(lg), 0))
        D = torch.stack(drafts, 1)
        packed = torch.cat([G, rows, checks.reshape(-1), D.reshape(-1)])
        return StepGraphOut(X, logits, G, a, rows, last, D, inp.new_lens, packed)

    def _bare(self, bk: _Bucket) -> StepGraphOut:
        """A keep-up runner's whole step without the keep-up pass (``plan.mtp_keep_up`` False): the target pass
        and its greedy verdict, nothing of the MTP layer."""
        tables, X, logits = self._forward(bk)
        return self._keep_step(bk, tables, X, logits, greedy_tokens(logits), keep_up=False)

    def _keep_step(self, bk: _Bucket, tables, X, logits, G, keep_up: bool = True) -> StepGraphOut:
        """``_step`` of a keep-up runner (no drafts) without the acceptance kernels, whose results are known: each
        row accepts 0 drafts and emits its target token; its checked draft is -1; the MTP layer keeps up on that
        token. The constant columns are made in the bucket's first (eager) run, outside any capture, so a replay
        only copies them into ``packed``."""
        B = bk.batch
        if bk.keep_consts is None:
            bk.keep_consts = (G.new_zeros(B), G.new_ones(B), G.new_full((B,), -1))
        zero, one, minus_one = bk.keep_consts
        if keep_up:
            self.model.mtp_keep_up(X, G, self._backend(tables))
        packed = torch.cat([G, one, minus_one])
        return StepGraphOut(X, logits, G, zero, one, G, G.new_zeros(B, 0), tables.computed_lens[:B] + 1, packed)

    def _run(self, bk: _Bucket, name: str, fn):
        """Replay the captured graph ``name`` (or run ``fn`` eagerly on the static buffers)."""
        if self.capture:
            bk.graphs[name].replay()
            return None
        return fn()

    # ---- capture (largest bucket first, one shared memory pool) --------------------------------------
    @torch.no_grad()
    def prepare(self):
        """Capture every bucket: the prefill buckets (largest first), then the decode buckets (largest first)."""
        dev = self.storage.device
        n, d = self.model.cfg.hc_mult, self.model.cfg.hidden_size
        zl = lambda *s: torch.zeros(*s, dtype=torch.long, device=dev)  # noqa: E731
        sizes = [(1, T) for T in sorted(self.prefill_tokens, reverse=True)]
        sizes += [(B, None) for B in sorted(self.buckets, reverse=True)]
        for B, T in sizes:
            shape = self._shape(B, T)
            N = shape.tokens
            bk = _Bucket(B, zl(N), zl(N), shape, zl(shape.row_vector_size), zl(B),
                         {j: zl(B) for j in range(2, self.draft_len + 1)}, prefill=T is not None)
            bk.draft_in = torch.zeros(B, n, d, dtype=self.model.embed.weight.dtype, device=dev)
            if bk.prefill:
                self._p[T] = bk
            else:
                self._b[B] = bk
            steps = [("target", lambda: self._target(bk), "target_out")]
            if self.with_mtp:
                steps.append(("mtp", lambda: self._mtp(bk), "mtp_out"))
                for j in range(2, self.draft_len + 1):
                    steps.append((f"draft{j}", (lambda j=j: self._draft(bk, j)), j))
                if self.keep_up:
                    steps.append(("keep", lambda: self._keep(bk), "keep_out"))
            if self.whole_step and not bk.prefill:
                steps.append(("step", lambda: self._step(bk), "step_out"))
                if self.keep_up:
                    steps.append(("bare", lambda: self._bare(bk), "bare_out"))
            for name, fn, slot in steps:  # eager first: the static outputs exist, kernels are loaded
                self._store(bk, slot, fn())
            if not self.capture:
                continue
            torch.cuda.synchronize()
            with _collector_paused():
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
        bk = self._bucket(plan) if self.matches(plan) else None
        if bk is None:
            raise GraphOrderError(f"{name}: no graph bucket of batch {plan.shape.batch}, {plan.shape.tokens} tokens")
        if bk.plan is not plan:
            raise GraphOrderError(f"{name}: bucket {bk.batch} holds the tables of another step; replay target(plan)"
                                  f" of this step first")
        if not bk.ran or bk.ran[-1] != previous:
            raise GraphOrderError(f"{name}: this step's graphs so far are {bk.ran}; {name} runs after {previous}")
        bk.ran.append(name)
        return bk

    @torch.no_grad()
    def target(self, plan, ids: torch.Tensor):
        """-> (streams [N, n, d], logits [N, V] of every row of the padded step; None from a prefill bucket)."""
        bk = self._bucket(plan)
        bk.plan, bk.ran = plan, ["target"]
        bk.rows.copy_(plan.rows)
        bk.ids.copy_(ids)
        self.num_replays += 1
        self.num_prefill_replays += bk.prefill
        out = self._run(bk, "target", lambda: self._target(bk))
        if out is not None:
            bk.target_out = out
        return bk.target_out

    @property
    def step_drafts(self) -> int:
        """The drafts each row of the whole-step graph verifies and proposes (0 in a keep-up runner)."""
        return 0 if self.keep_up else self.draft_len

    def has_step(self, plan) -> bool:
        """Whether ``plan``'s bucket has a whole-step graph (``whole_step``; decode buckets only)."""
        return self.whole_step and self.matches(plan) and not self._bucket(plan).prefill

    @torch.no_grad()
    def step(self, plan, ids: torch.Tensor) -> StepGraphOut:
        """The whole-step graph of ``plan``'s bucket (see ``_step``); its packed outputs queued for the host.
        The separate MTP graphs do not follow it (the bucket's tables are the target graph's)."""
        if not self.has_step(plan):
            raise GraphOrderError(f"step: no whole-step graph for batch {plan.shape.batch}")
        bk = self._bucket(plan)
        bk.plan, bk.ran = plan, ["step"]
        bk.rows.copy_(plan.rows)
        bk.ids.copy_(ids)
        self.num_replays += 1
        self.num_whole_steps += 1
        bare = self.keep_up and not plan.mtp_keep_up  # (a paused step far from the next probe)
        self.num_bare_steps += bare
        name, fn = ("bare", self._bare) if bare else ("step", self._step)
        out = self._run(bk, name, lambda: fn(bk))
        if out is not None:
            setattr(bk, f"{name}_out", out)
        out = getattr(bk, f"{name}_out")
        return replace(out, host=HostCopy(out.packed))

    @torch.no_grad()
    def mtp(self, plan, next_ids: torch.Tensor):
        """The MTP catch-up pass of the same step (tables already loaded by ``target``)."""
        return self._catch_up(plan, next_ids, "mtp", self._mtp)

    @torch.no_grad()
    def keep(self, plan, next_ids: torch.Tensor) -> None:
        """The MTP catch-up pass of the same step reduced to what later passes read (``model.mtp_keep_up``: the
        MTP layer's window rows): drafting paused."""
        return self._catch_up(plan, next_ids, "keep", self._keep)

    def _catch_up(self, plan, next_ids, name: str, fn):
        bk = self._after(plan, name, "target")
        bk.next_ids.copy_(next_ids)
        out = self._run(bk, name, lambda: fn(bk))
        if out is not None:
            setattr(bk, f"{name}_out", out)
        return getattr(bk, f"{name}_out")

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
        for bk in [*self._b.values(), *self._p.values()]:
            for g in bk.graphs.values():
                g.reset()
            bk.graphs.clear()
        self._b.clear()
        self._p.clear()
        self.pool = None
        self.released = True


def build_graphs(runner, spec: GraphSpec | None, capture: bool = True) -> GraphRunner | None:
    """Give ``runner`` its GraphRunner for ``spec`` (the resolved config's) and prepare it: after the cache is
    sized, before warmup. Nothing when ``spec`` is None or the runner is not on the kernel path. Multi-rank
    runs call this on every rank with the same spec, at the same point, so the captures (and the collectives
    inside them) line up, largest bucket first."""
    if spec is None or not runner.use_kernels:
        return None
    # (the whole-step graph only where acceptance stays on the device: not with attention-DP lanes)
    capture = capture and runner.storage.device.type == "cuda"
    runner.graphs = GraphRunner(runner.model, runner.storage, spec, capture=capture,
                                whole_step=runner.whole_step_graphs, tail_rows=runner.mtp_tail_rows)
    with runner.pass_context():  # captured under the same GEMM row counts as the eager passes
        runner.graphs.prepare()
        if spec.keep_up and runner.pauses_drafting:
            # one row per request (the steps whose drafting is paused, and their probes), in the same pool
            keep = GraphRunner(runner.model, runner.storage, replace(spec, rows_per_seq=1, prefill_tokens=()),
                               capture=capture, whole_step=runner.whole_step_graphs, keep_up=True)
            keep.pool = runner.graphs.pool
            keep.prepare()
            runner.keep_graphs = keep
    return runner.graphs


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while graphs are captured (one collection first). A collection during
    a capture can reach an earlier engine's objects, and freeing its graphs' memory pools calls cudaFree, which a
    capture does not allow: the capture is invalidated ("operation failed due to a previous error during
    capture"). ``torch.cuda.graph`` itself no longer collects on entry (only under
    ``torch.compiler.config.force_cudagraph_gc``). Seen once on an H100 in tests/test_kernel_mini_cuda.py (the
    whole-step graph of the test after three others), not reproduced in two reruns, so this is the likely cause,
    not a proven one."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
