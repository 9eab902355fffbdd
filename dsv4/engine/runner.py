"""The model runner: executes the model's cached path on a step plan.

``forward`` runs the target layers over every scheduled token (prefill chunks, decode tokens, verify
tokens alike) and returns the logits the sampler needs. ``propose`` runs the MTP layer: first a catch-up
pass over the same rows (it writes the MTP layer's window rows for every new position, and its row for the
newest committed position yields draft 1), then draft steps 2..k, each one token per request, from the
plan's draft tables. The MTP layer's cache lives in the same storage as every other layer's (R1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..cache.storage import CacheStorage
from ..model.model import DeepseekV4
from .backend import CachedBackend
from .cuda_backend import CudaBackend
from .scheduler import ScheduledSeq


@dataclass
class TargetOutput:
    streams: torch.Tensor  # [N_pad, n, d] last-layer hc streams
    logits: list[torch.Tensor | None]  # per seq: [rows, V] at its sampled / verify rows, None if not sampled


class ModelRunner:
    def __init__(self, model: DeepseekV4, storage: CacheStorage, device, attention_backend: str = "auto"):
        self.model, self.storage, self.device = model, storage, torch.device(device)
        # the Triton kernel path for decode-like steps (CUDA, non-fp8 cache), else the plain-torch path
        self.use_kernels = attention_backend in ("auto", "triton") and CudaBackend.supports(storage)
        if attention_backend == "triton" and not self.use_kernels:
            raise ValueError("attention_backend='triton' needs a CUDA device and a bf16/fp32 KV cache")
        self.max_step_rows = 1 + storage.layout.max_draft_len  # the most rows a decode-like step adds

        self.graphs = None  # a GraphRunner once graphs are prepared (CUDA, not enforce_eager)

    def padding_for(self, seqs: list[ScheduledSeq]) -> dict:
        """begin_step padding that makes the step replay a CUDA graph bucket (empty: run eagerly)."""
        if self.graphs is None:
            return {}
        bucket = self.graphs.bucket_for(len(seqs), [s.num_new for s in seqs])
        return self.graphs.padding(bucket) if bucket else {}

    def _graphed(self, plan) -> bool:
        return self.graphs is not None and self.graphs.matches(plan)

    def _backend(self, plan):
        if self.use_kernels and max(plan.num_new) <= self.max_step_rows:
            return CudaBackend.for_step(plan, self.storage)
        return CachedBackend.for_step(plan, self.storage)

    def _draft_backend(self, plan, tables):
        if self.use_kernels:
            return CudaBackend.for_draft(tables, self.storage, plan.swa_step_base)
        return CachedBackend.for_draft(tables, self.storage)

    def _ids(self, values: list[int], length: int) -> torch.Tensor:
        out = torch.zeros(length, dtype=torch.long)
        out[: len(values)] = torch.tensor(values, dtype=torch.long)
        return out.to(self.device)

    @torch.no_grad()
    def forward(self, seqs: list[ScheduledSeq], plan) -> TargetOutput:
        n_pad = plan.positions.shape[0]
        ids = self._ids([t for s in seqs for t in s.token_ids], n_pad)
        graphed = self._graphed(plan)
        if graphed:
            X, all_logits = self.graphs.target(plan, ids)
        else:
            X = self.model.streams(ids, self._backend(plan))
        rows, counts = [], []
        start = 0
        for s in seqs:
            if s.sample:
                k1 = len(s.drafts) + 1  # the verify rows (just the last row when there are no drafts)
                rows.extend(range(start + s.num_new - k1, start + s.num_new))
                counts.append(k1)
            else:
                counts.append(0)
            start += s.num_new
        logits = None
        if rows:
            idx = torch.tensor(rows, dtype=torch.long, device=self.device)
            logits = all_logits[idx] if graphed else self.model.logits_from_streams(X[idx])
        per_seq, off = [], 0
        for c in counts:
            per_seq.append(logits[off:off + c] if c else None)
            off += c
        return TargetOutput(X, per_seq)

    @torch.no_grad()
    def propose(self, seqs: list[ScheduledSeq], plan, target: TargetOutput, num_accepted: list[int],
                drafting: list[bool], draft_len: int,
                choose: Callable[[int, int, torch.Tensor], int]) -> list[list[int]]:
        """MTP drafts for every seq with ``drafting`` set. ``choose(seq_index, step, logits [V]) -> token``
        turns MTP logits into a draft token (argmax, or a sample whose q the caller keeps).

        The catch-up pass input for the row at position p is the token at p+1 of the request's sequence
        after this step's emission (rows past the accepted ones get 0: their writes are rolled back).
        """
        model, n_pad = self.model, plan.positions.shape[0]
        next_ids, start, pick = [], 0, []
        for b, s in enumerate(seqs):
            req, C = s.request, plan.num_computed[b]
            toks = req.tokens
            for i in range(s.num_new):
                p = C + i
                next_ids.append(toks[p + 1] if p + 1 < len(toks) else 0)
            pick.append(start + num_accepted[b] - 1)  # the row of the newest committed position
            start += s.num_new
        graphed = self._graphed(plan)
        if graphed:
            X_mtp, mtp_logits = self.graphs.mtp(plan, self._ids(next_ids, n_pad))
        else:
            X_mtp = model.mtp_streams(target.streams, self._ids(next_ids, n_pad), self._backend(plan))

        drafts: list[list[int]] = [[] for _ in seqs]
        active = [b for b in range(len(seqs)) if drafting[b]]
        if not active:
            return drafts
        rows = torch.tensor([pick[b] for b in active], dtype=torch.long, device=self.device)
        logits = mtp_logits[rows] if graphed else model.mtp_logits_from_streams(X_mtp[rows])
        for i, b in enumerate(active):
            drafts[b].append(choose(b, 1, logits[i]))

        b_pad = plan.slots.shape[0]
        new_lens = torch.zeros(b_pad, dtype=torch.long)
        for b in range(len(seqs)):
            new_lens[b] = plan.num_computed[b] + num_accepted[b]
        new_lens = new_lens.to(self.device)
        X_prev = torch.zeros(b_pad, *X_mtp.shape[1:], dtype=X_mtp.dtype, device=self.device)
        X_prev[torch.tensor(active, device=self.device)] = X_mtp[rows]
        active_t = torch.tensor(active, dtype=torch.long, device=self.device)
        for j in range(2, draft_len + 1):
            ids = self._ids([drafts[b][-1] if drafting[b] else 0 for b in range(len(seqs))], b_pad)
            if graphed:
                X_prev, all_logits = self.graphs.draft(plan, j, new_lens, ids, X_prev if j == 2 else None)
                logits = all_logits[active_t]
            else:
                tables = plan.draft.step_tables(j, new_lens)
                X_prev = model.mtp_streams(X_prev, ids, self._draft_backend(plan, tables))
                logits = model.mtp_logits_from_streams(X_prev[active_t])
            for i, b in enumerate(active):
                drafts[b].append(choose(b, j, logits[i]))
        return drafts
