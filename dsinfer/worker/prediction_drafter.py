"""Drafts from a predicted output: OpenAI's `prediction` (SamplingParams.prediction).

A request that knows most of its answer already (a file with a few lines edited, a record
re-emitted with one field changed) sends it as its prediction. The drafter follows the output
along the prediction and proposes the prediction's next tokens; the model verifies them like any
other drafts (worker/spec_decode.py), so the output is exactly what it would be without the
prediction, and the right parts of the prediction cost a fraction of a step a token.

Where the output leaves the prediction (an edit), the drafter finds its way back: the latest
2-3 output tokens are looked up among the prediction's n-grams, preferring the first occurrence
that starts at or after the point where the two parted, as an edit that replaces a few lines
rejoins the old text further on. Until they match again, no drafts.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

from dsinfer.worker.ngram_drafter import ModelFreeDrafter

# The most draft tokens a step for a request with a prediction: a prediction is mostly right,
# and a verified run of 8 costs ~3 plain steps (docs/engine.md); the length adapts as for
# prompt lookup.
PREDICTION_DRAFT_TOKENS = 8
_NGRAM_SIZES = (3, 2)  # the output suffixes looked up to find the prediction again, longest first


class PredictionCursor:
    """Where a request's output stands in its prediction: `pos` is the prediction token the
    output should produce next, or None while the two have parted."""

    def __init__(self, prediction: list[int]) -> None:
        self.prediction = list(prediction)
        self.pos: int | None = 0
        self.seen = 0  # output tokens followed so far
        self._parted_at = 0  # the prediction position where the output last left it
        # n-gram → the prediction positions just after its occurrences, ascending.
        self._after: dict[tuple[int, ...], list[int]] = {}
        for n in _NGRAM_SIZES:
            for end in range(n, len(self.prediction) + 1):
                self._after.setdefault(tuple(self.prediction[end - n : end]), []).append(end)

    def follow(self, output: list[int]) -> None:
        """Take in the output tokens since the last call (all of them after a rollback)."""
        if len(output) < self.seen:  # a failed step's tokens were taken back: start over
            self.pos, self.seen, self._parted_at = 0, 0, 0
        for tok in output[self.seen :]:
            if self.pos is not None:
                if self.pos < len(self.prediction) and self.prediction[self.pos] == tok:
                    self.pos += 1
                    continue
                self._parted_at = self.pos
            self.pos = None
        self.seen = len(output)
        if self.pos is None:
            self.pos = self._rejoin(output)

    def _rejoin(self, output: list[int]) -> int | None:
        """The prediction position after the longest output suffix found in it: of its
        occurrences, the first that starts at or after where the two parted (text the output
        already passed is not read twice), else the last; None where no suffix occurs."""
        for n in _NGRAM_SIZES:
            if len(output) < n:
                continue
            ends = self._after.get(tuple(output[-n:]))
            if ends:
                i = bisect.bisect_left(ends, self._parted_at + n)
                return ends[i] if i < len(ends) else ends[-1]
        return None

    def draft(self, k: int) -> list[int]:
        """Up to k prediction tokens from where the output stands; [] while parted."""
        return [] if self.pos is None else self.prediction[self.pos : self.pos + k]


class PredictionDrafter(ModelFreeDrafter):
    """Drafts for the requests that carry a prediction; the runner hands it those requests
    (`start`), and the engine's own drafter (MTP, prompt lookup) the others.

    `output(req_id)` gives a request's output tokens so far (this step's included)."""

    def __init__(
        self, output: Callable[[str], list[int]], k: int = PREDICTION_DRAFT_TOKENS
    ) -> None:
        super().__init__(k)
        self.output = output
        self._cursors: dict[str, PredictionCursor] = {}

    def start(self, req_id: str, prediction: list[int]) -> None:
        self._cursors[req_id] = PredictionCursor(prediction)

    @property
    def req_ids(self) -> set[str]:
        """The requests it drafts for."""
        return set(self._cursors)

    def _draft(self, req_id: str, k: int) -> list[int]:
        cursor = self._cursors.get(req_id)
        if cursor is None:
            return []  # a request without a prediction: the engine's own drafter's
        cursor.follow(self.output(req_id))
        return cursor.draft(k)

    def forget(self, req_id: str) -> None:
        super().forget(req_id)
        self._cursors.pop(req_id, None)
