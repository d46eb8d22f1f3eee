"""HF `architectures[0]` → model class (which parses its own config), with a clear error for
the rest."""

from __future__ import annotations

from typing import Any

from torch import nn

from dsinfer.config import ModelConfig
from dsinfer.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    DeepseekV3ForCausalLM,
    DeepseekV32ForCausalLM,
)
from dsinfer.models.llama import LlamaForCausalLM
from dsinfer.models.qwen2 import Qwen2ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_CLASSES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; dsinfer supports "
            f"{', '.join(sorted(MODEL_CLASSES))}. Check config.json's 'architectures' field."
        )
    return MODEL_CLASSES[architecture]


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict: the family's class parses it."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; cannot tell the model family")
    return model_class(archs[0]).config_from_hf(cfg)  # type: ignore[attr-defined]
