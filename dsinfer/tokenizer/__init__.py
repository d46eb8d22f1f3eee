"""Tokenizers (HF tokenizer.json or GGUF vocabulary) with their BOS rule and chat template."""

from dsinfer.tokenizer.tokenizer import Tokenizer, load_tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
