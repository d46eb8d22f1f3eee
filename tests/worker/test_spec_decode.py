"""Speculative verification in isolation (worker/spec_decode.py), on designed logits.

A decode that carries drafts runs as [last token, draft 1, …, draft n]; the row after each
draft checks it. Greedy verification keeps the sampled token, then each further row's argmax
for as long as the previous token equals the draft at that position."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsinfer.worker.spec_decode import draft_rows, sample_rows, verify_greedy
from dsinfer.worker.step_io import ModelRunnerOutput, ScheduledSeq

V = 16


def _step(*seqs: ScheduledSeq) -> SimpleNamespace:
    """The flat batch's last row of each sequence, as build_model_input lays them out."""
    last, row = [], -1
    for s in seqs:
        row += len(s.token_ids)
        last.append(row)
    return SimpleNamespace(seqs=list(seqs), last_rows=last)


def _logits(*argmaxes: int) -> torch.Tensor:
    out = torch.zeros(len(argmaxes), V)
    for i, t in enumerate(argmaxes):
        out[i, t] = 5.0
    return out


def test_rows_that_sample_and_rows_that_check() -> None:
    a = ScheduledSeq("a", [7, 3, 4], 20, [], True, num_draft=2)  # rows 0-2
    b = ScheduledSeq("b", [9], 11, [], True)  # row 3: no drafts
    c = ScheduledSeq("c", [1, 2], 5, [], True, num_draft=1)  # rows 4-5
    inp = _step(a, b, c)
    assert sample_rows(inp) == [0, 3, 4]  # each sequence's row before its drafts
    spec, rows = draft_rows(inp, {"a", "b", "c"})
    assert [s.req_id for _, s in spec] == ["a", "c"]
    assert rows == [1, 2, 5]  # one row after each draft
    spec, rows = draft_rows(inp, {"b", "c"})  # a did not sample this step (failed, aborted)
    assert [s.req_id for _, s in spec] == ["c"] and rows == [5]


def test_every_draft_accepted_gives_one_token_more_than_the_drafts() -> None:
    a = ScheduledSeq("a", [7, 3, 4], 20, [], True, num_draft=2)
    spec, _rows = draft_rows(_step(a), {"a"})
    out = ModelRunnerOutput(sampled={"a": 3})  # the sampled token equals draft 1
    verify_greedy(_logits(4, 11), spec, out)  # row after draft 1 says 4 (= draft 2), then 11
    assert out.bonus == {"a": [4, 11]}


def test_a_rejected_draft_ends_the_run() -> None:
    a = ScheduledSeq("a", [7, 3, 4], 20, [], True, num_draft=2)
    spec, _rows = draft_rows(_step(a), {"a"})
    out = ModelRunnerOutput(sampled={"a": 6})  # ≠ draft 1: nothing after it is certain
    verify_greedy(_logits(4, 11), spec, out)
    assert out.bonus == {}
    out = ModelRunnerOutput(sampled={"a": 3})
    verify_greedy(_logits(8, 11), spec, out)  # 8 ≠ draft 2: keep 8, stop there
    assert out.bonus == {"a": [8]}


def test_rows_of_several_sequences_are_read_at_their_own_offsets() -> None:
    a = ScheduledSeq("a", [7, 3, 4], 20, [], True, num_draft=2)
    c = ScheduledSeq("c", [1, 2], 5, [], True, num_draft=1)
    spec, _rows = draft_rows(_step(a, c), {"a", "c"})
    out = ModelRunnerOutput(sampled={"a": 3, "c": 2})
    verify_greedy(_logits(4, 11, 13), spec, out)  # a's rows 0-1, then c's row 2
    assert out.bonus == {"a": [4, 11], "c": [13]}
