"""R1 reasoning split: whole text and every way a stream can cut it agree."""

from __future__ import annotations

import pytest

from dsinfer.server.reasoning import ReasoningParser, split_reasoning, supports_reasoning
from dsinfer.tokenizer import load_tokenizer
from tests.helpers import tokenizer_data_dir as _data_dir

OUT = "Let me add: 2 + 2 = 4.\nCheck </ not a tag.\n</think>\n\nThe answer is **4**."


def test_whole_text_split_when_template_opened_reasoning():
    r, c = split_reasoning(OUT, "<｜Assistant｜><think>\n")
    assert r == "Let me add: 2 + 2 = 4.\nCheck </ not a tag.\n"
    assert c == "The answer is **4**."


def test_model_opens_its_own_reasoning_and_plain_output():
    assert split_reasoning("<think>hmm</think>Hi", "<｜Assistant｜>") == ("hmm", "Hi")
    assert split_reasoning("Just an answer.", "<｜Assistant｜>") == (None, "Just an answer.")


@pytest.mark.parametrize("step", [1, 2, 3, 5, 7])
def test_streaming_any_cut_equals_whole(step):
    for prompt_tail, text in (("<think>\n", OUT), ("", "<think>x</think>\ny"), ("", "no tags")):
        p = ReasoningParser(prompt_tail)
        rs, cs = [], []
        pieces = [text[i : i + step] for i in range(0, len(text), step)]
        for i, piece in enumerate(pieces):
            r, c = p.feed(piece, final=i == len(pieces) - 1)
            assert "</think>" not in r + c and "<think>" not in r + c
            rs.append(r)
            cs.append(c)
        want_r, want_c = split_reasoning(text, prompt_tail)
        assert "".join(rs) == (want_r or "") and "".join(cs) == want_c


def test_detects_r1_style_tokenizers():
    assert supports_reasoning(load_tokenizer(_data_dir() / "deepseek-r1"))
    assert not supports_reasoning(load_tokenizer(_data_dir() / "deepseek-v3"))


def test_v3_1_hybrid_thinking_follows_the_template_kwarg():
    """DeepSeek-V3.1's template closes the reasoning in the generation prompt unless
    chat_template_kwargs say thinking: true, which opens it: the split follows the prompt."""
    v31 = load_tokenizer(_data_dir() / "deepseek-v3.1")
    assert supports_reasoning(v31)
    conv = [{"role": "user", "content": "Hi"}]
    plain = v31.apply_chat_template(conv, add_generation_prompt=True)
    thinking = v31.apply_chat_template(conv, add_generation_prompt=True, thinking=True)
    assert plain.endswith("<｜Assistant｜></think>") and thinking.endswith("<｜Assistant｜><think>")
    assert split_reasoning("Hello!", plain[-32:]) == (None, "Hello!")
    assert split_reasoning("sum it</think>\n\nHello!", thinking[-32:]) == ("sum it", "Hello!")


@pytest.fixture(scope="module")
def r1_url(tmp_path_factory):
    """A tiny random Qwen2 that speaks the real R1-Distill-Qwen tokenizer and template."""
    import shutil
    import zipfile

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dsinfer.config import CacheConfig, EngineConfig
    from dsinfer.engine.llm_engine import LLMEngine
    from dsinfer.server.api import ServerSettings, build_app
    from dsinfer.server.async_engine import AsyncEngine
    from dsinfer.server.serving import ServedModel
    from tests.server.conftest import running_server

    path = tmp_path_factory.mktemp("r1tiny")
    src = _data_dir() / "deepseek-r1-distill-qwen-7b"
    with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", path)
    shutil.copy(src / "tokenizer_config.json", path)
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=151680,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    config = EngineConfig(model=str(path), cache=CacheConfig(num_blocks=64))
    runner = AsyncEngine(lambda: LLMEngine(config))
    tok = runner.engine.tokenizer
    served = ServedModel(
        "r1", runner, tok, runner.engine.max_model_len, reasoning=supports_reasoning(tok)
    )
    assert served.reasoning
    with running_server(build_app({"r1": served}, ServerSettings())) as url:
        yield url
    runner.shutdown()


def test_reasoning_content_streamed_equals_whole(r1_url):
    import json

    import httpx

    body = {
        "model": "r1",
        "messages": [{"role": "user", "content": "2+2?"}],
        "temperature": 0,
        "max_tokens": 24,
    }
    whole = httpx.post(f"{r1_url}/v1/chat/completions", json=body, timeout=60).json()
    msg = whole["choices"][0]["message"]
    # The template opened <think>: until the model closes it, everything is reasoning.
    assert isinstance(msg["reasoning_content"], str) and msg["reasoning_content"]
    r, c = [], []
    with httpx.stream(
        "POST", f"{r1_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    r.append(ch["delta"].get("reasoning_content") or "")
                    c.append(ch["delta"].get("content") or "")
    assert "".join(r) == msg["reasoning_content"] and "".join(c) == msg["content"]
