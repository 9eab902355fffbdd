"""Checkpoints shipped inside the package, loadable by name wherever a model is named (``LLM("mini")``,
``dsv4 generate --model mini``, ``dsv4-bench --model mini``).

``mini``: a 7M-parameter DeepSeek-V4 trained on Python's standard library by ``tools/train_mini.py`` (every
layer kind, mHC, hash and scored MoE, a trained MTP layer); its model card is ``mini/README.md`` and its held-out
prompts ``mini/heldout_prompts.jsonl``. A built-in name always means the shipped checkpoint: a directory of the
same name is named with a path (``./mini``).
"""

from __future__ import annotations

import os

BUILTIN_MODELS = ("mini",)


def builtin_path(name: str) -> str | None:
    """The directory of a built-in checkpoint, or None when ``name`` is not one."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), name) if name in BUILTIN_MODELS else None


def resolve_model(name: str) -> str:
    """A built-in name -> its directory inside the package; any other name or path unchanged."""
    return builtin_path(name) or name


def heldout_prompts(name: str = "mini") -> list[str]:
    """The prompt texts of a built-in model's held-out prompt set."""
    import json

    with open(os.path.join(builtin_path(name), "heldout_prompts.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]
