"""MTP through the real server: usage reports verified drafts, /metrics the acceptance."""

from __future__ import annotations

import httpx

from dsinfer.config import CacheConfig, EngineConfig
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.server.api import ServerSettings, build_app
from dsinfer.server.async_engine import AsyncEngine
from dsinfer.server.serving import ServedModel
from tests.server.conftest import running_server


def test_usage_and_metrics_report_drafts(mtp_dir):
    import openai

    config = EngineConfig(
        model=str(mtp_dir[0]), dtype="float32", cache=CacheConfig(block_size=4, num_blocks=64)
    )
    runner = AsyncEngine(lambda: LLMEngine(config))
    served = ServedModel("tiny", runner, runner.engine.tokenizer, runner.engine.max_model_len)
    try:
        with running_server(build_app({"tiny": served}, ServerSettings())) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            r = client.completions.create(
                model="tiny", prompt="w5 w9 w33", max_tokens=8, temperature=0
            )
            details = r.usage.completion_tokens_details
            drafted = details.accepted_prediction_tokens + details.rejected_prediction_tokens
            # Steps 2..7 verify a draft; the 8th has room for one token only, so drafts none.
            assert r.usage.completion_tokens == 8 and drafted == 6
            text = httpx.get(f"{url}/metrics").text
            assert (
                'dsinfer:spec_decode_num_draft_tokens_total{model_name="tiny",version=""} 6' in text
            )
            assert 'dsinfer:spec_decode_num_accepted_tokens_total{model_name="tiny"' in text
            sampled = client.completions.create(
                model="tiny", prompt="w5", max_tokens=4, temperature=0.9, seed=3
            )
            details = sampled.usage.completion_tokens_details  # sampled requests draft too
            drafted = details.accepted_prediction_tokens + details.rejected_prediction_tokens
            assert sampled.usage.completion_tokens == 4 and drafted == 2
            one = client.completions.create(model="tiny", prompt="w5", max_tokens=1)
            assert one.usage.completion_tokens_details is None  # nothing was drafted
    finally:
        runner.shutdown()
