"""The model runner: executes the model's cached path on a step plan.

``forward`` runs the target layers over every scheduled token (prefill chunks, decode tokens, verify
tokens alike) and returns the logits the sampler needs. ``propose`` runs the MTP layer: first a catch-up
pass over the same rows (it writes the MTP layer's window rows for every new position, and its row for the
newest committed position yields draft 1; in a long prefill chunk only the last rows, all the ring keeps:
``mtp_rows.py``), then draft steps 2..k, each one token per request, from the
plan's draft tables. The MTP layer's cache lives in the same storage as every other layer's (R1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..cache.storage import CacheStorage
from ..model.model import DeepseekV4
from ..model.rows import ROWS, fixed_rows
from ..transfer import HostCopy, to_device
from .backend import CachedBackend
from .cuda_backend import CudaBackend, PrefillCudaBackend
from .mtp_rows import MtpRows, host_keep, inert, padded, row_counts, select
from .request import PENDING
from .scheduler import ScheduledSeq
from .spec import DeviceVerdict


@dataclass(frozen=True)
class DraftInputs:
    """One batch's (or one attention-DP lane's) MTP inputs, from the verify results: host ints (what the
    multi-rank driver sends), or device tensors when acceptance stayed on the device (``DeviceVerdict``)."""

    # per step token at position p: token p+1 after this step's emission (0 past it)
    next_ids: tuple[int, ...] | torch.Tensor
    picks: tuple[int, ...] | torch.Tensor  # per request: the step row of its newest committed position
    new_lens: tuple[int, ...] | torch.Tensor  # per request: committed length after acceptance
    active: tuple[int, ...]  # batch rows that draft

    def positions(self, j: int, device) -> torch.Tensor:
        """The sequence positions of draft j (1-based) of the active rows, ``new_lens`` + j, on ``device``."""
        if isinstance(self.new_lens, torch.Tensor):
            return self.new_lens[to_device(list(self.active), self.new_lens.device)] + j
        return to_device([self.new_lens[b] + j for b in self.active], device)


def target_inputs(seqs: Sequence[ScheduledSeq]) -> tuple[list[int], list[int], list[int]]:
    """(token ids, logit rows, logit rows per seq): every sampled seq's verify rows (its last row when it
    has no drafts)."""
    ids = [t for s in seqs for t in s.token_ids]
    rows, counts, start = [], [], 0
    for s in seqs:
        if s.sample:
            k1 = len(s.drafts) + 1
            rows.extend(range(start + s.num_new - k1, start + s.num_new))
            counts.append(k1)
        else:
            counts.append(0)
        start += s.num_new
    return ids, rows, counts


def draft_inputs(seqs: Sequence[ScheduledSeq], num_computed: Sequence[int], num_accepted: Sequence[int],
                 drafting: Sequence[bool]) -> DraftInputs:
    """The catch-up pass input for the row at position p is the token at p+1 of the request's sequence after
    this step's emission (rows past the accepted ones get 0: their writes are rolled back)."""
    next_ids, picks, start = [], [], 0
    for b, s in enumerate(seqs):
        next_ids += _next_tokens(s.request, num_computed[b], s.num_new)
        picks.append(start + num_accepted[b] - 1)
        start += s.num_new
    return DraftInputs(tuple(next_ids), tuple(picks), tuple(C + a for C, a in zip(num_computed, num_accepted)),
                       tuple(b for b in range(len(seqs)) if drafting[b]))


def _next_tokens(req, C: int, n: int) -> list[int]:
    """The token after each of positions C .. C+n-1 of ``req``, 0 past its length (pending ones as PENDING)."""
    stop = max(C + 1, min(C + 1 + n, req.num_tokens))
    out = list(req.token_range(C + 1, stop))
    return out + [0] * (n - len(out))


def device_draft_inputs(seqs: Sequence[ScheduledSeq], num_computed: Sequence[int], verdict: DeviceVerdict,
                        drafting: Sequence[bool], computed: torch.Tensor | None = None) -> DraftInputs:
    """``draft_inputs`` from a verdict still on the device. A row before a seq's verify rows takes the next
    token of the request as the host knows it; verify row j takes the target's token there if j <= the
    accepted drafts a (for j < a it equals the draft the next row checked; j == a is the bonus token), else 0.
    ``computed``: each seq's C on the device (the plan's C column), when the host's ``num_computed`` is only a
    lower bound for some (a request whose previous step is not read back yet: its rows are all verify rows,
    so the host's C is read only for rows that are not)."""
    base, vrow = [], []  # per step row: the host's next token; its row in verdict.target_ids (-1: not a verify row)
    seq_of, first_v, starts, r, start = [], [], [], 0, 0
    for b, s in enumerate(seqs):  # (list slices, not a loop over rows: a prompt chunk has thousands)
        n, nv = s.num_new, verdict.rows_per_seq[b]
        base += _next_tokens(s.request, num_computed[b], n - nv) + [0] * nv
        vrow += [-1] * (n - nv) + list(range(r, r + nv))
        first_v += [r] * n
        seq_of += [b] * n
        r += nv
        starts.append(start)
        start += s.num_new
    N, B = len(base), len(seqs)
    dev = verdict.target_ids.device
    t = to_device(base + vrow + first_v + seq_of + starts + ([] if computed is not None else list(num_computed)),
                  dev)
    base_t, vrow_t, first_t, seq_t = t[:N], t[N:2 * N], t[2 * N:3 * N], t[3 * N:4 * N]
    starts_t = t[4 * N:4 * N + B]
    C_t = computed[:B].to(dev) if computed is not None else t[4 * N + B:]
    target = verdict.target_ids[vrow_t.clamp(min=0)] if verdict.target_ids.numel() else torch.zeros_like(base_t)
    j = vrow_t - first_t  # the row's index among its seq's verify rows
    next_ids = torch.where(vrow_t < 0, base_t, torch.where(j <= verdict.accepted_drafts[seq_t], target, 0))
    rows = verdict.accepted_rows
    return DraftInputs(next_ids, starts_t + rows - 1, C_t + rows, tuple(b for b in range(B) if drafting[b]))


def uniform_draft_inputs(target: torch.Tensor, accepted: torch.Tensor, computed: torch.Tensor) -> DraftInputs:
    """``device_draft_inputs`` on static shapes (a CUDA graph's), where every batch row's k+1 step rows are all
    verify rows: ``target`` [B, k+1] the argmax at each, ``accepted`` [B] its accepted drafts a, ``computed``
    [B] its C. Row j's catch-up input is target j when j <= a, else 0; draft 1 comes from row a; the committed
    length is C + 1 + a. Every row drafts."""
    B, k1 = target.shape
    j = torch.arange(k1, device=target.device)
    next_ids = torch.where(j[None, :] <= accepted[:, None], target, 0).reshape(-1)
    picks = torch.arange(B, device=target.device) * k1 + accepted
    return DraftInputs(next_ids, picks, computed[:B] + 1 + accepted, tuple(range(B)))


def draft_inputs_for(seqs, plan, accepted: Sequence[int] | DeviceVerdict, drafting) -> DraftInputs:
    """The MTP inputs of ``plan``'s step from host accepted counts or from a verdict on the device (which reads
    each seq's C from the plan's C column on the device: a request's may be known only there)."""
    if isinstance(accepted, DeviceVerdict):
        return device_draft_inputs(seqs, plan.num_computed, accepted, drafting, computed=plan.rows[:len(seqs)])
    if any(plan.unsettled):
        raise ValueError("a plan with unsettled rows drafts from a verdict on the device, not from host counts")
    return draft_inputs(seqs, plan.num_computed, accepted, drafting)


@dataclass(frozen=True)
class DraftTokens:
    """The MTP's drafts of one step, left on the device: ``tokens[i]`` are the k drafts of seq ``active[i]``;
    draft j (1-based) of seq b is the token at position ``new_lens[b] + j`` of its request."""

    num_seqs: int
    active: tuple[int, ...]
    tokens: torch.Tensor | None  # [len(active), k] (None: no seq drafts)
    new_lens: tuple[int, ...] | torch.Tensor  # per seq: its committed length after this step's acceptance

    def tolist(self) -> list[list[int]]:
        """Per seq, its drafts on the host ([] for a seq that does not draft); reads the device."""
        return self.per_seq(self.tokens.tolist() if self.tokens is not None else [])

    def per_seq(self, rows: list[list[int]]) -> list[list[int]]:
        """``rows`` (the active seqs' drafts, as ``tokens`` holds them) spread over every seq of the step."""
        out: list[list[int]] = [[] for _ in range(self.num_seqs)]
        for b, row in zip(self.active, rows):
            out[b] = row
        return out


@dataclass(frozen=True)
class LaunchedStep:
    """A step the overlap scheduler left running: the next step's inputs on the device, one row per sampled
    request, and what the host will read of it. Without MTP a row is the sampled token (``tokens``, on its
    way to the host in ``host``). An MTP step (``mtp`` set) keeps its whole verdict on the device: a row is
    the token after the accepted drafts, then the new drafts."""

    seqs: list[ScheduledSeq]
    inputs: torch.Tensor  # [R, W] device: row r = the next step's pending inputs of the r-th sampled request
    row_of: dict  # request id -> its row of ``inputs``
    host: HostCopy | None = None  # without MTP: the tokens, queued for the host
    logprobs: object = None  # sampler.StepLogprobs of the tokens, for the requests that ask (read with them)
    mtp: object = None  # an overlapped MTP step: engine.LaunchedMtp (its plan, verdict and proposals)


def pending_inputs(seqs: Sequence[ScheduledSeq], prev: LaunchedStep | None) -> tuple[list[int], list[int]]:
    """(step positions, flat indices into ``prev.inputs``) of the inputs still on the device. A request's
    pending inputs are its newest, so they end its row of the step: the last m of them are the first m of its
    row of ``prev.inputs`` (m = 1 without MTP; 1 + k, the bonus token and the drafts, after an MTP step)."""
    dst, src, off = [], [], 0
    for s in seqs:
        m = 0
        while m < s.num_new and s.token_ids[s.num_new - 1 - m] == PENDING:
            m += 1
        if m:
            if prev is None or s.request.request_id not in prev.row_of:
                raise RuntimeError(f"request {s.request.request_id!r}: an input token is still on the device but"
                                   " no overlapped step holds it")
            W = prev.inputs.shape[1]
            if m > W:
                raise RuntimeError(f"request {s.request.request_id!r}: {m} inputs are still on the device, the"
                                   f" overlapped step holds {W}")
            r = prev.row_of[s.request.request_id]
            dst.extend(range(off + s.num_new - m, off + s.num_new))
            src.extend(range(r * W, r * W + m))
        off += s.num_new
    return dst, src


@dataclass
class TargetOutput:
    streams: torch.Tensor  # [N_pad, n, d] last-layer hc streams
    logits: list[torch.Tensor | None]  # per seq: [rows, V] at its sampled / verify rows, None if not sampled
    rows: torch.Tensor | None = None  # the same rows as one [R, V] tensor, seqs in order (None: not at hand)
    inputs: torch.Tensor | None = None  # [N_pad] the step's input ids on the device (pending ones filled in)
    step: object = None  # graphs.StepGraphOut: the step ran as one graph (verdict and drafts computed with it)

    def all_rows(self) -> torch.Tensor:
        """Every sampled / verify row of the step as one [R, V] tensor, seqs in order (``rows``, or the
        concatenation of the per-seq blocks when a multi-rank lane split left them apart)."""
        return self.rows if self.rows is not None else torch.cat([b for b in self.logits if b is not None])


class ModelRunner:
    supports_overlap = True  # the engine may feed it inputs still on the device (the overlap scheduler)
    whole_step_graphs = True  # with MTP, a graph bucket also captures the whole greedy step (graphs.StepGraphOut)
    # the engine may pause MTP drafting (spec_pause.py): steps of one row, keep-up passes (on several ranks too:
    # each lane's plan carries the keep-up decision, and the keep-up pass has no collective)
    pauses_drafting = True
    # the MTP catch-up pass over the rows its window keeps only, the last swa_cap of each request (mtp_rows.py;
    # on several ranks without attention-DP lanes only, see LaneRunner.lane_settings); False: over every row
    mtp_tail_rows = True
    # those rows padded with inert ones to a power of two (mtp_rows.padded), each of which warmup runs once
    # (warm_mtp_rows; on every rank of a multi-rank run alike)
    mtp_rows_padded = True

    def __init__(self, model: DeepseekV4, storage: CacheStorage, device, attention_backend: str = "auto",
                 batch_invariant: bool = False):
        self.model, self.storage, self.device = model, storage, torch.device(device)
        # every pass under rows.fixed_rows: a row's result independent of the batch (EngineConfig.batch_invariant)
        self.batch_invariant = batch_invariant
        # the Triton kernel path for every step (CUDA; bf16, fp32 or FP8 cache), else the plain-torch path
        self.use_kernels = attention_backend in ("auto", "triton") and CudaBackend.supports(storage)
        if attention_backend == "triton" and not self.use_kernels:
            raise ValueError("attention_backend='triton' needs a CUDA device (or attention_backend='auto'/'torch')")
        self.max_step_rows = 1 + storage.layout.max_draft_len  # the most rows a decode-like step adds

        # the most rows a kept-rows MTP pass can have (mtp_rows.max_kept_rows; the engine sets it, as every rank
        # does): its padding's largest row count. None: powers of two only, and warmup runs none of them
        self.mtp_rows_max: int | None = None
        self.graphs = None  # a GraphRunner once graphs are prepared (CUDA, not enforce_eager)
        # with MTP, a GraphRunner of one row per request beside it: steps whose drafting is paused, probes
        self.keep_graphs = None

    def release_graphs(self) -> None:
        """Destroy the CUDA graphs (later steps would run eagerly; ``graphs`` keeps its buckets and counts)."""
        for g in (self.keep_graphs, self.graphs):
            if g is not None:
                g.release()

    def padding_for(self, seqs: list[ScheduledSeq]) -> dict:
        """begin_step padding that makes the step replay a CUDA graph bucket (empty: run eagerly)."""
        if self.graphs is None:
            return {}
        num_new = [s.num_new for s in seqs]
        padding = self._bucket_padding(len(seqs), num_new)
        if padding:
            return padding
        tokens = self.graphs.prefill_bucket_for(len(seqs), num_new)
        return self.graphs.prefill_padding(tokens) if tokens else {}

    def _bucket_padding(self, batch: int, num_new: list[int]) -> dict:
        """The padding of the first runner (verify buckets, then the keep-up runner's of one row a request) with a
        decode bucket for ``batch`` requests adding ``num_new`` rows each ({}: none)."""
        for g in (self.graphs, self.keep_graphs):
            bucket = g.bucket_for(batch, num_new) if g is not None else None
            if bucket:
                return g.padding(bucket)
        return {}

    def _graphs_of(self, plan):
        """The GraphRunner with a bucket ``plan`` was built for (None: the step runs eagerly)."""
        for g in (self.graphs, self.keep_graphs):
            if g is not None and g.matches(plan):
                return g
        return None

    def _graphed(self, plan) -> bool:
        return self._graphs_of(plan) is not None

    def has_step_graph(self, plan, drafts: int) -> bool:
        """Whether ``plan``'s step can run as one graph: target pass, greedy acceptance and the MTP drafts
        (``forward(whole_step=True)``; every seq must sample greedily, verifying and proposing ``drafts``: the
        full draft length, or 0 on a keep-up bucket when drafting is paused)."""
        return any(g is not None and g.step_drafts == drafts and g.has_step(plan)
                   for g in (self.graphs, self.keep_graphs))

    def _backend(self, plan):
        if not self.use_kernels:
            return CachedBackend.for_step(plan, self.storage)
        if max(plan.num_new) <= self.max_step_rows:  # decode-like: the ring in place, written first
            return CudaBackend.for_step(plan, self.storage)
        return PrefillCudaBackend.for_step(plan, self.storage)

    def _mtp_rows(self, plan) -> MtpRows | None:
        """The rows the MTP catch-up pass of ``plan``'s step runs over when fewer than the step's (``mtp_rows.py``):
        each request's last swa_cap, or its last ``plan.mtp_keep_last`` (a paused step near a probe)."""
        if not (self.mtp_tail_rows and self.model.mtp_window_only):
            return None
        cap = self.storage.layout.swa_cap
        keep = host_keep(plan.num_new, cap if plan.mtp_keep_last is None else min(cap, plan.mtp_keep_last))
        if keep is None:
            return None
        return select(plan, padded(keep, self.mtp_rows_max) if self.mtp_rows_padded else keep, plan.swa_step_base)

    def warm_mtp_rows(self) -> list[int]:
        """Run the kept-rows passes (the keep-up pass, the whole MTP pass) once over inert rows at every row count
        ``padded`` gives (warmup); returns the row counts ([]: no such passes, or no ``mtp_rows_max`` given)."""
        if not (self.mtp_rows_padded and self.mtp_tail_rows and self.model.mtp_window_only
                and self.mtp_rows_max):
            return []
        counts = row_counts(self.mtp_rows_max)
        self.run_inert_mtp_rows(counts)
        return counts

    @torch.no_grad()
    def run_inert_mtp_rows(self, counts: Sequence[int]) -> None:
        """The keep-up pass and the whole MTP pass over ``M`` inert rows, for each ``M`` of ``counts``."""
        model, st = self.model, self.storage
        n, d = model.cfg.hc_mult, model.cfg.hidden_size
        base = st.layout.step_base(st.layout.swa_cap, st.num_slots)
        with self.pass_context():
            for M in counts:
                sub = inert(M, st.layout.window, self.device)
                X = torch.zeros(M, n, d, dtype=model.embed.weight.dtype, device=self.device)
                ids = torch.zeros(M, dtype=torch.long, device=self.device)
                model.mtp_keep_up(X, ids, self._rows_backend(sub, base))
                model.mtp_streams(X, ids, self._rows_backend(sub, base))

    def _rows_backend(self, sub: MtpRows, swa_step_base: int):
        """The backend of a pass over ``sub``'s rows (up to swa_cap a request: the prefill path on the kernels)."""
        if self.use_kernels:
            return PrefillCudaBackend.for_draft(sub, self.storage, swa_step_base)
        return CachedBackend.for_draft(sub, self.storage)

    def _draft_backend(self, plan, tables):
        if self.use_kernels:
            return CudaBackend.for_draft(tables, self.storage, plan.swa_step_base)
        return CachedBackend.for_draft(tables, self.storage)

    def _ids(self, values: list[int], length: int) -> torch.Tensor:
        """Token ids padded with 0 to ``length``, on the device (a copy that does not wait for it)."""
        return to_device(list(values) + [0] * (length - len(values)), self.device)

    def _padded(self, values: Sequence[int] | torch.Tensor, length: int) -> torch.Tensor:
        """``values`` (host ints or a device tensor) padded with 0 to ``length``, on the device (a new tensor)."""
        if not isinstance(values, torch.Tensor):
            return self._ids(list(values), length)
        if values.shape[0] == length:
            return values.clone()
        out = torch.zeros(length, dtype=torch.long, device=self.device)
        out[:values.shape[0]] = values
        return out

    def pass_context(self):
        """The context every pass (and graph capture) runs in: fixed GEMM row counts when batch-invariant."""
        return fixed_rows(ROWS if self.batch_invariant else None)

    # ---- the passes on plain inputs (what every rank of a multi-rank run also calls) -----------------
    @torch.no_grad()
    def run_target(self, plan, token_ids: Sequence[int], logit_rows: Sequence[int], graphed: bool = False,
                   pending: tuple | None = None, whole_step: bool = False):
        """-> (streams, logits of ``logit_rows``, the input ids on the device, the whole-step graph's outputs or
        None): ``_run_target`` in the pass context."""
        with self.pass_context():
            return self._run_target(plan, token_ids, logit_rows, graphed, pending, whole_step)

    def _run_target(self, plan, token_ids, logit_rows, graphed, pending, whole_step=False):
        """-> (last-layer streams [N_pad, n, d], logits [len(logit_rows), V] or None, the input ids [N_pad] on the
        device, the whole-step graph's outputs or None). ``graphed``: replay the plan's CUDA graph bucket (or run
        its static buffers eagerly when not capturing). ``pending``: (step positions, indices into ``values``,
        ``values``: a device tensor) of the inputs that are still on the device (PENDING in ``token_ids``).
        ``whole_step``: replay the bucket's whole-step graph (every step row is a logit row)."""
        ids, idx = self._step_inputs(plan, token_ids, logit_rows, pending)
        R = len(logit_rows)
        if whole_step:
            if idx != slice(0, plan.num_tokens):
                raise RuntimeError(f"step {plan.step_id}: a whole-step graph samples every row of the step")
            out = self._graphs_of(plan).step(plan, ids)
            return out.streams, out.logits[:R], ids, out
        if graphed:
            self._check_graphed(plan)
            X, all_logits = self._graphs_of(plan).target(plan, ids)
        else:
            X = self.model.streams(ids, self._backend(plan))
        logits = None
        if idx is not None:  # (a prefill graph leaves the logits of its sampled rows to this)
            logits = all_logits[idx] if graphed and all_logits is not None else self.model.logits_from_streams(X[idx])
        return X, logits, ids, None

    def _step_inputs(self, plan, token_ids, logit_rows, pending):
        """(the step's input ids [N_pad] on the device, its logit rows: None, a slice when they are the step's
        first rows (a verify step: no index), else a device index), with one host-to-device copy at most. When
        every input is the previous step's in its order (an MTP decode batch in steady state) no host ids are
        sent: the inputs are one device copy."""
        dst, src, values = pending if pending else ((), (), None)
        R, P = len(logit_rows), len(dst)
        prefix = list(logit_rows) == list(range(R))
        index = [] if prefix else list(logit_rows)
        if P and P == len(token_ids) and list(dst) == list(range(P)) and list(src) == list(range(P)):
            ids = self._padded(values[:P], plan.shape.tokens)
            t = to_device(index, self.device) if index else None
        else:
            ids = self._ids([max(t, 0) for t in token_ids] if pending else token_ids, plan.shape.tokens)
            # one copy for the logit rows and the pending inputs' (positions, flat indices into ``pending[2]``)
            t = to_device(index + list(dst) + list(src), self.device) if index or P else None
            if P:
                at = len(index)
                ids[t[at:at + P]] = values[t[at + P:]]
        return ids, (None if not R else slice(0, R) if prefix else t[:R])

    def _check_graphed(self, plan):
        if self._graphs_of(plan) is None:
            raise RuntimeError(f"step {plan.step_id}: told to replay a CUDA graph but the plan (batch"
                               f" {plan.shape.batch}, {plan.shape.tokens} tokens) fits no bucket of"
                               f" {None if self.graphs is None else self.graphs.buckets}")

    @torch.no_grad()
    def run_drafts(self, plan, X: torch.Tensor, inp: DraftInputs, draft_len: int, any_active: bool,
                   pick: Callable[[int, Callable[[], torch.Tensor]], Sequence[int]], graphed: bool = False) -> None:
        with self.pass_context():
            self._run_drafts(plan, X, inp, draft_len, any_active, pick, graphed)

    def _run_drafts(self, plan, X, inp, draft_len, any_active, pick, graphed) -> None:
        """MTP catch-up pass (reduced to the MTP layer's window rows when nothing drafts, eagerly or on a keep-up
        bucket: drafting paused, a prefill chunk that samples nothing), then (if any lane drafts) draft passes
        2..draft_len. After pass j,
        ``pick(j, logits_fn)`` returns the draft tokens of the active rows (``logits_fn()`` gives their MTP
        logits [A, V]), a device tensor (kept there) or host ints; they are the inputs of pass j+1.
        ``graphed``: the plan's CUDA graphs (the target pass of the same step replayed them too)."""
        if not any_active and not plan.mtp_keep_up:
            return  # a paused step far from the next probe (prompt rows too): the MTP layer's rows left stale
        model = self.model
        next_ids = self._padded(inp.next_ids, plan.shape.tokens)
        graphs = self._graphs_of(plan) if graphed else None
        sub = None if graphed else self._mtp_rows(plan)  # (a prefill graph bucket selects its own)
        if sub is not None:
            X, next_ids, backend = sub.rows(X), sub.ids(next_ids), self._rows_backend(sub, plan.swa_step_base)
        else:
            backend = None if graphed else self._backend(plan)
        if not any_active and (graphs.keep_up if graphs is not None else self.pauses_drafting):
            # nothing drafts: only the MTP layer's window rows (not on several ranks: every rank runs one pass)
            if graphs is not None:
                graphs.keep(plan, next_ids)
            else:
                model.mtp_keep_up(X, next_ids, backend)
            return
        if graphed:
            X_mtp, mtp_logits, inv = graphs.mtp(plan, next_ids)
        else:
            X_mtp, inv = model.mtp_streams(X, next_ids, backend), (None if sub is None else sub.inv)
        if not any_active:
            return
        active = list(inp.active)
        active_t = to_device(active, self.device)  # a plain copy here would wait for the target pass
        rows = (inp.picks[active_t] if isinstance(inp.picks, torch.Tensor)
                else to_device([inp.picks[b] for b in active], self.device))
        if inv is not None:  # step rows -> rows of the pass's subset (a draft's row is always kept)
            rows = inv[rows]
        V = model.cfg.vocab_size

        def logits_of(Xs, all_logits, idx):
            if not active:
                return lambda: torch.zeros(0, V, device=self.device)
            if all_logits is not None:  # (a graph's; a prefill graph's MTP pass leaves them to this)
                return lambda: all_logits[idx]
            return lambda: model.mtp_logits_from_streams(Xs[idx])

        toks = pick(1, logits_of(X_mtp, mtp_logits if graphed else None, rows))
        zeros = torch.zeros(plan.shape.batch, dtype=torch.long, device=self.device) if draft_len > 1 else None
        b_pad = plan.shape.batch
        new_lens = self._padded(inp.new_lens, b_pad)
        X_prev = torch.zeros(b_pad, *X_mtp.shape[1:], dtype=X_mtp.dtype, device=self.device)
        X_prev[active_t] = X_mtp[rows]
        for j in range(2, draft_len + 1):
            if isinstance(toks, torch.Tensor):  # the drafts stay on the device
                ids = zeros.index_copy(0, active_t, toks)
            else:
                row_toks = [0] * b_pad
                for b, t in zip(active, toks):
                    row_toks[b] = t
                ids = self._ids(row_toks, b_pad)
            if graphed:
                X_prev, all_logits = graphs.draft(plan, j, new_lens, ids, X_prev if j == 2 else None)
            else:
                tables = plan.draft.step_tables(j, new_lens)
                X_prev, all_logits = model.mtp_streams(X_prev, ids, self._draft_backend(plan, tables)), None
            toks = pick(j, logits_of(X_prev, all_logits, active_t))

    # ---- the engine's calls ------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, seqs: list[ScheduledSeq], plan, prev: LaunchedStep | None = None,
                whole_step: bool = False) -> TargetOutput:
        """The target pass over the step. ``prev``: the overlapped step still running, whose tokens are the
        inputs this step's requests have as PENDING. ``whole_step`` (``has_step_graph``): the greedy verdict
        and the MTP drafts are computed with it, in one graph (``TargetOutput.step``)."""
        ids, rows, counts = target_inputs(seqs)
        dst, src = pending_inputs(seqs, prev)
        pending = (dst, src, prev.inputs.reshape(-1)) if dst else None
        with self.pass_context():
            X, logits, inputs, step = self._run_target(plan, ids, rows, self._graphed(plan), pending, whole_step)
        per_seq, off = [], 0
        for c in counts:
            per_seq.append(logits[off:off + c] if c else None)
            off += c
        return TargetOutput(X, per_seq, logits, inputs, step)

    @staticmethod
    def step_graph_drafts(target: TargetOutput, num_seqs: int) -> DraftTokens:
        """The MTP drafts a whole-step graph computed (every seq of the step drafts)."""
        out = target.step
        return DraftTokens(num_seqs, tuple(range(num_seqs)), out.drafts[:num_seqs], out.new_lens[:num_seqs])

    @torch.no_grad()
    def propose(self, seqs: list[ScheduledSeq], plan, target: TargetOutput,
                num_accepted: list[int] | DeviceVerdict, drafting: list[bool], draft_len: int,
                choose: Callable[[list[int], torch.Tensor, Callable], torch.Tensor]) -> DraftTokens:
        """MTP drafts for every seq with ``drafting`` set, after ``num_accepted`` rows of each seq's step were
        accepted (host counts, or a verdict still on the device). ``choose(seq_indices, logits [A, V],
        positions) -> tokens`` turns the MTP logits of those seqs into draft tokens on the device (argmax, or
        keyed draws; ``positions()`` the drafts' sequence positions); they feed the next pass there, and stay
        there (``DraftTokens.tolist`` reads them)."""
        inp = draft_inputs_for(seqs, plan, num_accepted, drafting)
        chosen: list[torch.Tensor] = []

        def pick(j, logits_fn):
            toks = choose(list(inp.active), logits_fn(), lambda: inp.positions(j, self.device))
            chosen.append(toks)
            return toks

        self.run_drafts(plan, target.streams, inp, draft_len, bool(inp.active), pick, self._graphed(plan))
        tokens = torch.stack(chosen, 1) if inp.active else None
        return DraftTokens(len(seqs), tuple(inp.active), tokens, inp.new_lens)
