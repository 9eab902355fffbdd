"""Token ids -> text for one choice, as the tokens arrive: incremental detokenization and stop strings.

Detokenizing a token alone is wrong in two ways: a byte-level BPE token may hold part of a UTF-8 character
(decoding it alone gives U+FFFD), and some decoders treat the first token of a sequence differently (a
leading space dropped). So each new piece of text is the difference between two decodes that share a few
tokens of context::

    ids:   ... | context (prefix .. read) | new (read .. end)
    delta = decode(ids[prefix:]) - decode(ids[prefix:read])

and while the new decode ends in U+FFFD (an incomplete character) nothing is released and ``read`` stays.

Stop strings are searched in the text as it grows; with MTP one engine step can bring several tokens, so the
tokens are consumed one at a time and the choice stops at the token whose text completes a stop string (the
tokens after it are not counted). While generating, the last ``len(longest stop) - 1`` characters are held back,
since they may be the start of a stop string.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read]: context already turned into text
        self.read = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""

    def add(self, token_id: int) -> str:
        """The text this token completes ("" while a character is incomplete)."""
        return self.extend([token_id])

    def extend(self, token_ids: list[int]) -> str:
        """The text these tokens complete (two decodes for the lot)."""
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """At the end: whatever is left, incomplete characters included (as a full decode would give)."""
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


class OutputText:
    """One choice's text: tokens in, released text out, stop strings applied.

    ``stop_ids``: token ids that end generation (EOS unless ignored, ``stop_token_ids``); the one that ends
    the choice counts as a completion token but is not text (as vLLM)."""

    def __init__(self, tokenizer, stop: list[str], stop_ids: set[int], skip_special_tokens: bool,
                 include_stop_str: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.stop_ids = stop_ids
        self.include_stop_str = include_stop_str
        self.text = ""
        self.released = 0  # text[:released] has been handed out
        self.num_tokens = 0  # completion tokens consumed
        self.finish_reason: str | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, new_ids: list[int], finish_reason: str | None) -> str:
        """Consume the engine's new tokens (``finish_reason`` set when the engine ended the request); returns
        the text released now. Afterwards ``done`` says whether the choice ended (here or in the engine)."""
        if self.done:
            return ""
        if not self.stop:  # nothing to find in the text: the tokens go to the detokenizer together
            ends = bool(new_ids) and finish_reason == "stop" and new_ids[-1] in self.stop_ids
            self.num_tokens += len(new_ids)
            self._append(self.detok.extend(new_ids[:-1] if ends else new_ids))
            if finish_reason is not None:
                self._append(self.detok.flush())
                self.finish_reason = finish_reason
            return self._release(final=finish_reason is not None)
        for i, t in enumerate(new_ids):
            self.num_tokens += 1
            last = i == len(new_ids) - 1
            if last and finish_reason == "stop" and t in self.stop_ids:
                break  # the stop token ends the text without being part of it
            if self._append(self.detok.add(t)):
                return self._release(final=True)
        if finish_reason is not None:
            if self._append(self.detok.flush()):
                return self._release(final=True)
            self.finish_reason = finish_reason
            return self._release(final=True)
        return self._release(final=False)

    def _append(self, piece: str) -> bool:
        """Add text; True when it completed a stop string (the text is cut there and the choice is done)."""
        if not piece:
            return False
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        if not self.stop:
            return False
        hits = [(p, s) for s in self.stop if (p := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        pos, s = min(hits)
        self.text = self.text[:pos + len(s)] if self.include_stop_str else self.text[:pos]
        self.finish_reason = "stop"
        return True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self.released, len(self.text) - self.hold)
        out = self.text[self.released:end]
        self.released = end
        return out
