"""The benchmark dataset: JSON lines, one request per line, as trtllm-bench reads them.

    {"task_id": 0, "input_ids": [12, 873, ...], "output_tokens": 1024}
    {"task_id": 1, "prompt": "Explain ...", "output_tokens": 256}

``input_ids`` or ``prompt`` (tokenized with the model's tokenizer; ``input_ids`` wins when a line has both);
``output_tokens`` is how many tokens to generate (a throughput run ignores EOS, so lengths are exact).
Every problem names the file and the line.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass
from typing import IO, Iterable

log = logging.getLogger("dsv4.bench")

KNOWN_KEYS = ("task_id", "input_ids", "prompt", "output_tokens")


class DatasetError(ValueError):
    """The dataset cannot be used as given; the message names the line and what to change."""


@dataclass
class DatasetRequest:
    task_id: object  # as the line gives it (an int from prepare-dataset)
    output_tokens: int
    line: int  # 1-based line number in the file
    input_ids: list[int] | None = None
    prompt: str | None = None
    unknown_keys: tuple[str, ...] = ()  # keys of the line dsv4-bench does not use (said once per file)

    @property
    def input_len(self) -> int:
        return len(self.input_ids or [])


def parse_line(text: str, line: int, where: str = "dataset") -> DatasetRequest:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where} line {line}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DatasetError(f"{where} line {line}: JSON nested too deeply to read") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where} line {line}: expected a JSON object, got {type(obj).__name__}")
    ids, prompt = obj.get("input_ids"), obj.get("prompt")
    if ids is None and prompt is None:
        raise DatasetError(f"{where} line {line}: no input; give \"input_ids\" (a list of token ids) or"
                           " \"prompt\" (text)")
    if ids is not None:
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
            raise DatasetError(f"{where} line {line}: \"input_ids\" must be a non-empty list of integers")
        prompt = None
    elif not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{where} line {line}: \"prompt\" must be a non-empty string")
    else:
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate escape ("\ud800"): JSON takes it, no tokenizer does
            raise DatasetError(f"{where} line {line}: \"prompt\" is not valid Unicode text: a lone surrogate"
                               f" ({prompt[e.start]!r}) at character {e.start}") from None
    out = obj.get("output_tokens")
    if out is None:
        raise DatasetError(f"{where} line {line}: no \"output_tokens\" (the number of tokens to generate)")
    if isinstance(out, bool) or not isinstance(out, int) or out < 1:
        raise DatasetError(f"{where} line {line}: \"output_tokens\" must be an integer >= 1, got {out!r}")
    return DatasetRequest(task_id=obj.get("task_id", line - 1), output_tokens=out, line=line,
                          input_ids=ids, prompt=prompt, unknown_keys=tuple(sorted(set(obj) - set(KNOWN_KEYS))))


def read_dataset(path: str) -> list[DatasetRequest]:
    try:
        with open(path, "rb") as f:
            raw = f.read().split(b"\n")
    except OSError as e:
        raise DatasetError(f"cannot read the dataset {path!r}: {e.strerror or e}") from None
    lines = []
    for i, b in enumerate(raw):
        try:
            lines.append(b.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise DatasetError(f"{path} line {i + 1}: not UTF-8 text (byte {b[e.start]:#04x} at column"
                               f" {e.start + 1})") from None
    reqs = [parse_line(text, i + 1, where=path) for i, text in enumerate(lines) if text.strip()]
    if not reqs:
        raise DatasetError(f"the dataset {path!r} has no requests")
    unknown = sorted({k for r in reqs for k in r.unknown_keys})
    if unknown:
        first = next(r.line for r in reqs if r.unknown_keys)
        log.warning("%s: keys %s (first on line %d) are not used by dsv4-bench; it reads %s", path, unknown, first,
                    ", ".join(KNOWN_KEYS))
    return reqs


def tokenize(reqs: Iterable[DatasetRequest], tokenizer, where: str = "dataset") -> None:
    """Fill ``input_ids`` of ``prompt`` lines with ``tokenizer`` (a ``tokenizers.Tokenizer``, or None)."""
    for r in reqs:
        if r.input_ids is not None:
            continue
        if tokenizer is None:
            raise DatasetError(f"{where} line {r.line}: a \"prompt\" needs the model's tokenizer, and this model"
                               " has none (no tokenizer.json; a preset has none either); give \"input_ids\""
                               " instead, or use a checkpoint directory with a tokenizer.json")
        r.input_ids = list(tokenizer.encode(r.prompt).ids)
        if not r.input_ids:
            raise DatasetError(f"{where} line {r.line}: the prompt tokenizes to nothing")


def select(reqs: list[DatasetRequest], num_requests: int, where: str = "dataset") -> list[DatasetRequest]:
    """The first ``num_requests`` requests (0 = all)."""
    if num_requests < 0:
        raise DatasetError(f"--num_requests must be >= 0 (0 = the whole dataset), got {num_requests}")
    if num_requests > len(reqs):
        raise DatasetError(f"--num_requests {num_requests} is larger than the dataset: {where} has {len(reqs)}"
                           " requests; ask for at most that many (or 0 for all), or prepare a larger dataset")
    return reqs[:num_requests] if num_requests else list(reqs)


# ---- synthetic requests (prepare-dataset token-norm-dist) -----------------------------------------------

def _lengths(rng: random.Random, n: int, mean: float, stdev: float) -> list[int]:
    return [max(1, int(round(rng.gauss(mean, stdev) if stdev > 0 else mean))) for _ in range(n)]


def token_norm_dist(num_requests: int, input_mean: float, input_stdev: float, output_mean: float,
                    output_stdev: float, vocab_size: int, seed: int = 0) -> list[dict]:
    """Requests with normally distributed input / output lengths (rounded, at least 1) and uniformly random
    token ids in [0, vocab_size)."""
    if num_requests < 1:
        raise DatasetError(f"--num-requests must be >= 1, got {num_requests}")
    if input_mean < 1 or output_mean < 1:
        raise DatasetError("--input-mean and --output-mean must be >= 1")
    if input_stdev < 0 or output_stdev < 0:
        raise DatasetError("--input-stdev and --output-stdev must be >= 0")
    if vocab_size < 1:
        raise DatasetError(f"the vocabulary size must be >= 1, got {vocab_size}")
    rng = random.Random(seed)
    ins = _lengths(rng, num_requests, input_mean, input_stdev)
    outs = _lengths(rng, num_requests, output_mean, output_stdev)
    return [{"task_id": i, "input_ids": [rng.randrange(vocab_size) for _ in range(n_in)], "output_tokens": n_out}
            for i, (n_in, n_out) in enumerate(zip(ins, outs))]


def write_jsonl(records: Iterable[dict], f: IO[str]) -> int:
    n = 0
    for rec in records:
        f.write(json.dumps(rec, separators=(", ", ": ")) + "\n")
        n += 1
    return n
