"""One request never costs the others their service: a request that fails inside the engine
fails alone (500 with an error id); a fault that is no request's restarts the engine, which
then serves again without a process restart; a restart that cannot succeed leaves 503s."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from dsinfer.config import CacheConfig, EngineConfig
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.async_engine import AsyncEngine
from dsinfer.server.serving import ServedModel
from tests.helpers import tiny_llama_dir
from tests.server.conftest import running_server, wait_healthy

POISON_SEED = 4242


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory) -> EngineConfig:
    src = tiny_llama_dir(tmp_path_factory.mktemp("tiny"), num_layers=1)
    return EngineConfig(model=str(src), cache=CacheConfig(num_blocks=256, block_size=4))


def _served(factory) -> ServedModel:  # noqa: ANN001
    runner = AsyncEngine(factory)
    return ServedModel("tiny", runner, runner.engine.tokenizer, runner.engine.max_model_len)


def _stream_events(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [
            json.loads(line[6:])
            for line in r.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


def _poisoned_engine(config: EngineConfig) -> LLMEngine:
    """A test build whose sampler raises for one marked request (and only for it)."""
    engine = LLMEngine(config)
    runner = engine.executor.runner
    sample = runner.sampler

    def sampler(logits, states):  # noqa: ANN001, ANN202
        if any(st.params.seed == POISON_SEED for st in states):
            raise RuntimeError("injected sampler fault")
        return sample(logits, states)

    runner.sampler = sampler
    return engine


def test_a_failing_request_fails_alone_while_15_streams_complete(tiny_config):
    served = _served(lambda: _poisoned_engine(tiny_config))
    results: dict[int, object] = {}
    body = {"prompt": "w5 w6 w7", "max_tokens": 30, "ignore_eos": True, "stream": True}
    with running_server(build_app({"tiny": served}, ServerSettings())) as url:

        def stream(i: int) -> None:
            results[i] = _stream_events(url, {**body, "seed": i})

        def poisoned() -> None:
            time.sleep(0.05)  # join a batch that is already decoding
            r = httpx.post(
                f"{url}/v1/completions",
                json={"prompt": "w9", "max_tokens": 8, "seed": POISON_SEED},
                timeout=60,
            )
            results[-1] = r

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(15)]
        threads.append(threading.Thread(target=poisoned))
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        bad = results[-1]
        assert bad.status_code == 500, bad.text
        err = bad.json()["error"]
        assert err["code"] == "request_failed" and "injected sampler fault" in err["message"]
        assert "error id err-" in err["message"]
        for i in range(15):
            events = results[i]
            text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
            finish = [e["choices"][0]["finish_reason"] for e in events if e.get("choices")]
            assert finish[-1] == "length" and len(text.split()) == 30, (i, events[-2:])
        health = httpx.get(f"{url}/health").json()
        assert health["status"] == "ok" and health["engines"]["tiny"]["restarts"] == 0
    assert served.engine.engine.pool.num_used == 0
    served.engine.shutdown()


class _FaultAfter:
    """Wraps an engine's step: slow steps, and one fault once a request has streamed tokens."""

    def __init__(self, engine: LLMEngine, after_outputs: int) -> None:
        self.engine, self.left, self.step = engine, after_outputs, engine.step
        engine.step = self  # type: ignore[method-assign]

    def __call__(self):  # noqa: ANN204
        outs = self.step()
        time.sleep(0.02)
        if outs:
            self.left -= 1
            if self.left == 0:
                raise RuntimeError("simulated device failure")
        return outs


def test_an_engine_fault_restarts_the_engine_and_it_serves_again(tiny_config):
    builds = []

    def factory() -> LLMEngine:
        engine = LLMEngine(tiny_config)
        if not builds:
            _FaultAfter(engine, after_outputs=3)
        builds.append(engine)
        return engine

    served = _served(factory)
    with running_server(build_app({"tiny": served}, ServerSettings())) as url:
        events = _stream_events(
            url, {"prompt": "w5 w6", "max_tokens": 40, "ignore_eos": True, "stream": True}
        )
        errors = [e["error"] for e in events if "error" in e]
        assert errors and errors[0]["code"] == "engine_restarted", events[-3:]
        assert "simulated device failure" in errors[0]["message"]
        wait_healthy(url, [], seconds=30)  # the engine came back
        health = httpx.get(f"{url}/health").json()
        assert health["engines"]["tiny"]["restarts"] == 1
        assert "simulated device failure" in health["engines"]["tiny"]["last_fault"]
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        metrics = httpx.get(f"{url}/metrics").text
        assert 'dsinfer:engine_restarts_total{model_name="tiny",version=""} 1.0' in metrics
    assert len(builds) == 2
    served.engine.shutdown()


def test_requests_that_had_no_output_yet_are_queued_again(tiny_config):
    """A fault in a request's first step: it produced nothing, so the new engine runs it."""
    builds = []

    def factory() -> LLMEngine:
        engine = LLMEngine(tiny_config)
        if not builds:
            original = engine.step

            def fail_on_work():  # noqa: ANN202
                if engine.has_unfinished_requests():
                    raise RuntimeError("fault before any output")
                return original()

            engine.step = fail_on_work  # type: ignore[method-assign]
        builds.append(engine)
        return engine

    served = _served(factory)
    with running_server(build_app({"tiny": served}, ServerSettings())) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"][0]["text"].split()) == 4
        assert httpx.get(f"{url}/health").json()["engines"]["tiny"]["restarts"] == 1
    served.engine.shutdown()


def test_an_engine_that_cannot_restart_answers_503(tiny_config):
    builds = []

    def factory() -> LLMEngine:
        if builds:
            raise RuntimeError("the device is gone")
        engine = LLMEngine(tiny_config)
        _FaultAfter(engine, after_outputs=1)
        builds.append(engine)
        return engine

    served = _served(factory)
    with running_server(build_app({"tiny": served}, ServerSettings())) as url:
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 8}, timeout=30)
        assert r.status_code == 503, r.text
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["engines"]["tiny"]["state"] == "dead"
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503
    served.engine.shutdown()


def test_a_step_reaches_every_stream_and_a_closed_loop_stops_nothing(smol_tokenizer):
    """A step's outputs go to each stream in order (one call into each event loop a step);
    outputs for a stream whose event loop has closed (its client is gone) are dropped, and the
    engine serves the other loop's streams on."""
    import asyncio

    from dsinfer.sampling import SamplingParams
    from tests.server.scripted_engine import ScriptedEngine

    runner = AsyncEngine(ScriptedEngine(smol_tokenizer))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    try:
        gone = asyncio.new_event_loop()

        async def orphan() -> None:
            runner.submit([1, 2, 3], params, "orphan")  # never read

        gone.run_until_complete(orphan())
        gone.close()

        async def streams() -> list[list[int]]:
            subs = [runner.submit([1, 2, 3 + i], params, f"s{i}") for i in range(6)]

            async def collect(s) -> list[int]:  # noqa: ANN001
                got = []
                async for out in s:
                    got.extend(out.outputs[0].delta_token_ids)
                return got

            # Bounded: an engine thread that died on the closed loop would leave these waiting.
            return await asyncio.wait_for(asyncio.gather(*(collect(s) for s in subs)), 30)

        tokens = asyncio.run(streams())
        assert [len(t) for t in tokens] == [20] * 6
        assert runner.dead is None
    finally:
        runner.shutdown()
