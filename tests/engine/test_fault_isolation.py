"""A request that makes a step fail fails alone; the others' tokens are unchanged."""

from __future__ import annotations

import pytest

from dsinfer.config import CacheConfig, EngineConfig
from dsinfer.engine.fault_isolation import execute_isolating
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.sampling import SamplingParams
from dsinfer.worker.step_io import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledSeq,
    SchedulerOutput,
)
from tests.helpers import assert_pool_clean, tiny_llama_dir


def _out(ids: list[str]) -> SchedulerOutput:
    seqs = [ScheduledSeq(r, [1], 0, [0], do_sample=True) for r in ids]
    news = [NewRequestData(r, [1], SamplingParams()) for r in ids]
    return SchedulerOutput(seqs=seqs, new_requests=news, finished_req_ids=["old"])


def test_bisection_finds_every_failing_request_and_keeps_the_others():
    calls: list[list[str]] = []

    def execute(out: SchedulerOutput) -> ModelRunnerOutput:
        ids = [s.req_id for s in out.seqs]
        calls.append(ids)
        assert [n.req_id for n in out.new_requests] == ids  # each part carries its own news
        if {"b", "e"} & set(ids):
            raise RuntimeError("poisoned")
        return ModelRunnerOutput(sampled={r: 7 for r in ids})

    result, failures = execute_isolating(execute, _out(list("abcdef")), lambda e: False)
    assert sorted(failures) == ["b", "e"]
    assert all(f.message == "RuntimeError: poisoned" for f in failures.values())
    assert failures["b"].error_id != failures["e"].error_id
    assert result.sampled == {"a": 7, "c": 7, "d": 7, "f": 7}
    assert len(calls) < 12  # bisection, not one retry per request and level


def test_engine_faults_are_not_bisected():
    def execute(out: SchedulerOutput) -> ModelRunnerOutput:
        raise MemoryError("out of memory")

    with pytest.raises(MemoryError):
        execute_isolating(execute, _out(["a", "b"]), lambda e: isinstance(e, MemoryError))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    src = tiny_llama_dir(tmp_path_factory.mktemp("tiny"), num_layers=1)
    return LLMEngine(EngineConfig(model=str(src), cache=CacheConfig(num_blocks=64, block_size=4)))


def _run(engine: LLMEngine, params: dict[str, SamplingParams]) -> dict:
    for rid, p in params.items():
        engine.add_request([1, 5, 6, 7], p, request_id=rid)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def test_a_request_the_runner_cannot_take_fails_alone(engine):
    """Containment independent of edge validation: a seed past torch's range (set after
    SamplingParams checked it) used to kill the engine thread."""
    greedy = {
        f"ok{i}": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True) for i in range(3)
    }
    alone = _run(engine, greedy)
    bad = SamplingParams(max_tokens=6, temperature=0.8, seed=1)
    bad.seed = 2**64  # what the API let through before it checked seeds
    mixed = _run(
        engine, {**{k: SamplingParams(**_fields(v)) for k, v in greedy.items()}, "bad": bad}
    )
    assert mixed["bad"].outputs[0].finish_reason == "error"
    assert "Overflow" in mixed["bad"].error.message or "overflow" in mixed["bad"].error.message
    for rid in greedy:
        assert mixed[rid].outputs[0].token_ids == alone[rid].outputs[0].token_ids
        assert mixed[rid].outputs[0].finish_reason == "length"
    assert_pool_clean(engine)
    # The engine serves on.
    again = _run(engine, {"after": SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)})
    assert again["after"].outputs[0].token_ids == alone["ok0"].outputs[0].token_ids
    assert_pool_clean(engine)


def test_a_failure_after_tokens_were_sampled_is_rolled_back(engine, monkeypatch):
    """A step that fails after the sampler ran is retried without counting a token twice."""
    runner = engine.executor.runner
    original = runner._prompt_logprobs
    failed = []

    def flaky(inp, hidden, result):  # noqa: ANN001, ANN202
        if any(s.req_id == "bad" for s in inp.seqs) and len(inp.seqs) > 1:
            failed.append(1)
            raise RuntimeError("late failure")
        return original(inp, hidden, result)

    monkeypatch.setattr(runner, "_prompt_logprobs", flaky)
    params = {
        "pen": SamplingParams(max_tokens=5, temperature=0, repetition_penalty=1.3, ignore_eos=True)
    }
    alone = _run(engine, params)
    mixed = _run(
        engine,
        {
            "pen": SamplingParams(**_fields(params["pen"])),
            "bad": SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
        },
    )
    assert failed, "the injected failure never fired"
    # "bad" passes alone (the fault needs company), so both finish; penalties saw no double token.
    assert mixed["pen"].outputs[0].token_ids == alone["pen"].outputs[0].token_ids
    assert runner.states == {} or all(len(s.output_token_ids) <= 5 for s in runner.states.values())
    assert_pool_clean(engine)


def _fields(p: SamplingParams) -> dict:
    return {name: getattr(p, name) for name in SamplingParams.__slots__}
