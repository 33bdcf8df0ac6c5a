"""Incremental detokenization with stop strings, one token at a time.

Each token costs two decodes of a short window (the tokens since the last text
was emitted, plus the one before them for context), never the whole output,
so streaming stays linear in the output length. Text that ends in an
incomplete UTF-8 sequence (decoded as U+FFFD) is held back until the bytes
that complete it arrive.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._stop = tuple(text for text in stop if text)
        # a stop string may straddle what was emitted and the new text: keep this much of the emitted text to search
        self._stop_context = max((len(text) for text in self._stop), default=1) - 1
        self._token_ids: list[int] = []
        self._prefix_offset = 0  # window start: one token of context before the unemitted tokens
        self._read_offset = 0  # tokens before this have their text emitted
        self.text = ""

    def push(self, token_id: int) -> tuple[str, bool]:
        """Text this token completes, and whether a stop string was reached (the text then ends before it)."""
        self._token_ids.append(token_id)
        decode = self._tokenizer.decode
        window = self._token_ids[self._prefix_offset :]
        prefix_text = decode(self._token_ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        new_text = decode(window, skip_special_tokens=True)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return "", False
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        if self._stop:
            tail = self.text[len(self.text) - self._stop_context :] if self._stop_context else ""
            searched = tail + delta
            found = [index for index in (searched.find(text) for text in self._stop) if index >= 0]
            if found:
                delta = delta[: max(min(found) - len(tail), 0)]
                self.text += delta
                return delta, True
        self.text += delta
        return delta, False
