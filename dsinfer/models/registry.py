"""HF `architectures[0]` → model class and config parser, with a clear error for the rest."""

from __future__ import annotations

from typing import Any

from torch import nn

from dsinfer.config import ModelConfig, RopeConfig
from dsinfer.models.llama import LlamaForCausalLM
from dsinfer.models.qwen2 import Qwen2ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_CLASSES:
        raise ValueError(
            f"unsupported architecture {architecture!r}; dsinfer supports "
            f"{', '.join(sorted(MODEL_CLASSES))}. Check config.json's 'architectures' field."
        )
    return MODEL_CLASSES[architecture]


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); older files use
    # top-level rope_theta plus an optional rope_scaling dict.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = merged.get("rope_type", merged.get("type", "default")) or "default"
    return RopeConfig(
        theta=theta,
        kind=str(kind),
        factor=float(merged.get("factor", 1.0) or 1.0),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position=int(merged.get("original_max_position_embeddings", 8192)),
    )


def config_from_hf(cfg: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json dict."""
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry; cannot tell the model family")
    arch = archs[0]
    model_class(arch)
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported (no released DeepSeek model uses it)")
    if cfg.get("use_sliding_window"):
        raise ValueError(
            "Qwen2 sliding-window attention is not supported; set use_sliding_window "
            "false or use a model without it"
        )
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    is_qwen2 = arch == "Qwen2ForCausalLM"
    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else bias,
        o_bias=False if is_qwen2 else bias,
        hidden_act=str(cfg.get("hidden_act", "silu")),
        checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )
