"""Loading a tokenizer from wherever it lives: an HF directory or a GGUF file."""

from __future__ import annotations

from pathlib import Path

from dsinfer.tokenizer.gguf_vocab import from_gguf
from dsinfer.tokenizer.tokenizer import Tokenizer, from_hf_dir


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load from an HF model directory (tokenizer.json + tokenizer_config.json) or a GGUF file."""
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return from_gguf(p)
    if p.is_dir():
        return from_hf_dir(p)
    raise ValueError(f"cannot load a tokenizer from {path}: give an HF directory or a .gguf file")
