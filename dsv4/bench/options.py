"""One dict of LLM settings from the command line and the ``--config`` YAML, with trtllm-bench's rule: the
flags make the settings, then the YAML's keys override them (nested sections key by key). The result is
validated by the engine's typed schema (``dsv4.engine.config.from_dict(EngineConfig, ...)``), which refuses an
unknown key naming the valid ones and a value of the wrong type; nothing here parses settings by hand.

Where each value came from is kept, so the report can say which of two given values won.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import yaml

from ..engine.config import EngineConfig, EngineConfigError, from_dict


class BenchOptionsError(ValueError):
    """The options cannot be used as given; the message says which and what to change."""


# command-line flag -> LLM-API key path (the YAML's names)
FLAG_TO_KEY = {
    "max_batch_size": ("max_batch_size",),
    "max_num_tokens": ("max_num_tokens",),
    "max_seq_len": ("max_seq_len",),
    "tp": ("tensor_parallel_size",),
    "pp": ("pipeline_parallel_size",),
    "ep": ("moe_expert_parallel_size",),
    "kv_cache_free_gpu_mem_fraction": ("kv_cache_config", "free_gpu_memory_fraction"),
    "device": ("device",),
    "dtype": ("dtype",),
}


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}  # key -> the line it was first given on
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in seen:
                        raise yaml.constructor.ConstructorError(
                            None, None, f"the key {key!r} is given twice (first on line {seen[key]}; keep one)",
                            key_node.start_mark)
                    seen[key] = key_node.start_mark.line + 1
                except TypeError:  # an unhashable key: construct_mapping names it
                    pass
        return super().construct_mapping(node, deep=deep)


def load_yaml(path: str) -> dict:
    """The ``--config`` file as a dict (an empty file is an empty dict)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise BenchOptionsError(f"cannot read --config {path!r}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise BenchOptionsError(f"--config {path!r} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset"
                                f" {e.start})") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # (safe_load's loader, plus unique keys)
    except yaml.YAMLError as e:
        where = ""
        mark = getattr(e, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise BenchOptionsError(f"--config {path!r} is not valid YAML: {problem}{where}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise BenchOptionsError(f"--config {path!r}: expected a mapping of LLM-API settings at the top level"
                                f" (e.g. 'kv_cache_config:'), got a {type(data).__name__}")
    return data


@dataclass
class Settings:
    """The merged settings: ``config`` goes to ``LLM(model, config=...)``; ``llm_kwargs`` are the same settings
    as ``LLM``'s keywords (but device and dtype)."""

    merged: dict  # every setting, the LLM-API names (device and dtype included)
    config: EngineConfig  # the validated form
    sources: dict[str, str] = field(default_factory=dict)  # "a.b" -> where the value came from
    overrides: list[str] = field(default_factory=list)  # sentences: which given value lost to which

    @property
    def device(self) -> str:
        return self.merged.get("device", "cpu")

    @property
    def dtype(self) -> str:
        return self.merged.get("dtype", "auto")

    @property
    def llm_kwargs(self) -> dict:
        return {k: v for k, v in self.merged.items() if k not in ("device", "dtype")}


def _set(d: dict, path: tuple[str, ...], value):
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def _flatten(d: dict, prefix: tuple = ()) -> dict[tuple, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def resolve(flags: dict, yaml_settings: dict | None, config_path: str | None = None,
            derived: dict | None = None) -> Settings:
    """``flags``: the command-line values by flag name (None = not given); ``derived``: defaults the benchmark
    computes (e.g. ``max_seq_len`` from the dataset), by LLM-API key, used where no flag gave one.
    The YAML then overrides both. Raises ``EngineConfigError`` for what the schema refuses."""
    cli: dict = {}
    sources: dict[str, str] = {}
    flag_of: dict[tuple, str] = {}
    for key, value in (derived or {}).items():
        if value is not None:
            cli[key] = value
            sources[key] = "dataset (max input + output tokens)" if key == "max_seq_len" else "derived"
    for flag, path in FLAG_TO_KEY.items():
        value = flags.get(flag)
        if value is None:
            continue
        _set(cli, path, value)
        sources[".".join(path)] = f"--{flag}"
        flag_of[path] = flag
    yaml_settings = yaml_settings or {}
    cfg_name = f"--config {config_path}" if config_path else "--config"
    overrides = []
    for path, value in _flatten(yaml_settings).items():
        key = ".".join(str(p) for p in path)
        if path in flag_of:
            given = _get(cli, path)
            if given != value:
                overrides.append(f"{key}: {cfg_name} says {value!r}, which overrides --{flag_of[path]} {given!r}"
                                 " (the YAML wins, as in trtllm-bench)")
        elif key in sources and _get(cli, path) != value:
            overrides.append(f"{key}: {cfg_name} says {value!r}, which overrides the {sources[key]} value"
                             f" {_get(cli, path)!r}")
        sources[key] = cfg_name
    merged = _deep_merge(cli, yaml_settings)
    try:
        config = from_dict(EngineConfig, merged)
    except EngineConfigError as e:
        where = f"the command line and {cfg_name}" if config_path else "the command line"
        raise EngineConfigError(f"invalid settings (from {where}): {e}") from None
    return Settings(merged=merged, config=config, sources=sources, overrides=overrides)


def _get(d: dict, path: tuple):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d
