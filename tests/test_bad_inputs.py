"""Bad input at the Python API's edge: a clear error naming what to change, and nothing left behind (no request
queued, none in the engine's table, every cache slot and block free); then the LLM's settings, config.json, the
dsv4 command and dsv4 serve's request bodies and chat template. Table-driven: each row is what a hostile user
tried (issue 18, item 4) and what they must get. dsv4-bench's edge is in test_bad_inputs_bench.py."""

from __future__ import annotations

import math

import pytest

from dsv4 import LLM, SamplingParams
from dsv4.engine.config import EngineConfigError

# (SamplingParams keywords, the error's words)
BAD_PARAMS = [
    ({"temperature": math.nan}, "temperature must be a finite number"),
    ({"temperature": math.inf}, "temperature must be a finite number"),
    ({"temperature": -1.0}, "temperature must be a finite number >= 0"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_k": -2}, "top_k must be an integer >= 0"),
    ({"top_k": True}, "top_k must be an integer"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": math.nan}, r"top_p must be in \(0, 1\]"),
    ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"seed": 1.5}, "seed must be an integer or None"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids must be a list of token ids"),
    ({"stop_token_ids": 7}, "stop_token_ids must be a list of token ids"),
    # beyond what torch's generator takes: the engine (and a server's engine loop) died adding the request
    ({"seed": 2**64}, r"seed must be an integer or None \(an integer in \[-2\*\*63, 2\*\*64 - 1\]\)"),
    ({"seed": -2**63 - 1}, r"seed must be an integer or None \(an integer in \[-2\*\*63"),
    ({"ignore_eos": "no"}, "ignore_eos must be True or False, got 'no'"),  # was kept, and meant True
    ({"detokenize": 0}, "detokenize must be True or False, got 0"),
]


@pytest.mark.parametrize("kw,words", BAD_PARAMS, ids=[str(k) for k, _ in BAD_PARAMS])
def test_bad_sampling_params_are_refused_when_made(kw, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kw)


def test_what_vllm_accepts_means_what_it_means_there():
    assert SamplingParams(temperature=1e-45).greedy  # below 1e-5: greedy
    assert SamplingParams(top_k=-1).top_k == 0  # -1: off


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", max_batch_size=4, max_seq_len=64, kv_cache_config={"max_tokens": 512}, warmup=False)


def _clean(llm):
    e = llm.engine
    assert not e.requests and not e.has_unfinished_requests()
    assert e.cache.num_free_slots == e.cache.num_slots and e.cache.num_free_blocks == e.cache.num_blocks
    e.cache.check_integrity()


GOOD = [1, 2, 3, 4]
# (prompts, sampling params, error type, the error's words): the bad element comes after good ones
BAD_CALLS = [
    ([GOOD, None], None, TypeError, "prompt 1: expected a string or a list of integer token ids"),
    ([GOOD, 5], None, TypeError, "prompt 1"),
    ([GOOD, ["a"]], None, TypeError, "prompt 1"),
    ([GOOD, [1.0, 2.0]], None, TypeError, "prompt 1"),  # float ids are not truncated
    ([GOOD, [True, 2]], None, TypeError, "prompt 1"),
    (GOOD + [2.5], None, TypeError, "prompt 0"),
    (42, None, TypeError, "prompts must be"),
    ([GOOD, "\ud800"], None, ValueError, r"prompt 1: not valid Unicode text: a lone surrogate \('\\ud800'\)"),
    ([GOOD, GOOD], [SamplingParams(max_tokens=2)], ValueError, "1 sampling params for 2 prompts"),
    ([GOOD, GOOD], [SamplingParams(max_tokens=2), {"max_tokens": 2}], TypeError, "sampling_params must be"),
]


@pytest.mark.parametrize("prompts,params,err,words", BAD_CALLS, ids=[w for *_, w in BAD_CALLS])
@pytest.mark.parametrize("api", ["generate", "generate_stream"])
def test_a_bad_element_queues_nothing(llm, api, prompts, params, err, words):
    with pytest.raises(err, match=words):
        out = getattr(llm, api)(prompts, params)
        if api == "generate_stream":
            list(out)
    _clean(llm)
    # the next call runs only its own request
    assert [len(o.outputs[0].token_ids) for o in llm.generate([GOOD], SamplingParams(max_tokens=3))] == [3]
    _clean(llm)


def test_a_refused_request_does_not_stop_the_others(llm):
    outs = llm.generate([GOOD, [10**9], list(range(100))], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(outs[0].outputs[0].token_ids) == 3
    assert "outside the vocabulary" in outs[1].error and "exceeds max_seq_len" in outs[2].error
    _clean(llm)


def test_an_abandoned_stream_leaves_nothing(llm):
    solo = llm.generate([GOOD], SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    stream = llm.generate_stream([GOOD, [5, 6, 7]], SamplingParams(max_tokens=8, ignore_eos=True))
    next(stream)
    stream.close()
    llm.engine.step()  # an overlapped step still in flight settles
    _clean(llm)
    assert llm.generate([GOOD], SamplingParams(max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids == solo


def test_a_failing_step_fails_its_call_and_leaves_nothing(llm, monkeypatch):
    calls = {"n": 0}
    real = llm.engine.runner.forward

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return real(*a, **k)

    monkeypatch.setattr(llm.engine.runner, "forward", flaky)
    with pytest.raises(RuntimeError, match="injected step failure"):
        llm.generate([GOOD, [9, 8, 7]], SamplingParams(max_tokens=8, ignore_eos=True))
    monkeypatch.undo()
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    _clean(llm)
    assert len(llm.generate([GOOD], SamplingParams(max_tokens=4))[0].outputs[0].token_ids) == 4


# ---- settings and limits (issue 18, items 2, 3, 7) -------------------------------------------------------
MTP1 = {"decoding_type": "MTP", "num_nextn_predict_layers": 1}
# (LLM settings that are valid, however small): warmup fits in them and a request that fits runs
SMALL_BUT_VALID = [
    ({"max_seq_len": 2, "max_batch_size": 1}, [1], 1),  # a 1-token prompt with 1 output token
    ({"max_seq_len": 6, "max_batch_size": 2, "speculative_config": MTP1}, [1, 2, 3], 3),
    ({"max_seq_len": 8, "max_batch_size": 2, "max_num_tokens": 4,
      "speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 3}}, [1, 2, 3, 4], 4),
    ({"max_seq_len": 64, "max_batch_size": 1, "kv_cache_config": {"max_tokens": 64}}, [1, 2], 62),
]


@pytest.mark.parametrize("settings,prompt,n", SMALL_BUT_VALID, ids=[str(s) for s, *_ in SMALL_BUT_VALID])
def test_warmup_fits_whatever_the_limits_allow(settings, prompt, n):
    llm = LLM("tiny", **{"kv_cache_config": {"max_tokens": 256}, **settings})
    assert llm.warmup_paths
    out = llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    assert out.error is None and len(out.outputs[0].token_ids) == n
    _clean(llm)


# (LLM settings, the error's words): refused at once, before weights are read or memory allocated
BAD_SETTINGS = [
    ({"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 1000}}, "at most 16"),
    ({"max_batch_size": 10**23}, r"max_batch_size must be in \[1, 65536\]"),
    ({"max_num_tokens": 0}, r"max_num_tokens must be in \[1,"),
    ({"max_seq_len": 1}, "max_seq_len must be >= 2"),
    ({"seed": 2**64}, r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\], got 18446744073709551616"),
]


@pytest.mark.parametrize("settings,words", BAD_SETTINGS, ids=[w for _, w in BAD_SETTINGS])
def test_impossible_settings_are_refused_before_anything_is_built(settings, words, monkeypatch):
    import dsv4.llm

    monkeypatch.setattr(dsv4.llm, "load_model", lambda *a, **k: pytest.fail("weights loaded for bad settings"))
    with pytest.raises(EngineConfigError, match=words):
        LLM("tiny", **settings)


# (LLM's positional and keyword arguments, the error's words): Python types the API cannot take
BAD_LLM_ARGS = [
    ((None,), {}, "LLM: model must be a checkpoint directory, a built-in model"),
    ((5,), {}, "LLM: model must be .* got int"),
    (("tiny",), {"config": {"max_batch_size": 2}}, r"LLM: config= takes an EngineConfig, got dict; give the settings"
                                                    " as keywords"),
    (("tiny",), {"warmup": "no"}, "LLM: warmup must be True or False, got 'no'"),
]


@pytest.mark.parametrize("args,kw,words", BAD_LLM_ARGS, ids=[w for *_, w in BAD_LLM_ARGS])
def test_wrongly_typed_llm_arguments_are_named(args, kw, words, monkeypatch):
    import dsv4.llm

    monkeypatch.setattr(dsv4.llm, "load_model", lambda *a, **k: pytest.fail("weights loaded for bad arguments"))
    with pytest.raises(TypeError, match=words):
        LLM(*args, **kw)


def test_a_path_object_names_a_checkpoint(good_checkpoint):
    import pathlib

    llm = LLM(pathlib.Path(good_checkpoint[0]), max_batch_size=1, max_seq_len=16, warmup=False)
    assert len(llm.generate([GOOD], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_a_cache_smaller_than_the_batch_says_so():
    llm = LLM("tiny", max_batch_size=8, max_seq_len=512, kv_cache_config={"max_gpu_memory_bytes": 200_000},
              warmup=False)
    assert llm.resolved.num_slots < 8
    assert any(f"max_batch_size=8 is capped to {llm.resolved.num_slots}" in n for n in llm.notes)
    assert "0.0 MiB" not in llm.resolved.sizing.describe() and "KiB budget" in llm.resolved.sizing.describe()


# ---- config.json (issue 18, items 5 and 8) ----------------------------------------------------------------
# (a key of the tiny model's config.json and a wrong value, the error's words)
BAD_CONFIG_KEYS = [
    ("hidden_size", 64.9, "'hidden_size' must be an integer, got 64.9"),
    ("hidden_size", "64", "'hidden_size' must be an integer"),
    ("num_attention_heads", True, "'num_attention_heads' must be an integer"),
    ("sliding_window", 0, "window_size must be >= 1"),
    ("index_topk", -4, "index_topk must be >= 1"),
    ("eos_token_id", 10**6, "eos_token_id 1000000 is outside the vocabulary"),
    ("rope_theta", "big", "'rope_theta' must be a number"),
]


@pytest.mark.parametrize("key,value,words", BAD_CONFIG_KEYS, ids=[f"{k}={v!r}" for k, v, _ in BAD_CONFIG_KEYS])
def test_a_wrongly_typed_config_key_is_named(key, value, words):
    from dsv4.config import ConfigError, from_config_dict, get_preset

    raw = get_preset("tiny").to_official_dict()
    assert key in raw
    with pytest.raises(ConfigError, match=words):
        from_config_dict({**raw, key: value})


# ---- the dsv4 command (issue 18, item 5) -----------------------------------------------------------------
GEN = ["generate", "--model", "tiny", "--prompt-ids", "1 2"]
# (argv, the error's words): exit 2, one line naming what to change, no traceback, nothing generated
BAD_CLI = [
    (GEN + ["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (GEN + ["--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    (GEN + ["--max-tokens", "0"], "--max-tokens must be an integer >= 1"),
    (["generate", "--model", "tiny", "--prompt-ids", "a b"], "--prompt-ids 'a b': give token ids as integers"),
    (["generate", "--model", "tiny", "--prompt-ids", ""], "--prompt-ids is empty"),
    (GEN + ["--device", "gpu"], "device 'gpu': use cpu or cuda"),
    (["--log_level", "loud"] + GEN, "invalid choice: 'loud'"),
    (GEN + ["--temperature", "1", "--seed", str(2**64)], r"--seed must be an integer or None \(an integer in"),
    (["generate", "--model", "tiny", "--prompt", "\udcff"], "--prompt is not UTF-8 text"),  # argv byte 0xff
    (["init-random", "--out", "never_written", "--seed", str(2**64)],
     r"init-random: --seed 18446744073709551616: give an integer in \[-2\*\*63, 2\*\*64 - 1\]"),
]


@pytest.mark.parametrize("argv,words", BAD_CLI, ids=[w for _, w in BAD_CLI])
def test_dsv4_command_refuses_with_a_message(argv, words, capsys):
    import re

    from dsv4.cli import main

    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2 and re.search(words, err) and "Traceback" not in err and out == ""


def test_dsv4_command_refuses_cuda_without_a_gpu(capsys):
    import torch

    from dsv4.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(GEN + ["--device", "cuda"]) == 2
    assert "has no CUDA or sees no GPU" in capsys.readouterr().err


def test_init_random_refuses_a_file_as_its_directory(tmp_path, capsys):
    from dsv4.cli import main

    f = tmp_path / "a_file"
    f.write_text("x")
    assert main(["init-random", "--out", str(f)]) == 2
    assert "is a file; give a directory" in capsys.readouterr().err and f.read_text() == "x"


def test_init_random_refuses_an_out_it_cannot_create(tmp_path, capsys):
    from dsv4.cli import main

    f = tmp_path / "a_file"
    f.write_text("x")
    assert main(["init-random", "--out", str(f / "sub")]) == 2
    out, err = capsys.readouterr()
    assert f"cannot write --out {f / 'sub'}: Not a directory" in err and "Traceback" not in err and out == ""


# ---- dsv4 serve: request bodies and the chat template -----------------------------------------------------
@pytest.fixture(scope="module")
def http():
    from fastapi.testclient import TestClient

    from dsv4.serve.app import build_app

    served = LLM("mini", max_batch_size=4, max_seq_len=128, kv_cache_config={"max_tokens": 1024}, warmup=False)
    with TestClient(build_app(served, "mini"), raise_server_exceptions=False) as client:
        yield client


USER = [{"role": "user", "content": "x"}]
# (path, body, param, the error's words): a 400 naming the field, and the server still serves
BAD_BODIES = [
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 1, "seed": 2**70}, "seed",
     r"seed must be an integer or None \(an integer in \[-2\*\*63, 2\*\*64 - 1\]\)"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2, "temperature": 1, "seed": 2**64 - 1, "n": 2}, "seed",
     "seed must be an integer or None"),  # choice 1 draws with seed + 1
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "stream": True, "seed": -2**63 - 1}, "seed",
     "seed must be an integer or None"),
    ("/tokenize", {"messages": []}, "messages", "messages: List should have at least 1 item"),
    # a lone surrogate escape: valid JSON, not text (the tokenizer raised a TypeError: a 500)
    ("/v1/completions", {"prompt": ["ok", "\ud800"], "max_tokens": 2}, "prompt",
     r"prompt is not valid Unicode text: it holds a lone surrogate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 2}, "messages",
     "messages is not valid Unicode text"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt", "prompt is not valid Unicode text"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "tools": [{"function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     r"tool_choice names the function 'g', which is not in tools \(f\)"),
]


@pytest.mark.parametrize("path,body,param,words", BAD_BODIES, ids=[w for *_, w in BAD_BODIES])
def test_bad_request_bodies_are_400s_naming_the_field(http, path, body, param, words):
    import json
    import re

    # (json.dumps escapes a lone surrogate as "\\ud800", as a client's JSON carries it)
    r = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(words, err["message"]), err
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "temperature": 1, "seed": 7})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    assert http.get("/health").status_code == 200


def _jinja_file(d, text):
    (d / "t.jinja").write_bytes(text)
    return ["--chat_template", str(d / "t.jinja")]


def _checkpoint_file(name, text):
    def write(d):
        (d / "ckpt").mkdir()
        (d / "ckpt" / "config.json").write_text("{}")  # (never read: the template is refused first)
        (d / "ckpt" / name).write_text(text)
        return []
    return write


# (how the template is broken, the error's words): refused before the engine process starts
BAD_TEMPLATES = [
    (lambda d: _jinja_file(d, b"{% for m in messages %}{{ m.content }"), "t.jinja': the chat template is not valid"
     r" Jinja: unexpected '}' \(line 1\)"),
    (lambda d: _jinja_file(d, b"\xff\xfe{{ x }}"), r"t.jinja' is not UTF-8 text \(byte 0xff at offset 0\)"),
    (_checkpoint_file("chat_template.jinja", "{% if %}"), "the chat template of .*ckpt: the chat template is not valid"
     " Jinja"),
    (_checkpoint_file("tokenizer_config.json", "{not json"), "tokenizer_config.json is not valid JSON .*; fix it or"
     " give --chat_template"),
]


@pytest.mark.parametrize("breaks,words", BAD_TEMPLATES, ids=[w.split(":")[-1] for _, w in BAD_TEMPLATES])
def test_serve_refuses_a_bad_chat_template_before_starting(tmp_path, monkeypatch, capsys, breaks, words):
    import re

    from dsv4.cli import main
    from dsv4.serve import launch

    monkeypatch.setattr(launch, "_start_engine", lambda spec: pytest.fail("the engine started"))
    extra = breaks(tmp_path)
    model = str(tmp_path / "ckpt") if (tmp_path / "ckpt").exists() else "tiny"
    rc = main(["serve", model, "--device", "cpu", *extra])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(words, err) and "Traceback" not in err, err
