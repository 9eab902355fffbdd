"""dsv4-bench: the seed's trtllm-bench command line runs here unchanged but for the program and the model.

The seed run (its command line and its mtp.yml byte for byte, with a tiny checkpoint for $M, --tp 1 --ep 1 and
a small dataset made by prepare-dataset) completes every request with exactly its output_tokens and reports
MTP statistics; the bisect matrix's attention-DP cells are refused with a message until multi-device
support exists; bad input gets a message and a non-zero exit, or an error for the one bad request.
"""

from __future__ import annotations

import glob
import json
import re
import os
import shlex
import subprocess
import sys

import pytest

from dsv4.bench import cli
from dsv4.bench.dataset import DatasetError, token_norm_dist
from dsv4.bench.options import resolve
from dsv4.builtin import resolve_model
from dsv4.config import load_config
from dsv4.engine.config import EngineConfigError

# The reproduction from the seed's bug report, as it was filed.
SEED_COMMAND = """trtllm-bench --model $M --model_path $M throughput \\
  --tp 4 --ep 4 --dataset /tmp/dsv4_1k1k.txt \\
  --max_batch_size 64 --max_num_tokens 8192 \\
  --concurrency 32 --num_requests 128 \\
  --kv_cache_free_gpu_mem_fraction 0.8 --config /tmp/mtp.yml"""

SEED_MTP_YML = b"""kv_cache_config:
  tokens_per_block: 128
  dtype: fp8
  free_gpu_memory_fraction: 0.9
cuda_graph_config:
  enable_padding: true
moe_config:
  backend: TRTLLM
speculative_config:
  decoding_type: MTP
  num_nextn_predict_layers: 1
"""
NO_MTP_YML = SEED_MTP_YML.split(b"speculative_config:")[0]
ATTENTION_DP = b"enable_attention_dp: true\n"

NUM_REQUESTS = 128


def _seed_dir():
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.path.join(here, "..", "..", "shared", "seed"), os.path.join(here, "..", "shared", "seed")):
        if os.path.isdir(d):
            return d
    return None


def seed_argv(model: str, dataset: str, config: str) -> list[str]:
    """The seed's command line with only dsv4-bench for trtllm-bench, $M, --tp 1 --ep 1, and the files' paths."""
    cmd = SEED_COMMAND
    for old, new in (("--tp 4 --ep 4", "--tp 1 --ep 1"), ("/tmp/dsv4_1k1k.txt", dataset),
                     ("/tmp/mtp.yml", config)):
        assert cmd.count(old) == 1, old
        cmd = cmd.replace(old, new)
    argv = shlex.split(cmd.replace("\\\n", " "))
    assert argv[0] == "trtllm-bench"
    return [model if a == "$M" else a for a in argv[1:]]




def run_main(argv, capsys) -> tuple[int, str, str]:
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    from dsv4.checkpoint.init_random import init_random_checkpoint
    from dsv4.checkpoint.tokenizer import write_byte_tokenizer

    d = tmp_path_factory.mktemp("bench")
    ckpt = d / "tiny"
    init_random_checkpoint("tiny", str(ckpt), seed=0)
    write_byte_tokenizer(str(ckpt), 256)
    ds = d / "dsv4_tiny.jsonl"
    assert cli.main(["--model", str(ckpt), "prepare-dataset", "--output", str(ds), "token-norm-dist",
                     "--num-requests", str(NUM_REQUESTS), "--input-mean", "24", "--output-mean", "12",
                     "--input-stdev", "4", "--output-stdev", "2"]) == 0
    files = {}
    for name, text in (("mtp.yml", SEED_MTP_YML), ("nomtp.yml", NO_MTP_YML),
                       ("mtp_dp.yml", SEED_MTP_YML + ATTENTION_DP), ("nomtp_dp.yml", NO_MTP_YML + ATTENTION_DP)):
        (d / name).write_bytes(text)
        files[name] = str(d / name)
    asked = [json.loads(line)["output_tokens"] for line in ds.read_text().splitlines()]
    return {"dir": d, "ckpt": str(ckpt), "dataset": str(ds), "asked": asked, **files}


def test_seed_text_is_the_seed_report():
    """The command and the YAML above are the seed report's, byte for byte (when the report is at hand)."""
    d = _seed_dir()
    if d is None:
        pytest.skip("shared/seed not found beside the repository")
    text = "".join(open(f, encoding="utf-8").read() for f in sorted(glob.glob(os.path.join(d, "*.txt"))))
    assert "cat > /tmp/mtp.yml <<'EOF'\n" + SEED_MTP_YML.decode() + "EOF\n" in text
    assert SEED_COMMAND in text


def check_report(rep: dict, env: dict, mtp: bool, tp: int = 1, attention_dp: bool = False):
    q = rep["requests"]
    assert (q["num_requests"], q["num_completed"], q["num_failed"]) == (NUM_REQUESTS, NUM_REQUESTS, 0)
    assert q["concurrency"] == 32 and q["num_warmup"] == 2
    assert [r["output_tokens"] for r in rep["per_request"]] == env["asked"][:NUM_REQUESTS]
    for r in rep["per_request"]:
        assert r["output_len"] == r["output_tokens"] and r["finish_reason"] == "length" and r["error"] is None
    assert q["total_output_tokens"] == sum(env["asked"][:NUM_REQUESTS])
    e = rep["engine"]
    assert (e["max_batch_size"], e["max_num_tokens"]) == (64, 8192)
    par = e["parallel"]
    assert (par["tp"], par["pp"], par["ep"], par["world_size"]) == (tp, 1, tp, tp)
    assert par["enable_attention_dp"] == attention_dp
    assert e["overlap_scheduler"] == "on"  # (MTP steps under attention DP too)
    kv = e["kv_cache"]
    assert (kv["dtype"], kv["tokens_per_block"], kv["free_gpu_memory_fraction"]) == ("fp8", 128, 0.9)
    assert kv["num_slots"] >= 1 and kv["num_blocks"] >= 1 and "KV cache:" in kv["summary"]
    res = e["resolved"]  # what the engine was built from, the same numbers the sections above report
    assert (res["kv_dtype"], res["num_slots"], res["num_blocks"]) == ("fp8", kv["num_slots"], kv["num_blocks"])
    assert (res["dtype"], res["draft_len"], res["max_seq_len"]) == (e["dtype"], 1 if mtp else 0, e["max_seq_len"])
    p = rep["performance"]
    assert p["request_throughput_req_s"] > 0 and p["output_throughput_tok_s"] > 0
    assert p["total_token_throughput_tok_s"] > p["output_throughput_tok_s"]
    for k in ("request_latency_ms", "ttft_ms", "tpot_ms"):
        d = p[k]
        assert d["min"] <= d["p50"] <= d["p90"] <= d["p95"] <= d["p99"] <= d["max"]
    notes = " ".join(rep["notes"])
    assert "moe_config.backend=TRTLLM" in notes and "cuda_graph_config" in notes
    assert "0.9" in notes and "--kv_cache_free_gpu_mem_fraction 0.8" in notes  # the YAML's value won, said
    if mtp:
        s = rep["speculative"]
        assert e["speculative"] == {"decoding_type": "MTP", "draft_len": 1}
        assert s["num_verify_steps"] > 0 and s["num_draft_tokens"] == s["num_verify_steps"]
        # the report's rates are the counts' (k = 1: one draft per verify, mean length = 1 + acceptance)
        assert s["acceptance_rate"] == pytest.approx(s["num_accepted_tokens"] / s["num_draft_tokens"])
        assert s["mean_accepted_len"] == pytest.approx(1 + s["num_accepted_tokens"] / s["num_verify_steps"])
        assert s["per_position_acceptance"] == [pytest.approx(s["acceptance_rate"])]
    else:
        assert rep["speculative"] is None and e["speculative"] is None


@pytest.mark.parametrize("mtp", [True, False], ids=["mtp_on", "mtp_off"])
@pytest.mark.parametrize("attention_dp", [True, False], ids=["adp_on", "adp_off"])
def test_seed_bisect_matrix(env, capsys, mtp, attention_dp):
    """The seed's 2x2 matrix at --tp 1 --ep 1. MTP on / attention DP off is the seed's reproduction, verbatim.
    Attention DP needs several ranks with the experts split over all of them, so on one rank it is refused
    with a message (no traceback); test_seed_attention_dp_on_two_ranks runs it on two."""
    config = env[("mtp" if mtp else "nomtp") + ("_dp" if attention_dp else "") + ".yml"]
    report = env["dir"] / f"report_{mtp}_{attention_dp}.json"
    itlog = env["dir"] / f"iter_{mtp}_{attention_dp}.jsonl"
    argv = seed_argv(env["ckpt"], env["dataset"], config) + ["--report_json", str(report)]
    if mtp:
        argv += ["--iteration_log", str(itlog)]
    if not mtp and not attention_dp:  # once through the console script, as a person runs it
        exe = os.path.join(os.path.dirname(sys.executable), "dsv4-bench")
        assert os.path.exists(exe), "the dsv4-bench console script is not installed (pip install -e .)"
        p = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
        rc, out, err = p.returncode, p.stdout, p.stderr
    else:
        rc, out, err = run_main(argv, capsys)
    assert "Traceback" not in err
    if attention_dp:
        assert rc == 2, err
        assert "enable_attention_dp" in err and "several ranks" in err
        assert not report.exists()
        return
    assert rc == 0, err
    rep = json.loads(report.read_text())
    check_report(rep, env, mtp)
    assert "PERFORMANCE OVERVIEW" in out and "Request throughput (req/sec)" in out and "TPOT (ms)" in out
    assert ("SPECULATIVE DECODING (MTP)" in out and "Draft acceptance rate" in out) == mtp
    assert "note: moe_config.backend=TRTLLM" in err  # the mapping notes are said visibly
    if mtp:
        steps = [json.loads(line) for line in itlog.read_text().splitlines()]
        # (with the overlap scheduler a call may only read back the last launched step: no seqs)
        assert len([s for s in steps if s["num_seqs"]]) == rep["requests"]["num_engine_steps"] > 0
        assert all(s["step_time_ms"] > 0 and (s["num_seqs"] >= 1 or s["num_emitted"] > 0) for s in steps)
        assert sum(s["num_emitted"] for s in steps) >= rep["requests"]["total_output_tokens"]
        # every request's prompt is a context row of some step (counted before the step, not after)
        assert sum(s["num_context"] for s in steps) >= rep["requests"]["num_completed"]


def test_seed_attention_dp_on_two_ranks(env, capsys):
    """The seed's crashing cell (MTP on, attention DP on) on two CPU ranks: the seed's command line with
    --tp 2 --ep 2 (attention replicated per rank, experts split) and its mtp.yml plus enable_attention_dp."""
    report = env["dir"] / "report_adp2.json"
    argv = seed_argv(env["ckpt"], env["dataset"], env["mtp_dp.yml"])
    argv[argv.index("--tp") + 1] = argv[argv.index("--ep") + 1] = "2"
    rc, out, err = run_main(argv + ["--report_json", report], capsys)
    assert rc == 0, err
    rep = json.loads(report.read_text())
    check_report(rep, env, mtp=True, tp=2, attention_dp=True)
    assert rep["engine"]["parallel"]["mapping"]["attention_dp_size"] == 2
    assert re.search(r"Parallel \(TP / PP / EP / attention DP / ranks\): +2 / 1 / 2 / on / 2\n", out)


def test_seed_command_as_filed_is_refused_clearly(env, capsys):
    """--tp 4 on the tiny model (4 heads in 2 output groups): a message naming the setting, exit 2."""
    argv = shlex.split(SEED_COMMAND.replace("\\\n", " ").replace("/tmp/dsv4_1k1k.txt", env["dataset"])
                       .replace("/tmp/mtp.yml", env["mtp.yml"]))[1:]
    rc, out, err = run_main([env["ckpt"] if a == "$M" else a for a in argv], capsys)
    assert rc == 2 and "tensor_parallel_size=4" in err and "o_groups=2" in err and "Traceback" not in err


def test_one_bad_request_among_good(env, capsys, tmp_path):
    """A request longer than max_seq_len gets its own error; the others (a prompt line among them, tokenized
    with the checkpoint's tokenizer) complete with exactly their output_tokens; exit 1."""
    ds = tmp_path / "mixed.jsonl"
    lines = [{"task_id": 0, "input_ids": list(range(1, 11)), "output_tokens": 5},
             {"task_id": 1, "prompt": "Hello world", "output_tokens": 4},
             {"task_id": 2, "input_ids": list(range(30)), "output_tokens": 20},
             {"task_id": 3, "input_ids": [7] * 8, "output_tokens": 6}]
    ds.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = tmp_path / "r.json"
    rc, out, err = run_main(["--model", "tiny-ckpt", "--model_path", env["ckpt"], "throughput", "--dataset", ds,
                             "--max_seq_len", "40", "--max_batch_size", "4", "--warmup", "1", "--streaming",
                             "--config", env["mtp.yml"], "--report_json", report], capsys)
    assert rc == 1, err
    assert "1 of 4 requests failed" in err and "Traceback" not in err
    rep = json.loads(report.read_text())
    assert rep["requests"]["num_completed"] == 3 and rep["requests"]["streaming"] is True
    [bad] = rep["errors"]
    assert bad["task_id"] == 2 and bad["line"] == 3 and "max_seq_len (40)" in bad["error"]
    good = {r["task_id"]: r for r in rep["per_request"] if r["error"] is None}
    assert sorted(good) == [0, 1, 3]
    assert all(r["output_len"] == r["output_tokens"] for r in good.values())
    assert good[1]["input_len"] == len(b"Hello world")  # the byte-level tokenizer: one token per byte
    assert "FAILED REQUESTS (1)" in out and "task_id 2 (line 3)" in out


def test_disable_overlap_scheduler_from_the_yaml(env, capsys, tmp_path):
    """TensorRT-LLM's key turns the overlap scheduler off; the run is otherwise the same and says so."""
    cfg = tmp_path / "noov.yml"
    cfg.write_bytes(NO_MTP_YML + b"disable_overlap_scheduler: true\n")
    report = tmp_path / "r.json"
    rc, out, err = run_main(seed_argv(env["ckpt"], env["dataset"], str(cfg)) + ["--report_json", report], capsys)
    assert rc == 0, err
    rep = json.loads(report.read_text())
    assert rep["engine"]["overlap_scheduler"] == "off (disable_overlap_scheduler)"
    assert [r["output_len"] for r in rep["per_request"]] == env["asked"][:NUM_REQUESTS]
    assert re.search(r"Overlap scheduler: +off \(disable_overlap_scheduler\)\n", out)


BAD_YAML = {
    "malformed": (b"kv_cache_config:\n  tokens_per_block: [128,\n", ["not valid YAML", "line"]),
    "unknown_key": (b"max_batch_sise: 8\n", ["'max_batch_sise'", "valid keys", "max_batch_size",
                                            "kv_cache_config", "speculative_config"]),
    "unknown_nested_key": (b"kv_cache_config:\n  enable_block_reuse: true\n",
                           ["kv_cache_config.enable_block_reuse", "valid keys", "tokens_per_block"]),
    "wrong_type": (b"max_batch_size: lots\n", ["max_batch_size", "integer", "lots"]),
    "not_a_mapping": (b"- kv_cache_config\n", ["mapping"]),
    "bad_kv_dtype": (b"kv_cache_config:\n  dtype: int4\n", ["kv_cache_config.dtype", "int4"]),
    "bad_decoding_type": (b"speculative_config:\n  decoding_type: Eagle3\n", ["decoding_type", "MTP"]),
    "bad_overlap_flag": (b"disable_overlap_scheduler: maybe\n", ["disable_overlap_scheduler", "true/false"]),
}


@pytest.mark.parametrize("case", sorted(BAD_YAML))
def test_bad_config_is_a_message(env, capsys, tmp_path, case):
    text, expected = BAD_YAML[case]
    cfg = tmp_path / "bad.yml"
    cfg.write_bytes(text)
    rc, out, err = run_main(["--model", "tiny", "throughput", "--dataset", env["dataset"], "--config", cfg],
                            capsys)
    assert rc == 2 and "Traceback" not in err
    for s in expected:
        assert s in err, (s, err)


BAD_DATASET = {
    "no_input": ('{"task_id": 0, "input_ids": [1, 2], "output_tokens": 3}\n{"task_id": 1, "output_tokens": 4}\n',
                 ["line 2", "no input", "input_ids", "prompt"]),
    "not_json": ('{"task_id": 0, "input_ids": [1, 2]\n', ["line 1", "not valid JSON"]),
    "no_output_tokens": ('{"task_id": 0, "input_ids": [1, 2]}\n', ["line 1", "output_tokens"]),
    "bad_ids": ('{"task_id": 0, "input_ids": "1 2", "output_tokens": 3}\n', ["line 1", "input_ids"]),
    "prompt_without_tokenizer": ('{"task_id": 0, "prompt": "hi", "output_tokens": 3}\n',
                                 ["line 1", "tokenizer"]),
    "empty": ("\n", ["no requests"]),
}


@pytest.mark.parametrize("case", sorted(BAD_DATASET))
def test_bad_dataset_is_a_message(capsys, tmp_path, case):
    text, expected = BAD_DATASET[case]
    ds = tmp_path / "ds.jsonl"
    ds.write_text(text)
    rc, out, err = run_main(["--model", "tiny", "throughput", "--dataset", ds], capsys)
    assert rc == 2 and "Traceback" not in err
    for s in expected:
        assert s in err, (s, err)


@pytest.mark.parametrize("extra,expected", [
    (["--num_requests", "200"], ["--num_requests 200", f"has {NUM_REQUESTS} requests"]),
    (["--beam_width", "4"], ["--beam_width 4", "beam"]),
    (["--backend", "tensorrt"], ["--backend tensorrt", "pytorch"]),
    (["--concurrency", "0"], ["--concurrency 0"]),
    (["--max_batch_size", "0"], ["max_batch_size must be in [1, 65536], got 0"]),
    (["--kv_cache_free_gpu_mem_fraction", "1.5"], ["free_gpu_memory_fraction"]),
    (["--pp", "2"], ["pipeline_parallel_size=2", "not implemented"]),
    (["--tp", "3"], ["tensor_parallel_size=3"]),
    (["--dtype", "int3"], ["int3"]),
])
def test_bad_options_are_messages(env, capsys, extra, expected):
    rc, out, err = run_main(["--model", "tiny", "throughput", "--dataset", env["dataset"], *extra], capsys)
    assert rc == 2 and "Traceback" not in err
    for s in expected:
        assert s in err, (s, err)


def test_missing_files_and_models(env, capsys, tmp_path):
    rc, _, err = run_main(["--model", "tiny", "throughput", "--dataset", tmp_path / "nope.jsonl"], capsys)
    assert rc == 2 and "cannot read the dataset" in err
    rc, _, err = run_main(["--model", "tiny", "throughput", "--dataset", env["dataset"], "--config",
                           tmp_path / "nope.yml"], capsys)
    assert rc == 2 and "cannot read --config" in err
    rc, _, err = run_main(["--model", "deepseek-ai/DeepSeek-V4-Flash", "throughput", "--dataset", env["dataset"]],
                          capsys)
    assert rc == 2 and "neither a checkpoint directory nor a preset" in err and "--model_path" in err


def test_prepare_dataset_forms(capsys, tmp_path, env):
    """trtllm-bench's spelling (options before the kind) and the old prepare_dataset.py's --stdout; the vocabulary
    comes from the model (a preset or a checkpoint) unless given; the same seed gives the same requests."""
    args = ["token-norm-dist", "--num-requests", "50", "--input-mean", "20", "--output-mean", "10",
            "--input-stdev", "3", "--output-stdev", "0"]
    rc, out, _ = run_main(["--model", "tiny", "prepare-dataset", "--stdout", *args], capsys)
    assert rc == 0
    recs = [json.loads(line) for line in out.splitlines()]
    assert [r["task_id"] for r in recs] == list(range(50))
    assert all(r["output_tokens"] == 10 and r["input_ids"] and max(r["input_ids"]) < 256 for r in recs)
    assert 17 <= sum(len(r["input_ids"]) for r in recs) / 50 <= 23
    rc, out2, _ = run_main(["-m", "tiny", "prepare-dataset", *args, "--stdout"], capsys)  # --stdout after the kind
    assert rc == 0 and out2 == out
    f = tmp_path / "d.jsonl"
    rc, _, _ = run_main(["--model_path", env["ckpt"], "prepare-dataset", "--random-seed", "0", *args,
                         "--output", f], capsys)
    assert rc == 0 and f.read_text() == out
    rc, out_mini, _ = run_main(["--model", "mini", "prepare-dataset", "--stdout", *args], capsys)  # built-in
    assert rc == 0 and max(max(json.loads(x)["input_ids"]) for x in out_mini.splitlines()) >= 256
    assert all(max(json.loads(x)["input_ids"]) < load_config(resolve_model("mini")).vocab_size
               for x in out_mini.splitlines())
    rc, out3, _ = run_main(["prepare-dataset", "--seed", "1", "--vocab-size", "16", *args], capsys)
    assert rc == 0 and out3 != out and all(max(json.loads(x)["input_ids"]) < 16 for x in out3.splitlines())
    rc, _, err = run_main(["prepare-dataset", *args], capsys)
    assert rc == 2 and "--model" in err
    rc, _, err = run_main(["-m", "tiny", "prepare-dataset", *args[:2], "0", *args[3:]], capsys)
    assert rc == 2 and "--num-requests must be >= 1" in err
    with pytest.raises(DatasetError):
        token_norm_dist(0, 1, 0, 1, 0, 10)


def test_options_flags_then_yaml():
    """Flags make the settings, the YAML overrides them key by key, the schema validates, and each override of a
    given flag is said."""
    flags = {"max_batch_size": 8, "tp": 1, "kv_cache_free_gpu_mem_fraction": 0.5, "device": "cpu", "dtype": None}
    s = resolve(flags, {"max_batch_size": 4, "kv_cache_config": {"dtype": "fp8"}, "dtype": "bf16"}, "x.yml",
                {"max_seq_len": 99})
    assert s.config.max_batch_size == 4 and s.config.max_seq_len == 99
    assert s.config.kv_cache_config.free_gpu_memory_fraction == 0.5 and s.config.kv_cache_config.dtype == "fp8"
    assert (s.device, s.dtype) == ("cpu", "bf16") and "dtype" not in s.llm_kwargs
    assert s.sources["kv_cache_config.free_gpu_memory_fraction"] == "--kv_cache_free_gpu_mem_fraction"
    assert s.sources["max_seq_len"].startswith("dataset")
    [o] = s.overrides
    assert "max_batch_size" in o and "--max_batch_size 8" in o
    with pytest.raises(EngineConfigError, match="unknown key 'speculative_config.foo'"):
        resolve({}, {"speculative_config": {"foo": 1}})
