"""The dsv4 command: init-random (deterministic, loadable) and generate."""

import hashlib
import os

import torch

from dsv4.cli import main
from dsv4.model import load_model


def _digest(path):
    return hashlib.sha256(open(os.path.join(path, "model.safetensors"), "rb").read()).hexdigest()


def test_init_random_is_deterministic_and_loads(tmp_path):
    a, b, c = (str(tmp_path / x) for x in "abc")
    assert main(["init-random", "--preset", "tiny", "--out", a, "--seed", "7"]) == 0
    assert main(["init-random", "--preset", "tiny", "--out", b, "--seed", "7"]) == 0
    assert main(["init-random", "--preset", "tiny", "--out", c, "--seed", "8"]) == 0
    assert _digest(a) == _digest(b) != _digest(c)
    assert os.path.isfile(os.path.join(a, "tokenizer.json"))
    model = load_model(a)
    assert model.has_mtp
    ids = torch.randint(0, 256, (1, 20))
    assert model(ids).shape == (1, 20, 256) and model.mtp_logits(ids).shape == (1, 19, 256)


def test_init_random_unknown_preset(tmp_path, capsys):
    assert main(["init-random", "--preset", "huge", "--out", str(tmp_path)]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_generate_streams_text_and_ids(tmp_path, capsys):
    d = str(tmp_path / "m")
    main(["init-random", "--preset", "tiny", "--out", d])
    assert main(["generate", "--model", d, "--prompt", "Hi", "--max-tokens", "5", "--mtp", "1",
                 "--max-seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "[5 tokens, finish: length]" in out and "MTP: acceptance" in out
    assert main(["generate", "--model", "tiny", "--prompt-ids", "1 2 3", "--max-tokens", "3",
                 "--max-seq-len", "64"]) == 0
    assert "[3 tokens" in capsys.readouterr().out
