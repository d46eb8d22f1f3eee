"""Tokenizers (HF tokenizer.json or GGUF vocabulary) with their BOS rule and chat template."""

from dsinfer.tokenizer.loading import load_tokenizer
from dsinfer.tokenizer.tokenizer import Tokenizer

__all__ = ["Tokenizer", "load_tokenizer"]
