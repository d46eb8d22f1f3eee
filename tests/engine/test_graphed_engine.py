"""The engine with decode steps replayed as graphs that behave as CUDA graphs do (recorded
aten ops replayed on the recorded tensors, none of the step's Python run again:
tests/graph_doubles.py's ReplayingGraph), against the same engine stepping eagerly: staggered
arrivals, chunked prefill with preemption in a tiny pool, prefix-cache hits and seeded
sampling give the same tokens, and every block goes back. On the CPU, on the reference
backend (whose decode a graph can record); a GPU runs the same engine code with real graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsinfer import LLM, SamplingParams
from tests.graph_doubles import ReplayingGraph, record_graphs
from tests.helpers import assert_pool_clean, random_prompts, staggered_generate, tiny_llama_dir

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:  # noqa: ANN001
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny"), num_layers=2, max_positions=256)


def _pair(tiny: Path, monkeypatch: pytest.MonkeyPatch, **options) -> tuple[LLM, LLM]:  # noqa: ANN003
    """The same engine twice: stepping eagerly, and replaying graphs."""
    kw = dict(backend="reference", dtype="float32", block_size=4, **options)
    eager = LLM(str(tiny), **kw)
    record_graphs(monkeypatch, ReplayingGraph, everywhere=True)
    graphed = LLM(str(tiny), **kw)
    assert eager.engine.executor.runner.graphs is None
    assert graphed.engine.executor.runner.graphs is not None
    return eager, graphed


def _replays(llm: LLM) -> int:
    return llm.engine.executor.runner.graphs.replays


def test_staggered_arrivals_replay_what_eager_steps_give(tiny, monkeypatch) -> None:  # noqa: ANN001
    eager, graphed = _pair(tiny, monkeypatch, num_blocks=128)
    prompts = random_prompts((5, 17, 3, 30, 9, 12))
    want = staggered_generate(eager, prompts, GREEDY)
    got = staggered_generate(graphed, prompts, GREEDY)
    assert got == want
    assert _replays(graphed) >= 15  # the steps after the last arrival's prefill
    runner = graphed.engine.executor.runner
    assert len({b for b, _ in runner.graphs.graphs}) >= 3  # batch buckets up and down
    assert_pool_clean(graphed.engine)


def test_chunked_prefill_and_preemption_replay_what_eager_steps_give(tiny, monkeypatch) -> None:  # noqa: ANN001
    """6 requests of up to 30 + 20 tokens in 24 blocks of 4 (~60 needed), prefill chunks of 8:
    requests are preempted and recomputed, and decode-only steps between them replay."""
    eager, graphed = _pair(
        tiny, monkeypatch, num_blocks=24, max_num_batched_tokens=8, enable_prefix_caching=False
    )
    prompts = random_prompts((5, 17, 3, 30, 9, 12), seed=1)
    want = staggered_generate(eager, prompts, GREEDY)
    got = staggered_generate(graphed, prompts, GREEDY)
    assert graphed.engine.scheduler.num_preemptions > 0
    assert eager.engine.scheduler.num_preemptions == graphed.engine.scheduler.num_preemptions
    assert got == want
    assert _replays(graphed) > 0
    assert_pool_clean(graphed.engine)


def test_prefix_cache_hits_replay_what_eager_steps_give(tiny, monkeypatch) -> None:  # noqa: ANN001
    eager, graphed = _pair(tiny, monkeypatch, num_blocks=128, enable_prefix_caching=True)
    shared = random_prompts((24,), seed=2)[0]
    prompts = [shared + tail for tail in random_prompts((3, 7, 5), seed=3)]
    first = graphed.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    second = graphed.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert all(o.metrics.num_cached_tokens >= 20 for o in second)
    want = eager.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    for a, b, c in zip(first, second, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
    assert_pool_clean(graphed.engine)


def test_seeded_sampling_replays_what_eager_steps_give(tiny, monkeypatch) -> None:  # noqa: ANN001
    eager, graphed = _pair(tiny, monkeypatch, num_blocks=128)
    params = SamplingParams(
        temperature=0.9, top_p=0.9, top_k=40, n=2, seed=11, max_tokens=16, ignore_eos=True
    )
    prompts = [{"prompt_token_ids": p} for p in random_prompts((4, 13, 8), seed=4)]
    want = [[c.token_ids for c in o.outputs] for o in eager.generate(prompts, params)]
    got = [[c.token_ids for c in o.outputs] for o in graphed.generate(prompts, params)]
    assert got == want
    assert all(a != b for a, b in got)  # the two samples of a prompt differ (seed, seed + 1)
    assert _replays(graphed) > 0
    assert_pool_clean(graphed.engine)
