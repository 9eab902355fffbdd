"""Bad input at dsv4-bench's edge: broken checkpoints (on one rank and on two), bad dataset files and flags, bad
YAML sections, a closed pipe and Ctrl-C: one line naming what to change, exit 2 (130 for Ctrl-C), no traceback.
Table-driven like test_bad_inputs.py (issue 18, items 1, 5 and 8)."""

from __future__ import annotations

import pytest

from dsv4.engine.config import EngineConfigError

from .bench_runs import at_bench_step, six_request_dataset

# ---- bad checkpoints through dsv4-bench (issue 18, items 1 and 8) -----------------------------------------
def _tensors(d):
    from safetensors.torch import load_file

    return load_file(str(d / "model.safetensors"))


def _save(d, sd):
    from safetensors.torch import save_file

    save_file(sd, str(d / "model.safetensors"))


def _first_matrix(sd):
    return sorted(k for k in sd if sd[k].dim() == 2)[0]


def _truncate(d):
    p = d / "model.safetensors"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _drop(d):
    sd = _tensors(d)
    del sd[sorted(sd)[3]]
    _save(d, sd)


def _reshape(d):
    sd = _tensors(d)
    k = _first_matrix(sd)
    sd[k] = sd[k][:, :-1].contiguous()
    _save(d, sd)


def _to_int(d):
    import torch

    sd = _tensors(d)
    k = _first_matrix(sd)
    sd[k] = sd[k].to(torch.int32)
    _save(d, sd)


def _pickle_only(d):
    import torch

    sd = _tensors(d)
    (d / "model.safetensors").unlink()
    torch.save(sd, str(d / "pytorch_model.bin"))


def _shard_elsewhere(d):
    import json

    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../elsewhere.safetensors"}}))


def _config(text):
    return lambda d: (d / "config.json").write_text(text)


# (how the checkpoint is broken, the error's words)
BAD_CHECKPOINTS = [
    ("truncated", _truncate, "not a readable safetensors file"),
    ("garbage", lambda d: (d / "model.safetensors").write_bytes(b"\0garbage" * 8), "not a readable safetensors"),
    ("missing tensor", _drop, "missing tensor"),
    ("wrong shape", _reshape, "expected \\["),
    ("integer weights", _to_int, "torch.int32; it must be floating point"),
    ("pickle only", _pickle_only, "holds only pickle weight files"),
    ("shard outside", _shard_elsewhere, "which is not a file of"),
    ("config not json", _config("{not json"), "config.json is not valid JSON"),
    ("config not an object", _config("[1, 2]"), "must hold a JSON object"),
    ("config not utf-8", lambda d: (d / "config.json").write_bytes(b"\xff\xfe{"), "not valid JSON"),
    ("tokenizer not json", lambda d: (d / "tokenizer.json").write_text("{not json"),
     r"tokenizer.json is not a readable tokenizer.json \(.*\); replace it with the model's own"),
]


@pytest.mark.parametrize("name,breaks,words", BAD_CHECKPOINTS, ids=[n for n, *_ in BAD_CHECKPOINTS])
def test_a_bad_checkpoint_is_a_message(good_checkpoint, tmp_path, capsys, name, breaks, words):
    import re
    import shutil

    from dsv4.bench import cli

    base, ds = good_checkpoint
    d = tmp_path / "broken"
    shutil.copytree(base, d)
    breaks(d)
    rc = cli.main(["--model", str(d), "throughput", "--dataset", str(ds)])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(words, err) and "Traceback" not in err, err


def test_a_bad_tokenizer_is_a_message_for_prompt_lines(good_checkpoint, tmp_path, capsys):
    import shutil

    from dsv4.bench import cli

    d = tmp_path / "broken"
    shutil.copytree(good_checkpoint[0], d)
    (d / "tokenizer.json").write_text("{not json")
    ds = tmp_path / "prompts.jsonl"
    ds.write_text('{"prompt": "hello", "output_tokens": 2}\n')
    rc = cli.main(["--model", str(d), "throughput", "--dataset", str(ds)])
    err = capsys.readouterr().err
    assert rc == 2 and "tokenizer.json is not a readable tokenizer.json" in err and "Traceback" not in err, err


# ---- dsv4-bench's files and flags (issue 18, items 5 and 8) ----------------------------------------------
OK_LINE = b'{"task_id": 0, "input_ids": [1, 2, 3], "output_tokens": 2}\n'
# (files to write in the working directory, arguments after --model tiny, the error's words)
BAD_BENCH = [
    ({"ds.jsonl": OK_LINE + b"\xff\xfe\n"}, ["throughput", "--dataset", "ds.jsonl"],
     "ds.jsonl line 2: not UTF-8 text"),
    ({"ds.jsonl": b'{"a":' * 50000 + b"1" + b"}" * 50000 + b"\n"}, ["throughput", "--dataset", "ds.jsonl"],
     "line 1: JSON nested too deeply"),
    ({"ds.jsonl": OK_LINE, "c.yml": b"max_batch_size: 4\n# \xff\n"},
     ["throughput", "--dataset", "ds.jsonl", "--config", "c.yml"], "is not UTF-8 text"),
    ({"ds.jsonl": OK_LINE, "afile": b""}, ["--workspace", "afile", "throughput", "--dataset", "ds.jsonl"],
     "--workspace 'afile' is a file"),
    ({"ds.jsonl": OK_LINE}, ["throughput", "--dataset", "ds.jsonl", "--report_json", "."],
     "--report_json '.' is a directory"),
    ({}, ["prepare-dataset", "--stdout", "token-norm-dist", "--num-requests", "2", "--input-mean", "nan",
          "--output-mean", "4"], "--input_mean nan: give a finite number"),
    ({}, ["prepare-dataset", "--stdout", "token-norm-dist", "--num-requests", "2", "--input-mean", "4",
          "--output-mean", "inf"], "--output_mean inf: give a finite number"),
    ({}, ["prepare-dataset", "--stdout", "token-norm-dist", "--num-requests", "2", "--input-mean", "4",
          "--output-mean", "4", "--vocab-size", "0"], "vocabulary size must be >= 1, got 0"),
    ({"ds.jsonl": OK_LINE, "c.yml": b"max_batch_size: 4\nkv_cache_config:\n  dtype: fp8\nmax_batch_size: 8\n"},
     ["throughput", "--dataset", "ds.jsonl", "--config", "c.yml"],  # PyYAML kept the last one silently
     "the key 'max_batch_size' is given twice (first on line 1; keep one) at line 4"),
    ({"ds.jsonl": b'{"prompt": "a\\ud800", "output_tokens": 2}\n'}, ["throughput", "--dataset", "ds.jsonl"],
     "ds.jsonl line 1: \"prompt\" is not valid Unicode text: a lone surrogate ('\\ud800') at character 1"),
    ({"ds.jsonl": OK_LINE, "c.yml": b"seed: 100000000000000000000000\n"},
     ["throughput", "--dataset", "ds.jsonl", "--config", "c.yml"], "seed must be an integer in [-2**63, 2**64 - 1]"),
]


@pytest.mark.parametrize("files,argv,words", BAD_BENCH, ids=[w for *_, w in BAD_BENCH])
def test_bench_refuses_with_a_message(tmp_path, monkeypatch, capsys, files, argv, words):
    from dsv4.bench import cli

    monkeypatch.chdir(tmp_path)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    rc = cli.main(["--model", "tiny", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and words in err and "Traceback" not in err, err


def test_a_full_disk_under_the_iteration_log_is_a_message(tmp_path, capsys):
    import os

    from dsv4.bench import cli

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this machine")
    ds = tmp_path / "ds.jsonl"
    ds.write_bytes(OK_LINE)
    rc = cli.main(["--model", "tiny", "throughput", "--dataset", str(ds), "--iteration_log", "/dev/full",
                   "--no_progress"])
    out, err = capsys.readouterr()
    assert rc == 2 and "cannot write --iteration_log '/dev/full': No space left" in err
    assert "Traceback" not in err and "Total output throughput" in out  # the run's report still stands


def test_a_directory_named_like_a_preset_does_not_replace_it(tmp_path, monkeypatch):
    from dsv4.config import get_preset
    from dsv4.model.loader import model_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text("{}")
    assert model_config("tiny") == get_preset("tiny")
    with pytest.raises(Exception, match="config.json has no"):
        model_config("./tiny")  # spelled as a path, it is the directory


# (settings, the error's words): settings inside the YAML sections
BAD_SECTIONS = [
    ({"kv_cache_config": {"max_tokens": -5}}, "kv_cache_config.max_tokens must be >= 1"),
    ({"kv_cache_config": {"max_gpu_memory_bytes": 0}}, "kv_cache_config.max_gpu_memory_bytes must be >= 1"),
    ({"cuda_graph_config": {"batch_sizes": [0, 2]}}, "cuda_graph_config.batch_sizes must be a non-empty list"),
    ({"cuda_graph_config": {"batch_sizes": []}}, "cuda_graph_config.batch_sizes must be a non-empty list"),
    ({"cuda_graph_config": {"max_batch_size": -1}}, "cuda_graph_config.max_batch_size must be >= 0"),
    ({"cuda_graph_config": {"prefill_token_sizes": [64, 0]}}, "cuda_graph_config.prefill_token_sizes must be a list"),
    ({"cuda_graph_config": {"prefill_token_sizes": [True]}}, r"prefill_token_sizes\[0\]: expected an integer"),
]


@pytest.mark.parametrize("settings,words", BAD_SECTIONS, ids=[w for _, w in BAD_SECTIONS])
def test_bad_sections_are_refused(settings, words):
    from dsv4.engine.config import EngineConfig, from_dict

    with pytest.raises(EngineConfigError, match=words):
        from_dict(EngineConfig, settings)


def test_a_closed_pipe_stops_prepare_dataset_quietly():
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "dsv4.bench.cli", "--model", "tiny", "prepare-dataset", "--stdout",
                          "token-norm-dist", "--num-requests", "50000", "--input-mean", "50", "--output-mean", "4"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().startswith(b'{"task_id": 0')
    p.stdout.close()  # as `| head -1` does
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == "", err


def test_ctrl_c_during_the_run_prints_a_partial_report(tmp_path, monkeypatch, capsys):
    from dsv4.bench import cli

    ds = six_request_dataset(tmp_path)

    def interrupt(engine):
        raise KeyboardInterrupt

    at_bench_step(monkeypatch, 4, interrupt)
    rc = cli.main(["--model", "tiny", "throughput", "--dataset", str(ds), "--concurrency", "2", "--warmup", "0",
                   "--no_progress"])
    out, err = capsys.readouterr()
    finished = int(err.split("covers the ")[1].split()[0])
    assert rc == 130 and 0 < finished < 6 and "Traceback" not in err
    assert "(completed / failed):" in out and f"{finished} / {6 - finished}" in out
    assert "interrupted (SIGINT) before it finished" in out


# the checkpoint's tensors as two ranks read them (each its own shard of the weights)
TP2_CASES = ["truncated", "missing tensor", "wrong shape", "integer weights"]


@pytest.mark.parametrize("name", TP2_CASES)
def test_a_bad_checkpoint_is_a_message_at_tp2(good_checkpoint, tmp_path, capfd, name):
    import re
    import shutil

    from dsv4.bench import cli

    _, breaks, words = next(c for c in BAD_CHECKPOINTS if c[0] == name)
    base, ds = good_checkpoint
    d = tmp_path / "broken"
    shutil.copytree(base, d)
    breaks(d)
    rc = cli.main(["--model", str(d), "throughput", "--dataset", str(ds), "--tp", "2", "--threads", "1"])
    err = capfd.readouterr().err  # capfd: the worker ranks' stderr too
    assert rc == 2 and re.search(words, err) and "Traceback" not in err, err
