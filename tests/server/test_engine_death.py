"""An engine thread that dies: waiting clients get 503 (no hang), /health turns 503."""

from __future__ import annotations

import httpx
import pytest

from dsinfer.config import CacheConfig, EngineConfig
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.async_engine import AsyncEngine
from dsinfer.server.serving import ServedModel
from tests.server.conftest import running_server


@pytest.fixture()
def tiny_dir(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.models.test_tiny_parity import _tokenizer_files

    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    _tokenizer_files(tmp_path)
    return tmp_path


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
