"""Build a `tokenizers` BPE tokenizer from a GGUF file's embedded vocabulary."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from dsinfer.models.gguf_file import field_value
from dsinfer.models.gguf_reader import GGUFFile
from dsinfer.tokenizer.tokenizer import Tokenizer

_CONTROL, _USER_DEFINED = 3, 4
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's `tokenizer.ggml.pre` names → the equivalent pre-tokenizer pipeline."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre == "smollm":  # digits split one by one, then GPT-2's regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated")
        return pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    raise ValueError(
        f"GGUF pre-tokenizer {pre!r} is not supported yet; use the model's Hugging "
        "Face directory (tokenizer.json) instead"
    )


def from_gguf(path: Path) -> Tokenizer:
    # A parse of its own, not open_gguf's cached one: the cache would keep the parsed vocabulary
    # and merges (~12 MiB of Python strings for SmolLM2) resident for the life of the server,
    # and the model's load has dropped the cache by now anyway (re-parsing costs ~0.1 s).
    reader = GGUFFile(path)
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, "
            "'gpt2'); use the model's Hugging Face directory instead"
        )
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens")
    types: list[int] = field_value(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges", [])]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = _pre_tokenizer(field_value(reader, "tokenizer.ggml.pre", "default"))
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty == _USER_DEFINED
        ]
    )
    bos = field_value(reader, "tokenizer.ggml.bos_token_id")
    eos = field_value(reader, "tokenizer.ggml.eos_token_id")
    specials = {}
    if bos is not None:
        specials["bos_token"] = tokens[int(bos)]
    if eos is not None:
        specials["eos_token"] = tokens[int(eos)]
    return Tokenizer(
        backend=backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        add_bos=bool(field_value(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=field_value(reader, "tokenizer.chat_template"),
        special_tokens=specials,
    )
