"""What every family reads the same way from a Hugging Face config.json: sizes, norms, rope.

Each family's model class owns its own parsing (`config_from_hf`), built on these."""

from __future__ import annotations

from typing import Any

from dsinfer.config import ModelConfig, RopeConfig


def common_config(cfg: dict[str, Any], **family: Any) -> ModelConfig:
    """A ModelConfig from the fields every family shares; `family` sets or overrides the rest
    (biases, head_dim, extra)."""
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    fields: dict[str, Any] = dict(
        architecture=cfg["architectures"][0],
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        hidden_act=str(cfg.get("hidden_act", "silu")),
        checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
    )
    return ModelConfig(**{**fields, **family})


def refuse_mlp_bias(cfg: dict[str, Any]) -> None:
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported (no released DeepSeek model uses it)")


def rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
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
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=float(merged.get("mscale") or 0.0),
        mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
    )
