"""The real DeepSeek tokenizers as GGUF files carry them (a vocabulary, merges and the name of
a pre-tokenizer): the tokenizer dsinfer builds from the file gives transformers' ids on the
original tokenizer.json, and the file's chat template renders as the original's."""

from __future__ import annotations

import json
import shutil
import zipfile

import pytest

from dsinfer.tokenizer import load_tokenizer
from dsinfer.tokenizer.gguf_vocab import from_gguf
from tests.gguf_writer import write_vocab_only
from tests.helpers import TOKENIZER_CORPUS as CORPUS
from tests.helpers import tokenizer_data_dir

# Tokenizer → the pre-tokenizer name in its GGUF files. deepseek-r1 and the distills are named
# as llama.cpp's converter (llama-cpp-python 0.3.36) names these very files (joyai-llm,
# smaug-bpe, qwen2); the others as released GGUFs of those models name them.
PRE = {
    "deepseek-llm-7b-base": "deepseek-llm",
    "deepseek-v2": "deepseek-llm",
    "deepseek-v3": "deepseek-v3",
    "deepseek-r1": "joyai-llm",
    "deepseek-r1-distill-qwen-7b": "deepseek-r1-qwen",
    "deepseek-r1-distill-llama-8b": "smaug-bpe",
    "deepseek-r1-0528-qwen3-8b": "qwen2",
}
EXTRA = [
    "Ünïcödé NFC: e\u0301 vs \u00e9; Ελληνικά, кириллица, العربية.",
    "numbers 1234567 and 3.14, 12345678901234567890!!",
    "<think>\nreasoning</think>\n\nanswer",
    # Words Llama 3's vocabulary holds whole but its merges would not build (ignore_merges):
    "Tiếng Việt: việc hợp nhiều điều; česky jeho",
]


@pytest.fixture(scope="module", params=sorted(PRE))
def pair(request, tmp_path_factory):
    """(name, ours from the GGUF, transformers on tokenizer.json, the directory)."""
    from transformers import PreTrainedTokenizerFast

    name = request.param
    src, out = tokenizer_data_dir() / name, tmp_path_factory.mktemp(name)
    with zipfile.ZipFile(src / "tokenizer.json.zip") as zf:
        zf.extract("tokenizer.json", out)
    shutil.copy(src / "tokenizer_config.json", out)
    path = write_vocab_only(out, PRE[name], out / "vocab.gguf")
    ref = PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"))
    return name, from_gguf(path), ref, out


def test_ids_and_text_equal_transformers(pair):
    _, ours, ref, _ = pair
    for text in [*CORPUS, *EXTRA]:
        ids = ref.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text


def test_special_tokens_and_chat_template_come_with_the_file(pair):
    name, ours, _, out = pair
    hf_dir = load_tokenizer(out)  # the same files as a Hugging Face directory
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (ours.bos_token_id, ours.eos_token_id) == (hf_dir.bos_token_id, hf_dir.eos_token_id)
    if config.get("chat_template") is None:
        return
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    want = hf_dir.apply_chat_template(messages, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == want, name


def test_an_unknown_pre_tokenizer_names_the_supported_ones(tmp_path):
    from dsinfer.tokenizer.gguf_vocab import _pre_tokenization

    with pytest.raises(ValueError, match="'chatglm-bpe' is not supported .*deepseek-v3"):
        _pre_tokenization("chatglm-bpe")
