"""Incremental, UTF-8-safe detokenisation with stop strings that never leak.

Text is decoded over a sliding window of ids; a delta that ends in U+FFFD (an incomplete UTF-8
sequence, e.g. the first bytes of a Chinese character) is held until the next token completes it.
While stop strings are set, the last len(longest stop) - 1 characters are held back from
streaming, because they might be the start of a stop string.
"""

from __future__ import annotations

from dsinfer.sampling import SamplingParams
from dsinfer.tokenizer import Tokenizer

_PROMPT_TAIL = 6  # prompt ids kept as left context so the first word's spacing decodes right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = list(params.stop)
        self.include_stop = params.include_stop_str_in_output
        self._ids = list(prompt_ids[-_PROMPT_TAIL:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""  # all text decoded so far (cut at a stop string once found)
        self._sent = 0  # characters already handed to the caller
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add_tokens(self, token_ids: list[int], final: bool = False) -> int:
        """Absorb new ids; sets `stopped_by` when a stop string appears. Returns how many ids
        it absorbed: all of them, or those up to the one whose text completed a stop string
        (a step that verified drafts may emit tokens past it)."""
        for n, tid in enumerate(token_ids):
            if self.stopped_by is not None:
                return n
            self._ids.append(tid)
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            new_text = self._decode(self._ids[self._prefix :])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                self._append(new_text[len(prefix_text) :])
                self._prefix, self._read = self._read, len(self._ids)
        if final and self.stopped_by is None and self._read < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            self._append(self._decode(self._ids[self._prefix :])[len(prefix_text) :])
            self._read = len(self._ids)
        return len(token_ids)

    def _append(self, delta: str) -> None:
        start = max(0, len(self.text) - max((len(s) for s in self.stop), default=0))
        self.text += delta
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1:
                self.stopped_by = s
                self.text = self.text[: idx + len(s)] if self.include_stop else self.text[:idx]
                return

    def take_delta(self, finished: bool) -> str:
        """Text safe to show now (everything once finished or stopped)."""
        hold = 0
        if not finished and self.stopped_by is None and self.stop:
            hold = max(len(s) for s in self.stop) - 1
        end = max(self._sent, len(self.text) - hold)
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
