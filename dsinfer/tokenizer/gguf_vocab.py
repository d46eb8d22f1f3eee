"""Build a `tokenizers` BPE tokenizer from a GGUF file's embedded vocabulary."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from dsinfer.models.gguf_file import field_value
from dsinfer.models.gguf_reader import GGUFFile
from dsinfer.tokenizer.tokenizer import Tokenizer

_CONTROL, _USER_DEFINED = 3, 4
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3's split (DeepSeek-R1-Distill-Llama): numbers in runs of up to three digits.
_LLAMA3_SPLIT = _QWEN2_SPLIT.replace(r"\p{N}|", r"\p{N}{1,3}|")
# The splits of DeepSeek's own tokenizers, in their tokenizer.json's order (each "isolated"):
# deepseek-llm (DeepSeek-LLM, V2, V2.5: then digits one by one) and deepseek-v3 (V3, R1).
_DEEPSEEK_LLM_SPLITS = (
    "[\r\n]",
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
)
_DEEPSEEK_V3_SPLITS = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)


@dataclass(frozen=True, slots=True)
class _PreTokenization:
    """What a `tokenizer.ggml.pre` name stands for in the Hugging Face tokenizer the file was
    converted from: its normaliser, its pre-tokenizer, and whether words already in the
    vocabulary skip the merges (Llama 3's `ignore_merges`)."""

    splits: tuple[str, ...] = ()
    individual_digits: bool = False
    gpt2_regex: bool = False  # ByteLevel's own GPT-2 split (after the splits above, if any)
    nfc: bool = False
    ignore_merges: bool = False

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        steps: list[pre_tokenizers.PreTokenizer] = [
            pre_tokenizers.Split(Regex(r), behavior="isolated") for r in self.splits
        ]
        if self.individual_digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=self.gpt2_regex))
        return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


_GPT2 = _PreTokenization(gpt2_regex=True)
_QWEN2 = _PreTokenization(splits=(_QWEN2_SPLIT,), nfc=True)
_LLAMA3 = _PreTokenization(splits=(_LLAMA3_SPLIT,), ignore_merges=True)
_DEEPSEEK_V3 = _PreTokenization(splits=_DEEPSEEK_V3_SPLITS)
# llama.cpp's names (its converter picks one by hashing the tokenizer's output on a probe text).
_PRE_TOKENIZATIONS = {
    "default": _GPT2,
    "gpt2": _GPT2,
    "gpt-2": _GPT2,
    "smollm": _PreTokenization(individual_digits=True, gpt2_regex=True),
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,  # R1-Distill-Qwen: Qwen2.5's tokenizer
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,  # R1-Distill-Llama: Llama 3's tokenizer ...
    "smaug-bpe": _LLAMA3,  # ... as llama.cpp's converter now names it (same split)
    "deepseek-llm": _PreTokenization(splits=_DEEPSEEK_LLM_SPLITS, individual_digits=True),
    "deepseek-v3": _DEEPSEEK_V3,
    # V3 / R1 / V3.1 as llama.cpp's converter names them now: its probe text cannot tell
    # DeepSeek-V3's tokenizer from JoyAI's, and it lists joyai-llm first (same split).
    "joyai-llm": _DEEPSEEK_V3,
}


def _pre_tokenization(pre: str) -> _PreTokenization:
    if pre not in _PRE_TOKENIZATIONS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported (dsinfer reads "
            f"{', '.join(sorted(_PRE_TOKENIZATIONS))}); use the model's Hugging Face directory "
            "(tokenizer.json) instead"
        )
    return _PRE_TOKENIZATIONS[pre]


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
    pre = _pre_tokenization(field_value(reader, "tokenizer.ggml.pre", "default"))
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
    backend = HFTokenizer(bpe)
    if pre.nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre.pre_tokenizer()
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
