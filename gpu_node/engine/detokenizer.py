"""Incremental detokenization with stop strings, one token at a time.

Each token costs two decodes of a short window (the tokens since the last text
was decoded, plus the one before them for context), never the whole output,
so streaming stays linear in the output length. Text that ends in an
incomplete UTF-8 sequence (decoded as U+FFFD) is held back until the bytes
that complete it arrive, and so is a tail that could be the start of a stop
string, so a client never receives part of a stop string; :meth:`flush`
releases that tail when generation ends for another reason.

The window decodes call the Rust tokenizer directly where transformers' ``decode``
would return the same text (no ``clean_up_tokenization_spaces`` pass): its Python
wrapper costs several times the decode itself, twice per token of every request.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()) -> None:
        self._decode = _window_decoder(tokenizer)
        self._stop = tuple(text for text in stop if text)
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # window start: one token of context before the undecoded tokens
        self._read_offset = 0  # tokens before this are decoded into text
        self._pending = ""  # decoded, not emitted: could be the start of a stop string
        self.text = ""  # emitted so far

    def push(self, token_id: int, check_stop: bool = True) -> tuple[str, bool]:
        """Text to emit after this token, and whether a stop string was reached (the text then ends
        before it).

        ``check_stop`` false (the request is short of its ``min_tokens``): stop strings are not
        looked for in this token's text, nor held back, as vLLM does.
        """
        self._token_ids.append(token_id)
        decode = self._decode
        prefix_text = decode(self._token_ids[self._prefix_offset : self._read_offset])
        new_text = decode(self._token_ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return "", False
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        pending = self._pending + new_text[len(prefix_text) :]
        if not check_stop:
            self._pending = ""
            return self._emit(pending), False
        found = [index for index in (pending.find(text) for text in self._stop) if index >= 0]
        if found:
            self._pending = ""
            return self._emit(pending[: min(found)]), True
        held = max(
            (
                size
                for text in self._stop
                for size in range(1, len(text))
                if pending.endswith(text[:size])
            ),
            default=0,
        )
        self._pending = pending[len(pending) - held :] if held else ""
        return self._emit(pending[: len(pending) - held]), False

    def flush(self) -> str:
        """Emit the held-back tail (generation ended without completing a stop string)."""
        pending, self._pending = self._pending, ""
        return self._emit(pending)

    def _emit(self, text: str) -> str:
        self.text += text
        return text


def _window_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, straight on the Rust backend when that is the same text."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return partial(tokenizer.decode, skip_special_tokens=True)
    return partial(backend.decode, skip_special_tokens=True)
