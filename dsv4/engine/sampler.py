"""Turning logits into tokens: temperature, top-k, top-p, draws keyed by each request's seed and the token's
position (the same draw whether MTP drafts or not); and the logprobs of the tokens chosen."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Sequence

import torch

from ..transfer import HostCopy, to_device
from .sampling_params import SamplingParams


def probs_from_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> the distribution the request samples from (temperature, then top-k, then top-p)."""
    logits = logits.float() / sp.temperature
    if sp.top_k and sp.top_k < logits.shape[-1]:
        kth = logits.topk(sp.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sp.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token crossing the threshold included)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= sp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


ARGMAX_CHUNKS = 64


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim of [R, V] (the first maximum, as ``argmax``). On a GPU one row's argmax is one
    thread block; in two stages (the best of each of 64 chunks of the row, then the best chunk) the chunks run
    in parallel: a batch-1 argmax over 129k logits took 27 us as one block. ``argmax`` is its twin."""
    R, V = logits.shape
    if not logits.is_cuda or V % ARGMAX_CHUNKS or R == 0:
        return logits.argmax(-1)
    vals, idx = logits.reshape(R, ARGMAX_CHUNKS, V // ARGMAX_CHUNKS).max(-1)  # first maximum of each chunk
    best = vals.argmax(-1)  # the first chunk holding the row's maximum
    return best * (V // ARGMAX_CHUNKS) + idx.gather(1, best[:, None]).squeeze(1)


# ---- draws keyed by position -------------------------------------------------------------------------------
# A sampled request draws the token at sequence position t from its distribution p there as argmax(p / E), E a
# vector of Exp(1) noise that depends only on the request's key and t (the exponential race: the token is
# distributed as p). The draw is then a function of (key, t, p): the same whether MTP drafts or not, whatever
# the drafts, the batch, the drafting pause or the overlap scheduler. MTP verifies a sampled request's drafts
# as a greedy one's, against these draws, and drafts with the same noise (argmax(q / E) at the draft's
# position), so a draft is accepted when the MTP layer's race and the target's pick the same token.
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def request_key(seed: int | None) -> int:
    """A request's 32-bit sampling key: its seed folded to 32 bits, or random bits when it has none."""
    if seed is None:
        return secrets.randbits(32)
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return (s ^ (s >> 32)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two xor-shift-multiply rounds and a final xor-shift) of int64 values in
    [0, 2**32), elementwise; every product stays below 2**59, so int64 never overflows."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def race_noise(keys: torch.Tensor, positions: torch.Tensor, V: int) -> torch.Tensor:
    """[R, V] float32 Exp(1) noise of row r: a function of (keys[r], positions[r]) and the token id only,
    from 24-bit uniforms (u in (0, 1), never 0 or 1)."""
    keys, positions = keys.to(torch.int64), positions.to(device=keys.device, dtype=torch.int64)
    row = _mix32(keys ^ _mix32(positions & _M32))
    h = _mix32((row[:, None] + torch.arange(V, device=keys.device, dtype=torch.int64) * _GOLDEN) & _M32)
    return -torch.log(((h >> 8).to(torch.float32) + 0.5) * 2.0 ** -24)


KEYED_ROWS = 32  # rows of noise made at once: a few [32, V] int64 temporaries (33 MB each at V = 129k)


def sample_keyed(probs: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One draw per row of [R, V] probabilities -> [R] token ids: argmax(p / E), E ``race_noise`` of the row's
    key and position (the position of the token drawn); KEYED_ROWS rows at a time."""
    R, V = probs.shape
    out = torch.empty(R, dtype=torch.long, device=probs.device)
    for i in range(0, R, KEYED_ROWS):
        j = min(R, i + KEYED_ROWS)
        out[i:j] = (probs[i:j].float() / race_noise(keys[i:j], positions[i:j], V)).argmax(-1)
    return out


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], keys: Sequence[int],
                positions: torch.Tensor) -> torch.Tensor:
    """``sample_keyed`` over [R, V] logit rows, row r with its request's sampling parameters ``params[r]``
    (temperature, top-k, top-p), key ``keys[r]`` and the position ``positions[r]`` (on the device) of the
    token it draws."""
    if logits.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long, device=logits.device)
    probs, i = [], 0
    while i < len(params):  # rows of one request (the same parameters) in one call
        j = i + 1
        while j < len(params) and params[j] is params[i]:
            j += 1
        probs.append(probs_from_logits(logits[i:j], params[i]))
        i = j
    return sample_keyed(torch.cat(probs), to_device(list(keys), logits.device), positions)


@dataclass(frozen=True)
class StepLogprobs:
    """The logprobs of a step's chosen tokens, for the seqs that ask: log_softmax of the target's raw logits in
    fp32 at the rows that produced them (the model's own distribution, before temperature / top-k / top-p, as
    vLLM returns by default), computed on the device where the logits are and queued for the host; ``read``
    waits for that copy only.

    ``host`` packs one row per token: its id, its logprob, then the ``width`` best logprobs and their ids
    (``width``: the most any seq of the step asks for; each seq keeps its own n)."""

    host: HostCopy  # [rows, 2 + 2 * width] float64 (token ids are exact in float64)
    spans: tuple[tuple[int, int, int] | None, ...]  # per seq: (first packed row, rows, its top n); None: none
    width: int

    @staticmethod
    def launch(logits: torch.Tensor, tokens: torch.Tensor | Sequence[int], rows_per_seq: Sequence[int],
               top_n: Sequence[int | None]) -> StepLogprobs | None:
        """``logits`` [R, V]: a step's logit rows, seqs in order, ``rows_per_seq[b]`` of them seq b's;
        ``tokens`` [R] (device tensor or host ints): the token chosen at each row; ``top_n[b]``: seq b's
        ``SamplingParams.logprobs`` (None: it does not ask, its rows are skipped). None when no seq asks."""
        if all(n is None for n in top_n):  # (every step calls this: nothing to do unless a request asks)
            return None
        if sum(rows_per_seq) != logits.shape[0] or len(tokens) != logits.shape[0]:
            raise ValueError(f"{logits.shape[0]} logit rows and {len(tokens)} tokens for seqs of"
                             f" {list(rows_per_seq)} rows")
        picked, spans, off = [], [], 0
        for count, n in zip(rows_per_seq, top_n):
            spans.append(None if n is None or count == 0 else (len(picked), count, n))
            if spans[-1] is not None:
                picked.extend(range(off, off + count))
            off += count
        if not picked:
            return None
        width = max(span[2] for span in spans if span is not None)
        idx = to_device(picked, logits.device)
        tok = tokens[idx] if isinstance(tokens, torch.Tensor) else to_device([tokens[i] for i in picked],
                                                                             logits.device)
        lp = torch.log_softmax(logits[idx].float(), dim=-1)
        cols = [tok[:, None].double(), lp.gather(1, tok[:, None]).double()]
        if width:
            top = lp.topk(width, dim=-1)
            cols += [top.values.double(), top.indices.double()]
        return StepLogprobs(HostCopy(torch.cat(cols, 1)), tuple(spans), width)

    def read(self) -> list[list[dict[int, float]] | None]:
        """Per seq: one dict per row (token id -> logprob: the chosen token first, then its top n, best
        first), or None for a seq that did not ask."""
        table, w = self.host.tolist(), self.width
        out = []
        for span in self.spans:
            if span is None:
                out.append(None)
                continue
            first, count, n = span
            dicts = []
            for row in table[first:first + count]:
                d = {int(row[0]): row[1]}
                for j in range(n):
                    d.setdefault(int(row[2 + w + j]), row[2 + j])
                dicts.append(d)
            out.append(dicts)
        return out
