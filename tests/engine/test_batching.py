"""Continuous batching on the real SmolLM2: batched, chunked, prefix-cached and preempted runs
all give the tokens of running each prompt alone."""

from __future__ import annotations

import pytest

from dsinfer import LLM, SamplingParams
from tests.conftest import PROMPTS
from tests.helpers import agree_or_near_tie, assert_pool_clean, staggered_generate

N_NEW = 16  # enough steps for arrivals, chunks and preemptions to interleave
BATCH = PROMPTS[:6]  # six requests of different lengths joining at different steps
GREEDY = SamplingParams(temperature=0, max_tokens=N_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(smol_llm) -> list[list[int]]:
    """Each prompt run by itself: the reference for every batched variant."""
    return [smol_llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in BATCH]


def _check(llm: LLM, got: list[list[int]], alone: list[list[int]]) -> None:
    for i, p in enumerate(BATCH):
        prompt_ids = llm.tokenizer.encode(p)
        assert len(got[i]) == N_NEW
        assert agree_or_near_tie(llm.engine, prompt_ids, alone[i], got[i]), (p, alone[i], got[i])
    assert_pool_clean(llm.engine)


def test_staggered_arrivals_match_unbatched(smol_llm, alone):
    _check(smol_llm, staggered_generate(smol_llm, BATCH, GREEDY), alone)


def test_chunked_prefill_and_tiny_pool_preemption_match_unbatched(alone):
    # 6 prompts × (≤40 prompt + 16 new) tokens need ~20 blocks of 16; give 8 and chunk by 8.
    llm = LLM(
        "smollm2",
        dtype="float32",
        num_blocks=8,
        block_size=16,
        max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )
    got = staggered_generate(llm, BATCH, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    _check(llm, got, alone)


def test_prefix_cache_hits_give_same_tokens(smol_llm, alone):
    shared = "You are a careful assistant. Answer briefly and precisely. " * 4
    prompts = [shared + p for p in PROMPTS[:3]]
    first = smol_llm.generate(prompts, GREEDY)
    second = smol_llm.generate(prompts, GREEDY)
    assert all(o.metrics.num_cached_tokens >= 32 for o in second)
    for p, a, b in zip(prompts, first, second, strict=True):
        ids = smol_llm.tokenizer.encode(p)
        assert agree_or_near_tie(
            smol_llm.engine, ids, a.outputs[0].token_ids, b.outputs[0].token_ids
        )
    # The cached prefix is worth the same as recomputing it: compare with the uncached run.
    smol_llm.engine.pool.reset_prefix_cache()
    third = smol_llm.generate(prompts, GREEDY)
    assert all(o.metrics.num_cached_tokens == 0 for o in third)
    for p, b, c in zip(prompts, second, third, strict=True):
        ids = smol_llm.tokenizer.encode(p)
        assert agree_or_near_tie(
            smol_llm.engine, ids, c.outputs[0].token_ids, b.outputs[0].token_ids
        )
    assert_pool_clean(smol_llm.engine)


def test_seeded_sampling_same_alone_and_in_batch(smol_llm):
    p = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=1234, ignore_eos=True)
    alone = smol_llm.generate(PROMPTS[0], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    batch = smol_llm.generate(PROMPTS[:4], [p, others, others, others])
    assert batch[0].outputs[0].token_ids == alone
    other_seed = SamplingParams(
        temperature=0.8, top_p=0.95, max_tokens=12, seed=99, ignore_eos=True
    )
    assert smol_llm.generate(PROMPTS[0], other_seed)[0].outputs[0].token_ids != alone
    assert_pool_clean(smol_llm.engine)


def test_n_samples_and_stop_strings_end_to_end(smol_llm):
    out = smol_llm.generate(
        "Count: one, two, three,", SamplingParams(temperature=0.7, n=3, seed=5, max_tokens=12)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    greedy = smol_llm.generate(
        "Count: one, two, three,", SamplingParams(temperature=0, max_tokens=12)
    )[0].outputs[0]
    stop = greedy.text[4:7]
    stopped = smol_llm.generate(
        "Count: one, two, three,", SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    )[0]
    c = stopped.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == greedy.text[: greedy.text.find(stop)]
    assert_pool_clean(smol_llm.engine)
