"""HF `architectures[0]` → model class and config parser, with a clear error for the rest."""

from __future__ import annotations

from typing import Any

from torch import nn

from dsinfer.config import ModelConfig, RopeConfig
from dsinfer.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from dsinfer.models.llama import LlamaForCausalLM
from dsinfer.models.qwen2 import Qwen2ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
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
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=float(merged.get("mscale") or 0.0),
        mscale_all_dim=float(merged.get("mscale_all_dim") or 0.0),
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
    extra = _deepseek_extra(cfg) if arch.startswith("Deepseek") else {}
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
        # DeepSeek: transformers writes head_dim = the rope part; the real q/k head is nope + rope.
        head_dim=extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"]
        if extra
        else int(cfg.get("head_dim") or hidden // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=True if is_qwen2 else bias,
        o_bias=False if is_qwen2 else bias,
        hidden_act=str(cfg.get("hidden_act", "silu")),
        checkpoint_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        extra=extra,
    )


def _deepseek_extra(cfg: dict[str, Any]) -> dict[str, Any]:
    """MLA and MoE hyper-parameters of DeepSeek-V2/V3 configs."""
    v3 = cfg["architectures"][0] == "DeepseekV3ForCausalLM"
    scoring = cfg.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    topk_method = cfg.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    grouped = topk_method in ("group_limited_greedy", "noaux_tc")
    return {
        "q_lora_rank": cfg.get("q_lora_rank"),
        "kv_lora_rank": int(cfg["kv_lora_rank"]),
        "qk_nope_head_dim": int(cfg["qk_nope_head_dim"]),
        "qk_rope_head_dim": int(cfg["qk_rope_head_dim"]),
        "v_head_dim": int(cfg["v_head_dim"]),
        "n_routed_experts": int(cfg.get("n_routed_experts") or 0),
        "n_shared_experts": int(cfg.get("n_shared_experts") or 0),
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok") or 1),
        "moe_intermediate_size": int(cfg.get("moe_intermediate_size") or 0),
        "first_k_dense_replace": int(cfg.get("first_k_dense_replace") or 0),
        "moe_layer_freq": int(cfg.get("moe_layer_freq") or 1),
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor") or 1.0),
        "scoring_func": scoring,
        "n_group": int(cfg.get("n_group") or 1) if grouped else 1,
        "topk_group": int(cfg.get("topk_group") or 1) if grouped else 1,
        # transformers' V2 router never renormalises; V3 follows the config.
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)) and v3,
        "score_correction_bias": topk_method == "noaux_tc",
        "num_nextn_predict_layers": int(cfg.get("num_nextn_predict_layers") or 0),
    }
