"""An engine thread that dies: waiting clients get 503 (no hang), /health turns 503."""

from __future__ import annotations

import httpx
import pytest

from dsinfer.config import CacheConfig, EngineConfig
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.async_engine import AsyncEngine
from dsinfer.server.serving import ServedModel
from tests.helpers import tiny_llama_dir
from tests.server.conftest import running_server


@pytest.fixture()
def tiny_dir(tmp_path):
    return tiny_llama_dir(tmp_path, num_layers=1)


def test_dead_engine_gives_503_and_unhealthy(tiny_dir):
    config = EngineConfig(model=str(tiny_dir), cache=CacheConfig(num_blocks=32, block_size=4))
    runner = AsyncEngine(lambda: LLMEngine(config))
    served = ServedModel("tiny", runner, runner.engine.tokenizer, runner.engine.max_model_len)

    def broken_step():  # noqa: ANN202
        raise RuntimeError("simulated device failure")

    with running_server(build_app({"tiny": served}, ServerSettings())) as url:
        assert httpx.get(f"{url}/health").status_code == 200
        runner.engine.step = broken_step  # type: ignore[method-assign]
        r = httpx.post(
            f"{url}/v1/completions", json={"prompt": "w5 w6", "max_tokens": 4}, timeout=30
        )
        assert r.status_code == 503
        assert "simulated device failure" in r.json()["error"]["message"]
        assert httpx.get(f"{url}/health").status_code == 503
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503
    runner.shutdown()
