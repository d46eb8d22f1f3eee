"""Speculative verification in isolation (worker/spec_decode.py), on designed logits.

A decode that carries drafts runs as [last token, draft 1, …, draft n]; the row after each
draft checks it. Verification keeps the sampled token, then the token each further row's
sampler draws (its argmax for a greedy request) for as long as the previous token equals the
draft at that position."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsinfer.sampling import SamplingParams
from dsinfer.worker.sampler import Sampler, SamplerState
from dsinfer.worker.spec_decode import draft_rows, sample_rows, verify_drafts
from dsinfer.worker.step_io import ModelRunnerOutput, ScheduledSeq

V = 16
GREEDY = SamplingParams(temperature=0)


def _state(params: SamplingParams = GREEDY, output=(), seed: int = 0) -> SamplerState:
    return SamplerState(params, [1, 2], torch.Generator().manual_seed(seed), list(output))


def verify(logits, spec, out: ModelRunnerOutput, **params: SamplingParams) -> None:  # noqa: ANN001
    """verify_drafts as the runner calls it: each request's state ends with its sampled token."""
    states = {rid: _state(params.get(rid, GREEDY), [tok]) for rid, tok in out.sampled.items()}
    verify_drafts(logits, spec, out, states, Sampler())


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
    verify(_logits(4, 11), spec, out)  # row after draft 1 says 4 (= draft 2), then 11
    assert out.bonus == {"a": [4, 11]}


def test_a_rejected_draft_ends_the_run() -> None:
    a = ScheduledSeq("a", [7, 3, 4], 20, [], True, num_draft=2)
    spec, _rows = draft_rows(_step(a), {"a"})
    out = ModelRunnerOutput(sampled={"a": 6})  # ≠ draft 1: nothing after it is certain
    verify(_logits(4, 11), spec, out)
    assert out.bonus == {}
    out = ModelRunnerOutput(sampled={"a": 3})
    verify(_logits(8, 11), spec, out)  # 8 ≠ draft 2: keep 8, stop there
    assert out.bonus == {"a": [8]}


def test_rows_of_several_sequences_are_read_at_their_own_offsets() -> None:
    a = ScheduledSeq("a", [7, 3, 4], 20, [], True, num_draft=2)
    c = ScheduledSeq("c", [1, 2], 5, [], True, num_draft=1)
    spec, _rows = draft_rows(_step(a, c), {"a", "c"})
    out = ModelRunnerOutput(sampled={"a": 3, "c": 2})
    verify(_logits(4, 11, 13), spec, out)  # a's rows 0-1, then c's row 2
    assert out.bonus == {"a": [4, 11], "c": [13]}


def _plain_decode(rows: torch.Tensor, params: SamplingParams, seed: int) -> tuple[list, bytes]:
    """Each row drawn by its own plain step, one after the other: the tokens, and the
    generator's state after them."""
    st = _state(params, seed=seed)
    tokens = []
    for row in rows:
        (tok,), _ = Sampler()(row.unsqueeze(0).clone(), [st])
        st.output_token_ids.append(tok)
        tokens.append(tok)
    return tokens, bytes(st.generator.get_state().numpy())


def test_sampled_rows_draw_what_plain_steps_draw_and_give_back_the_rest() -> None:
    """A sampled request's check rows are drawn from its generator in order, as plain steps
    would draw them; the numbers of rows past the first rejected draft are given back, so
    the next step draws what a plain step would have."""
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    rows = torch.randn(4, V, generator=torch.Generator().manual_seed(3)) * 2
    for seed in range(20):
        plain, _ = _plain_decode(rows, params, seed)
        for wrong_at in range(1, 4):  # drafts right up to row `wrong_at`, wrong there
            drafts = plain[:wrong_at] + [(plain[wrong_at] + 1) % V] * (3 - wrong_at)
            seq = ScheduledSeq("a", [7, *drafts], 20, [], True, num_draft=3)
            spec, _rows = draft_rows(_step(seq), {"a"})
            st = _state(params, seed=seed)
            out = ModelRunnerOutput()
            (out.sampled["a"],), _ = Sampler()(rows[:1].clone(), [st])  # the runner's draw
            st.output_token_ids.append(out.sampled["a"])
            verify_drafts(rows[1:].clone(), spec, out, {"a": st}, Sampler())
            emitted = [out.sampled["a"], *out.bonus.get("a", [])]
            assert emitted == plain[: wrong_at + 1]
            # The generator stands where plain decoding's stood after as many tokens.
            _, want_state = _plain_decode(rows[: wrong_at + 1], params, seed)
            assert bytes(st.generator.get_state().numpy()) == want_state


def test_a_row_after_a_draft_counts_it_in_the_penalties() -> None:
    """Frequency penalty: the row fed draft 2 must see draft 2 (= the token drawn before it)
    among the output, as a plain step would; its argmax without the penalty would repeat it."""
    a = ScheduledSeq("a", [7, 3, 4], 20, [], True, num_draft=2)
    spec, _rows = draft_rows(_step(a), {"a"})
    logits = _logits(4, 4)
    logits[1, 9] = 4.5  # row fed draft 2 (= 4): 4 at 5.0 beats 9 at 4.5 only unpenalised
    out = ModelRunnerOutput(sampled={"a": 3})
    verify(logits.clone(), spec, out, a=SamplingParams(temperature=0, frequency_penalty=1.0))
    assert out.bonus == {"a": [4, 9]}
    out = ModelRunnerOutput(sampled={"a": 3})
    verify(logits.clone(), spec, out)
    assert out.bonus == {"a": [4, 4]}


def test_logit_bias_and_logprobs_apply_to_every_verified_row() -> None:
    a = ScheduledSeq("a", [7, 3, 4], 20, [], True, num_draft=2)
    spec, _rows = draft_rows(_step(a), {"a"})
    params = SamplingParams(temperature=0, logit_bias={11: 10.0}, logprobs=2)
    out = ModelRunnerOutput(sampled={"a": 3}, logprobs={"a": ["(the sampled token's)"]})
    verify(_logits(4, 8), spec, out, a=params)
    # The bias makes 11 every row's best: the first check row already rejects draft 2 (4).
    assert out.bonus == {"a": [11]}
    entry = out.logprobs["a"][1]
    assert len(out.logprobs["a"]) == 2 and entry.token_id == 11 and entry.rank == 1
    assert [t for t, _ in entry.top] == [11, 4]
