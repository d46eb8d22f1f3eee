"""Predicted outputs (SamplingParams.prediction, OpenAI's `prediction`): the drafter follows
the output along the prediction, finds it again after an edit, and the output stays what it
would be without a prediction."""

from __future__ import annotations

from dsinfer import LLM, SamplingParams
from dsinfer.worker.prediction_drafter import PredictionCursor
from tests.helpers import assert_pool_clean, skip_without

PREDICTION = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]


def _cursor_after(output: list[int], *, in_steps: int = 1) -> PredictionCursor:
    cursor = PredictionCursor(PREDICTION)
    step = max(1, len(output) // in_steps)
    for end in range(step, len(output) + step, step):
        cursor.follow(output[: min(end, len(output))])
    return cursor


def test_an_output_that_follows_the_prediction_drafts_what_comes_next():
    assert PredictionCursor(PREDICTION).draft(3) == [10, 11, 12]  # before any output
    assert _cursor_after([10, 11, 12]).draft(4) == [13, 14, 15, 16]
    assert _cursor_after([10, 11, 12, 13, 14], in_steps=5).draft(2) == [15, 16]
    assert _cursor_after(PREDICTION).draft(4) == []  # the prediction is used up


def test_an_edit_parts_the_output_from_the_prediction_until_they_meet_again():
    # Replaced 12-13 by 90, 91: no output suffix occurs in the prediction, so no draft.
    assert _cursor_after([10, 11, 90, 91]).draft(3) == []
    # The output rejoins with 14, 15: the tokens after them are drafted again.
    assert _cursor_after([10, 11, 90, 91, 14, 15]).draft(3) == [16, 17, 18]
    # An inserted token, then the prediction's own text (11, 12) resumes.
    assert _cursor_after([10, 77, 11, 12]).draft(2) == [13, 14]


def test_a_repeated_ngram_rejoins_at_or_after_where_the_two_parted():
    prediction = [1, 2, 3, 50, 1, 2, 3, 60, 1, 2, 3, 70]
    cursor = PredictionCursor(prediction)
    cursor.follow([1, 2, 3, 50, 1, 2, 9])  # parted at position 6 (expected 3, got 9)
    assert cursor.draft(2) == []
    # A rollback to fewer tokens starts over: parted at 2, then 1 2 3, which occurs three
    # times; the first occurrence that starts at or after 2 is the one at 4.
    cursor.follow([1, 2, 9, 1, 2, 3])
    assert cursor.draft(1) == [60]
    cursor = PredictionCursor(prediction)
    cursor.follow([1, 2, 3, 50, 1, 2, 9, 1, 2, 3])  # parted at 6: the occurrence at 8
    assert cursor.draft(2) == [70]
    cursor.follow([1, 2, 3, 50, 1, 2, 9, 1, 2, 3, 70, 5, 1, 2, 3])  # past the end: the last
    assert cursor.draft(2) == [70]


CODE = """def total(items):
    result = 0
    for item in items:
        result += item.price * item.quantity
    return result
"""
EDIT = (
    "Rename the function total to order_total and change nothing else. "
    "Reply with the code only.\n\n" + CODE
)


def test_a_predicted_output_gives_the_same_tokens_in_fewer_steps():
    """SmolLM2 on the default fast path asked to edit a function, with the old function as
    the prediction: the output is the plain one token for token, greedy and sampled, and most
    of the prediction is accepted; a wrong prediction costs drafts, not tokens."""
    skip_without("int4_vnni")  # the batch-invariant kernels: drafted rows = plain rows, bit for bit
    llm = LLM("smollm2", kv_cache_memory="64MiB", enable_prefix_caching=False)
    conv = [{"role": "user", "content": EDIT}]
    for params in (
        SamplingParams(temperature=0, max_tokens=64),
        SamplingParams(temperature=0.7, top_p=0.95, seed=4, max_tokens=64),
    ):
        plain = llm.chat(conv, params)[0]
        text = plain.outputs[0].text
        for prediction, well in ((text, True), (CODE, None), ("nothing like it " * 8, False)):
            asked = SamplingParams(**{**_fields(params), "prediction": prediction})
            got = llm.chat(conv, asked)[0]
            assert got.outputs[0].token_ids == plain.outputs[0].token_ids, prediction
            m = got.metrics
            if well:  # the output itself as the prediction: nearly every draft is kept
                assert m.num_accepted_draft_tokens >= 0.8 * len(got.outputs[0].token_ids)
                assert m.num_accepted_draft_tokens >= 0.9 * m.num_draft_tokens
            elif well is False:
                assert m.num_accepted_draft_tokens <= 2
        assert plain.metrics.num_draft_tokens == 0  # no prediction, no drafter: no drafts
    assert_pool_clean(llm.engine)


def _fields(params: SamplingParams) -> dict:
    return {f: getattr(params, f) for f in params.__dataclass_fields__}
