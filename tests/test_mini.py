"""The built-in trained model ``mini``: loadable by name everywhere a model is named, what it ships, and MTP
acceptance on its held-out prompts. (Draft fidelity, accepted counts and MTP on == off on mini are in
tests/test_mtp_fidelity.py.)"""

from __future__ import annotations

import json
import os

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.builtin import builtin_path, heldout_prompts, resolve_model
from dsv4.checkpoint.tokenizer import load_tokenizer
from dsv4.config import CSA, HCA, SWA
from dsv4.model.loader import load_model, model_config


MINI = builtin_path("mini")
SPECIAL = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜User｜>", "<｜Assistant｜>", "<think>",
           "</think>"]


def test_the_name_means_the_shipped_checkpoint_even_beside_a_directory_of_that_name(tmp_path, monkeypatch):
    (tmp_path / "mini").mkdir()  # a stray directory of the same name does not replace the built-in
    monkeypatch.chdir(tmp_path)
    assert resolve_model("mini") == MINI and os.path.isfile(os.path.join(MINI, "config.json"))
    assert resolve_model("./mini") == "./mini" and resolve_model("tiny") == "tiny"
    assert model_config("mini") == model_config(MINI)


def test_what_ships():
    files = set(os.listdir(MINI))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "heldout_prompts.jsonl"} <= files
    assert sum(os.path.getsize(os.path.join(MINI, f)) for f in files) <= 16 * 10 ** 6
    cfg = model_config("mini")
    assert set(cfg.layer_kinds) == {SWA, CSA, HCA} and 128 in cfg.ratios and cfg.has_mtp
    assert 0 < cfg.num_hash_layers < cfg.num_layers  # hash-routed and scored MoE
    assert cfg.index_topk < 1024 // 4  # the indexer selects at the training length (1024 tokens)
    tok = load_tokenizer(MINI)
    assert 2048 <= cfg.vocab_size <= 8192 and tok.get_vocab_size() == cfg.vocab_size
    assert [tok.token_to_id(s) for s in SPECIAL] == list(range(len(SPECIAL)))
    assert tok.encode("x = 1").ids[0] == cfg.bos_token_id == 0 and cfg.eos_token_id == 1
    with open(os.path.join(MINI, "tokenizer_config.json")) as f:
        assert json.load(f)["bos_token"] == SPECIAL[0]
    prompts = heldout_prompts("mini")
    assert len(prompts) >= 16 and all(isinstance(p, str) and p for p in prompts)


def test_loaded_by_name_in_the_api_and_the_reference_model():
    model = load_model("mini")
    assert model.has_mtp and model.cfg == model_config(MINI)
    llm = LLM("mini", max_batch_size=1, max_num_tokens=256, max_seq_len=256, warmup=False)
    out = llm.generate("def fib(n):", SamplingParams(max_tokens=12))[0]
    assert out.outputs[0].text and len(out.outputs[0].token_ids) == 12


def test_generate_cli_prints_the_api_text(capsys):
    from dsv4.cli import main

    llm = LLM("mini", max_batch_size=1, max_num_tokens=256, max_seq_len=256, warmup=False)
    want = llm.generate("def fib(n):", SamplingParams(max_tokens=24))[0].outputs[0].text
    assert main(["generate", "--model", "mini", "--prompt", "def fib(n):", "--max-tokens", "24", "--mtp", "2",
                 "--max-seq-len", "256"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(want) and "MTP: acceptance" in out


def test_bench_runs_the_heldout_prompts_with_mtp(tmp_path, capsys):
    from dsv4.bench import cli

    report = tmp_path / "r.json"
    examples = os.path.join(os.path.dirname(__file__), "..", "examples", "mtp.yml")
    rc = cli.main(["--model", "mini", "throughput", "--dataset", os.path.join(MINI, "heldout_prompts.jsonl"),
                   "--num_requests", "4", "--warmup", "0", "--concurrency", "4", "--threads", "1",
                   "--config", examples, "--report_json", str(report)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "built-in checkpoint" in out
    spec = json.loads(report.read_text())["speculative"]
    assert spec["num_draft_tokens"] > 0 and spec["acceptance_rate"] > 0.3  # random weights give ~0.005


@pytest.mark.slow
def test_first_draft_acceptance_on_the_heldout_prompts():
    """k = 1, greedy, fp32, every shipped held-out prompt: at least half of the drafts accepted."""
    llm = LLM("mini", max_batch_size=32, max_num_tokens=4096, max_seq_len=1024, warmup=False,
              speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 1})
    llm.generate(heldout_prompts("mini"), SamplingParams(max_tokens=24, ignore_eos=True))
    st = llm.get_stats()["speculative"]
    assert st["num_draft_tokens"] > 300
    assert st["acceptance_rate"] >= 0.5, st
