"""Shared fixtures: the real SmolLM2 (ours and the transformers reference), tiny random models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dsinfer.models.loader import resolve_model_path

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Water boils at",
    "List three colours: red,",
    "Question: What is 12 times 12?\nAnswer:",
    "The quick brown fox",
    "In machine learning, a transformer is a model that uses attention to weigh the importance "
    "of different parts of the input. It was introduced in",
]


@pytest.fixture(scope="session")
def smol_path() -> Path:
    return resolve_model_path("smollm2")


@pytest.fixture(scope="session")
def smol_llm():
    from dsinfer import LLM

    return LLM("smollm2", dtype="float32", kv_cache_memory="256MiB")


@pytest.fixture(scope="session")
def hf_smol(smol_path: Path):
    """transformers' LlamaForCausalLM from the same GGUF, fp32 (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smol_path.parent), gguf_file=smol_path.name, dtype=torch.float32
    )
    model.eval()
    return model
