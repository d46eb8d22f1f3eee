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
def smol_llm_reference():
    """The same model on the reference backend (eager torch): the oracle of the fused path."""
    from dsinfer import LLM

    return LLM("smollm2", dtype="float32", kv_cache_memory="128MiB", backend="reference")


@pytest.fixture(scope="session")
def hf_smol(smol_path: Path):
    """transformers' LlamaForCausalLM from the same GGUF, fp32 (the reference)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(smol_path.parent), gguf_file=smol_path.name, dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def mtp_dir(tmp_path_factory):
    """transformers writes the 3-layer model; its MTP layer (index 3) is added beside it: the
    decoder weights of a 4-layer twin's last layer plus enorm, hnorm, eh_proj, shared_head."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from tests.helpers import MTP_V3 as V3
    from tests.helpers import write_tiny_tokenizer as _tokenizer_files

    path = tmp_path_factory.mktemp("v3-mtp")
    torch.manual_seed(3)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**V3, num_nextn_predict_layers=1))
    model.save_pretrained(path)
    _tokenizer_files(path)
    torch.manual_seed(5)
    twin = DeepseekV3ForCausalLM(DeepseekV3Config(**{**V3, "num_hidden_layers": 4}))
    twin_dir = tmp_path_factory.mktemp("twin")
    twin.save_pretrained(twin_dir)  # per-expert checkpoint names, as DeepSeek ships them
    g = torch.Generator().manual_seed(6)
    h = V3["hidden_size"]
    saved = load_file(str(twin_dir / "model.safetensors"))
    mtp = {k: v for k, v in saved.items() if k.startswith("model.layers.3.")}
    # Norm weights that are not all ones: a state normed twice differs from one normed once
    # (the chained drafts' reference computation tells which one the chain feeds back).
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.3.{norm}.weight"] = 1.0 + 0.3 * torch.randn(h, generator=g)
    mtp["model.layers.3.eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.05
    # DeepSeek's checkpoints repeat the shared embedding and head under the MTP prefix.
    mtp["model.layers.3.embed_tokens.weight"] = model.model.embed_tokens.weight.detach().clone()
    mtp["model.layers.3.shared_head.head.weight"] = model.lm_head.weight.detach().clone()
    save_file(mtp, str(path / "model-mtp.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    assert cfg.get("num_nextn_predict_layers") == 1
    return path, model.eval(), twin.eval(), mtp
