"""The offline LLM as a vLLM user calls it: sampling_params=, use_tqdm, chat_template."""

from __future__ import annotations

import pytest

from dsinfer import LLM, SamplingParams
from tests.helpers import tiny_llama_dir

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("llm-api"), num_layers=1)


def test_vllm_keywords(tiny):
    llm = LLM(str(tiny), num_blocks=32, block_size=8)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    a = llm.generate(["w5 w6"], params)
    b = llm.generate(["w5 w6"], sampling_params=params, use_tqdm=True)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="not both"):
        llm.generate(["w5"], params, sampling_params=params)


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(tiny):
    llm = LLM(str(tiny), num_blocks=32, block_size=8)
    ids = [5, 9, 33, 7, 12, 40, 41]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    tail = llm.generate([{"prompt_token_ids": ids[-3:]}], params)[0]
    cut = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, truncate_prompt_tokens=3)
    got = llm.generate([{"prompt_token_ids": ids}], cut)[0]
    assert got.prompt_token_ids == ids[-3:]
    assert got.outputs[0].token_ids == tail.outputs[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=0)


def test_a_prediction_as_token_ids(tiny):
    """SamplingParams.prediction takes token ids as well as text (the server encodes the text
    once a request): the output's own ids as the prediction are drafted and all kept; ids
    outside the vocabulary are refused naming the field."""
    llm = LLM(str(tiny), num_blocks=32, block_size=8)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = llm.generate(["w5 w6"], params)[0].outputs[0]
    predicted = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, prediction=list(plain.token_ids)
    )
    got = llm.generate(["w5 w6"], predicted)[0]
    assert got.outputs[0].token_ids == plain.token_ids
    assert got.metrics.num_accepted_draft_tokens == got.metrics.num_draft_tokens > 5
    bad = SamplingParams(max_tokens=4, prediction=[1, 10**6])
    with pytest.raises(ValueError, match="prediction: token ids"):
        llm.generate(["w5"], bad)


def test_chat_template_text_or_file(tiny, tmp_path):
    llm = LLM(str(tiny), num_blocks=32, block_size=8, chat_template=TEMPLATE)
    assert llm.tokenizer.chat_template == TEMPLATE
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    from_file = LLM(str(tiny), num_blocks=32, block_size=8, chat_template=str(path))
    assert from_file.tokenizer.apply_chat_template([{"role": "user", "content": "w7"}]) == (
        "<user>w7"
    )
    with pytest.raises(ValueError, match="no such file"):
        LLM(str(tiny), num_blocks=32, block_size=8, chat_template=str(tmp_path / "nope"))


def test_context_manager_closes(tiny):
    with LLM(str(tiny), num_blocks=16, block_size=8) as llm:
        out = llm.generate("w5", SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2
    llm.close()  # closing twice is harmless


def test_a_pool_smaller_than_one_context_is_said_at_start_up(tiny, caplog):
    """A pool that cannot hold one full-length sequence still serves, but says so at start-up
    with the flag that would fix it; a pool that can says only its size."""
    with caplog.at_level("INFO", logger="dsinfer.engine.llm_engine"):
        LLM(str(tiny), num_blocks=4, block_size=8, max_model_len=64).close()
    warned = [r for r in caplog.records if r.levelname == "WARNING" and "KV pool" in r.getMessage()]
    assert len(warned) == 1
    assert "holds 32 tokens, fewer than the context length 64" in warned[0].getMessage()
    assert "--num-kv-blocks 8" in warned[0].getMessage()
    caplog.clear()
    with caplog.at_level("INFO", logger="dsinfer.engine.llm_engine"):
        LLM(str(tiny), num_blocks=8, block_size=8, max_model_len=64).close()
    assert not [
        r for r in caplog.records if r.levelname == "WARNING" and "KV pool" in r.getMessage()
    ]
    said = [
        r.getMessage()
        for r in caplog.records
        if r.name == "dsinfer.engine.llm_engine" and r.getMessage().startswith("KV pool:")
    ]
    assert said == ["KV pool: 64 tokens = 1.0 sequences at the context length 64"]
