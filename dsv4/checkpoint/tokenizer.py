"""Tokenizers: loading a checkpoint's tokenizer.json, and a byte-level one for random checkpoints: token id = byte value (ids 0/1 double as bos/eos, which
are control bytes no text contains). Built with the ``tokenizers`` library and saved as tokenizer.json."""

from __future__ import annotations

import os

from ..config import is_checkpoint_dir


def _byte_symbols() -> list[str]:
    """The printable stand-in character of each byte, as byte-level BPE tokenizers define them."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def write_byte_tokenizer(out_dir: str, vocab_size: int) -> str | None:
    """Write tokenizer.json when the vocabulary has room for every byte; returns its path (or None)."""
    if vocab_size < 256:
        return None
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    return path


def load_tokenizer(checkpoint_dir: str):
    """The checkpoint's tokenizer.json as a ``tokenizers.Tokenizer``, or None when it has none."""
    path = os.path.join(checkpoint_dir, "tokenizer.json")
    if not is_checkpoint_dir(checkpoint_dir) or not os.path.isfile(path):
        return None
    from tokenizers import Tokenizer

    from .schema import CheckpointError

    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # (the tokenizers library raises a bare Exception for a malformed file)
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise CheckpointError(f"{path} is not a readable tokenizer.json ({why}); replace it with the model's own,"
                              " or remove it to pass token ids only") from None
