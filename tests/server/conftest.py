"""A real uvicorn server on 127.0.0.1, for the real `openai` client and raw HTTP.

Two kinds of engine behind it: the real model (`served`: SmolLM2 fp32; `tiny_smol`: a tiny
random Llama behind SmolLM2's real tokenizer) for end-to-end tests, and a scripted engine
(`scripted`, tests/server/scripted_engine.py) for the protocol tests, which need no model."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn

from dsinfer.config import CacheConfig, EngineConfig, SchedulerConfig
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.async_engine import AsyncEngine
from dsinfer.server.serving import ServedModel

API_KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(app) -> Iterator[str]:  # noqa: ANN001
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="package")
def served() -> Iterator[ServedModel]:
    config = EngineConfig(
        model="smollm2",
        dtype="float32",
        cache=CacheConfig(kv_cache_memory_bytes=128 * 1024**2),
        scheduler=SchedulerConfig(max_num_seqs=8),
    )
    runner = AsyncEngine(lambda: LLMEngine(config))  # built on the engine thread
    engine = runner.engine
    model = ServedModel("smollm2", runner, engine.tokenizer, engine.max_model_len)
    yield model
    model.engine.shutdown()


@pytest.fixture(scope="package")
def base_url(served) -> Iterator[str]:
    app = build_app({"smollm2": served}, ServerSettings(api_key=API_KEY, max_body_bytes=64_000))
    with running_server(app) as url:
        yield url


@pytest.fixture()
def client(base_url):
    import openai

    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def serve_tiny_smol(path, max_positions: int, num_blocks: int, block_size: int) -> ServedModel:  # noqa: ANN001
    """A tiny random Llama behind SmolLM2's real tokenizer and chat template, on its engine
    thread (the caller shuts `.engine` down)."""
    from tests.helpers import tiny_llama_dir

    src = tiny_llama_dir(path, num_layers=1, vocab_size=49152, max_positions=max_positions)
    config = EngineConfig(
        model=str(src),
        tokenizer="smollm2",
        cache=CacheConfig(num_blocks=num_blocks, block_size=block_size),
        scheduler=SchedulerConfig(max_num_seqs=16),
    )
    runner = AsyncEngine(lambda: LLMEngine(config))
    return ServedModel("tiny", runner, runner.engine.tokenizer, runner.engine.max_model_len)


@pytest.fixture(scope="package")
def tiny_smol(tmp_path_factory) -> Iterator[ServedModel]:
    """Every request runs end to end (tokenizer, template, scheduler, sampler) in
    milliseconds."""
    served = serve_tiny_smol(tmp_path_factory.mktemp("tiny-smol"), 256, 128, 8)
    yield served
    served.engine.shutdown()


def wait_idle(served: ServedModel, timeout: float = 10.0) -> None:
    """Wait until the engine has no request and its pool holds no block."""
    eng = served.engine.engine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = eng.stats()
        if (
            not eng.has_unfinished_requests()
            and stats.kv_blocks_used == 0
            and served.engine.num_pending == 0
        ):
            eng.check_integrity()
            return
        time.sleep(0.05)
    stats = eng.stats()
    raise AssertionError(
        f"engine not idle: {stats.kv_blocks_used} blocks used, {stats.running} running, "
        f"{stats.waiting} waiting, {served.engine.num_pending} pending"
    )


@pytest.fixture(scope="package")
def smol_tokenizer():
    from dsinfer.models.loader import resolve_model_path
    from dsinfer.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path("smollm2"))


@pytest.fixture(scope="package")
def scripted(smol_tokenizer) -> Iterator[ServedModel]:
    """The scripted engine (no model) behind SmolLM2's real tokenizer and chat template."""
    from tests.server.scripted_engine import ScriptedEngine

    engine = ScriptedEngine(smol_tokenizer)
    runner = AsyncEngine(engine)
    yield ServedModel("smollm2", runner, smol_tokenizer, engine.max_model_len)
    runner.shutdown()


@pytest.fixture(scope="package")
def scripted_url(scripted) -> Iterator[str]:
    app = build_app({"smollm2": scripted}, ServerSettings(api_key=API_KEY, max_body_bytes=64_000))
    with running_server(app) as url:
        yield url


def wait_healthy(url: str, procs: list, seconds: float = 90) -> None:  # noqa: ANN001
    """Until GET /health answers 200; fail with a process's output if one exits first."""
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        for p in procs:
            assert p.poll() is None, p.stdout.read()
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.3)


def fuzz_settings(examples: int):  # noqa: ANN201 (hypothesis settings)
    """The fuzzers' hypothesis settings: CI runs the same examples every time (derandomized)
    unless DSINFER_FUZZ_RANDOM is set; no deadline, no health checks, no example database."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=examples,
        deadline=None,
        derandomize=os.environ.get("DSINFER_FUZZ_RANDOM") is None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )


def assert_still_serving(url: str, served: ServedModel, key: str) -> None:
    """After fuzzing: a normal request works, the engine is healthy, no KV block is held."""
    import httpx

    r = httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": f"Bearer {key}"},
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    wait_idle(served, timeout=30)
