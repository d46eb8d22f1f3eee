"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of a request's
last few tokens, verified by the main model like any other drafts (worker/spec_decode.py).

Summaries, record extraction and edits copy spans of their input; where a request's last n
tokens (n from `max_ngram` down to `min_ngram`) occurred before in its prompt or output, the
k tokens after that occurrence are a draft that costs no model at all. Verification (greedy
or sampled) keeps the output exactly what plain decoding gives; a wrong draft costs only the
extra rows it put in the step. Where nothing matches, no draft: the step stays a plain decode
(on the CPU, the captured program).

Each request keeps an index, n-gram → the position just after its latest occurrence, grown
by the tokens appended since the last step: a lookup costs O(max_ngram), not a scan of the
history. And a draft length of its own: a step that rejects a draft at position j proposes
j + 1 next time, one that accepts every draft doubles it (up to k): each draft row costs
~0.2-0.3 of a decode step (docs/engine.md), so text that does not copy its input settles on
one draft a step while a copied span ramps back up within two steps.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dsinfer.worker.input_batch import ModelInput
from dsinfer.worker.step_io import ModelRunnerOutput

# A step's rows with drafts stay within this many: under load each step already reads the
# weights once for many requests' tokens, and draft rows there would mostly add work (16
# streams: no drafts at all).
MAX_STEP_ROWS = 16


# Steps in a row whose drafts were all rejected before a request stops drafting for a while
# (1, 2, 4, … up to 16 steps, doubling while it goes on missing).
MISSES_BEFORE_PAUSE = 2
MAX_PAUSE_STEPS = 16


class DraftLength:
    """How many tokens a request drafts next, from what verification kept: a step that
    rejected the draft at position j proposes j + 1 next, one that kept them all doubles it
    (up to k). And whether to draft at all: a draft row costs ~0.3 of a plain step on the CPU
    (docs/engine.md), so a request whose drafts keep missing (a flat sampled distribution, a
    wrong prediction) pauses after MISSES_BEFORE_PAUSE such steps, for a number of steps that
    doubles while it goes on missing, and starts again from one token."""

    def __init__(self, k: int) -> None:
        self.k = k
        self.tokens = k
        self._misses = 0  # steps in a row whose drafts were all rejected
        self._paused = 0  # steps left without drafts

    def verified(self, drafted: int, accepted: int) -> None:
        """The last step checked `drafted` drafts and kept `accepted` of them."""
        self.tokens = min(self.k, 2 * self.tokens) if accepted == drafted else accepted + 1
        self._misses = self._misses + 1 if accepted == 0 else 0
        if self._misses >= MISSES_BEFORE_PAUSE:
            self._paused = min(MAX_PAUSE_STEPS, 2 ** (self._misses - MISSES_BEFORE_PAUSE))

    def next(self) -> int:
        """Tokens to draft this step: 0 while paused (each call is one step of the pause)."""
        if self._paused:
            self._paused -= 1
            return 0
        return self.tokens


class _NgramIndex:
    """n-grams of one token history, each mapped to the position after its latest occurrence
    among those that have a following token."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.sizes = range(min_ngram, max_ngram + 1)
        self.after: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are in `after`

    def lookup(self, history: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of history's longest
        matching suffix; [] when none occurred (or k is 0: the index still catches up)."""
        if len(history) < self.indexed:  # a failed step's tokens were rolled back
            self.after.clear()
            self.indexed = 0
        # Index every n-gram that ends before the last token: each has a token after it.
        for end in range(max(self.indexed, 1), len(history)):
            for n in self.sizes:
                if end >= n:
                    self.after[tuple(history[end - n : end])] = end
        self.indexed = len(history)
        for n in reversed(self.sizes):
            if len(history) >= n and (at := self.after.get(tuple(history[-n:]))) is not None:
                return history[at : at + k]
        return []


class ModelFreeDrafter:
    """The drafter seam for drafters that run no model (prompt lookup, a prediction):
    `propose(inp, hidden, result, wants_draft, driver)` gives each request that sampled this
    step (and is wanted) a draft of `_draft(req_id, k)`, k from its DraftLength (which learns
    from what the step's verification kept) and its share of MAX_STEP_ROWS; `forget(req_id)`
    when a request ends. Subclasses say what they draft."""

    def __init__(self, k: int) -> None:
        self.k = k
        self._lengths: dict[str, DraftLength] = {}

    def _draft(self, req_id: str, k: int) -> list[int]:
        """Up to k draft tokens (k may be 0: keep up with the request's tokens, draft none)."""
        raise NotImplementedError

    def propose(
        self,
        inp: ModelInput,
        hidden: torch.Tensor,  # noqa: ARG002  (the drafter seam's signature: MTP reads it)
        result: ModelRunnerOutput,
        wants_draft: set[str],
        driver: bool = True,
    ) -> None:
        if not driver:  # drafts go to the scheduler, which lives with the driver
            return
        share = (MAX_STEP_ROWS - len(inp.seqs)) // len(inp.seqs)  # draft rows a request
        for s in inp.seqs:
            rid = s.req_id
            if rid not in result.sampled or rid not in wants_draft:
                continue
            length = self._lengths.setdefault(rid, DraftLength(self.k))
            if s.num_draft:
                length.verified(s.num_draft, len(result.bonus.get(rid, [])))
            # (A step with no room for drafts is no step of a pause.)
            if draft := self._draft(rid, min(length.next(), share) if share >= 1 else 0):
                result.drafts[rid] = draft

    def forget(self, req_id: str) -> None:
        self._lengths.pop(req_id, None)


class NgramDrafter(ModelFreeDrafter):
    """Up to k draft tokens a step for each request whose recent tokens recur.

    `history(req_id)` gives a request's tokens so far (prompt and output, this step's
    included)."""

    def __init__(
        self,
        k: int,
        history: Callable[[str], list[int]],
        min_ngram: int = 2,
        max_ngram: int = 3,
    ) -> None:
        if k < 1:
            raise ValueError(f"n-gram speculation needs k >= 1 draft tokens, got {k}")
        super().__init__(k)
        self.history = history
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._index: dict[str, _NgramIndex] = {}

    def _draft(self, req_id: str, k: int) -> list[int]:
        index = self._index.get(req_id)
        if index is None:
            index = self._index[req_id] = _NgramIndex(self.min_ngram, self.max_ngram)
        return index.lookup(self.history(req_id), k)

    def forget(self, req_id: str) -> None:
        super().forget(req_id)
        self._index.pop(req_id, None)
