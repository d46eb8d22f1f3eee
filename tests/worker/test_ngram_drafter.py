"""Prompt-lookup speculative decoding (worker/ngram_drafter.py): the lookup, the draft length,
and end to end on the real SmolLM2 — the same tokens as plain decoding, fewer steps."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from dsinfer import LLM, SamplingParams
from dsinfer.worker.ngram_drafter import MAX_PAUSE_STEPS, MAX_STEP_ROWS, DraftLength, NgramDrafter
from dsinfer.worker.step_io import ModelRunnerOutput, ScheduledSeq
from tests.helpers import assert_pool_clean, skip_without


def _propose(drafter: NgramDrafter, seqs: list[ScheduledSeq], bonus=None) -> dict:  # noqa: ANN001
    result = ModelRunnerOutput(sampled={s.req_id: 0 for s in seqs}, bonus=bonus or {})
    drafter.propose(SimpleNamespace(seqs=seqs), None, result, {s.req_id for s in seqs})
    return result.drafts


def test_drafts_follow_the_latest_longest_match():
    history = {"a": [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 2, 6, 7]}
    drafter = NgramDrafter(3, history.__getitem__)
    seq = ScheduledSeq("a", [7], 12, [], True)
    # Suffix (6, 7) last occurred at 6-7, followed by 3 4 2; (2, 6, 7) never did.
    assert _propose(drafter, [seq]) == {"a": [3, 4, 2]}
    history["a"] += [4, 2, 6]  # now the 3-gram (4, 2, 6) matches at 9-11: followed by 7 4 2
    assert _propose(drafter, [seq]) == {"a": [7, 4, 2]}
    history["a"] = [1, 2, 3]  # nothing recurs (and a rolled-back history is reindexed)
    assert _propose(drafter, [seq]) == {}


def test_draft_length_follows_what_verification_kept():
    history = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2]}
    drafter = NgramDrafter(4, history.__getitem__)
    assert _propose(drafter, [ScheduledSeq("a", [2], 11, [], True)]) == {"a": [3, 4, 5, 6]}
    # The step verified 4 drafts and kept 1: next time 2.
    checked = ScheduledSeq("a", [3, 4, 5, 6, 7], 12, [], True, num_draft=4)
    history["a"] += [3, 4]  # the sampled token and the accepted draft's follower
    assert _propose(drafter, [checked], {"a": [4]}) == {"a": [5, 6]}
    # Both kept: doubled, up to 4.
    checked = ScheduledSeq("a", [4, 5, 6], 14, [], True, num_draft=2)
    history["a"] += [5, 6, 7]
    assert _propose(drafter, [checked], {"a": [6, 7]}) == {"a": [8, 9, 10, 1]}


def test_drafts_that_keep_missing_pause_for_longer_each_time():
    """Two steps in a row with every draft rejected: no drafts for 1 step, then (missing
    again) 2, then 4, … up to 16; one kept draft ends it."""
    length = DraftLength(4)
    drafted = []
    misses = iter([True] * 6 + [False] + [True] * 2)
    for _ in range(60):
        n = length.next()
        drafted.append(n)
        if n:
            missed = next(misses, False)
            length.verified(n, 0 if missed else min(1, n))
    assert drafted[:2] == [4, 1]  # missed twice: a pause of one step
    gaps = [len(run) for run in "".join("x" if n else "." for n in drafted).split("x") if run]
    assert gaps[:4] == [1, 2, 4, 8], drafted  # each further miss doubles the pause
    # After the kept draft the misses start over: two misses, a pause of one step.
    assert 1 in gaps[5:], drafted
    assert max(gaps) <= MAX_PAUSE_STEPS


def test_no_drafts_once_the_batch_fills_the_step():
    history = {f"r{i}": [1, 2, 3, 1, 2] for i in range(MAX_STEP_ROWS)}
    drafter = NgramDrafter(4, history.__getitem__)
    seqs = [ScheduledSeq(r, [2], 4, [], True) for r in history]
    assert _propose(drafter, seqs[:4]) == {f"r{i}": [3, 1, 2] for i in range(4)}
    assert _propose(drafter, seqs[:8]) == {f"r{i}": [3] for i in range(8)}
    assert _propose(drafter, seqs) == {}


def test_bad_draft_counts_are_refused():
    with pytest.raises(ValueError, match="ngram_speculation"):
        LLM("smollm2", ngram_speculation=-1)


# The long text's opening paragraph (prose written for the tests): SmolLM2 copies it.
LONG_TEXT = (Path(__file__).parents[1] / "data" / "long_text.txt").read_text()
COPY = "Repeat the following text exactly, word for word:\n\n" + LONG_TEXT[:700]


def test_prompt_lookup_keeps_plain_decodings_tokens_in_fewer_steps():
    """SmolLM2 on the default fast path (int4, bf16, the captured decode program) asked to copy
    a paragraph: drafted decode rows run through the same batch-invariant kernels as plain
    decode rows, so the tokens are plain decoding's bit for bit, not only up to near-ties."""
    skip_without("int4_vnni")  # the batch-invariant int4 kernels the captured program runs
    greedy = SamplingParams(temperature=0, max_tokens=48)
    conv = [{"role": "user", "content": COPY}]
    plain = LLM("smollm2", kv_cache_memory="64MiB", enable_prefix_caching=False)
    want = copied = plain.chat(conv, greedy)[0]
    llm = LLM("smollm2", kv_cache_memory="64MiB", enable_prefix_caching=False, ngram_speculation=4)
    assert llm.engine.executor.runner.step_program
    got = llm.chat(conv, greedy)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    m = got.metrics
    assert (
        m.num_draft_tokens > 0 and m.num_accepted_draft_tokens > len(got.outputs[0].token_ids) / 3
    )
    # Sampled, the same: each verified row draws its generator's next number, as a plain step.
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=48, seed=1)
    want = plain.chat(conv, sampled)[0]
    got = llm.chat(conv, sampled)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.metrics.num_accepted_draft_tokens > len(got.outputs[0].token_ids) / 3
    # A stop string inside a run of accepted drafts ends the output where plain decoding does.
    text = copied.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 6]
    stopping = SamplingParams(temperature=0, max_tokens=48, stop=[stop])
    want, got = plain.chat(conv, stopping)[0].outputs[0], llm.chat(conv, stopping)[0].outputs[0]
    assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, "stop")
    assert len(got.token_ids) < 48
    assert_pool_clean(llm.engine)
