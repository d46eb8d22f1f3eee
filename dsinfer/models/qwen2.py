"""Qwen2 (R1-Distill-Qwen): the Llama graph with biases on q, k and v but not on o."""

from __future__ import annotations

from typing import Any

from dsinfer.config import ModelConfig
from dsinfer.models.hf_config import common_config, refuse_mlp_bias
from dsinfer.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Llama's graph; only the config differs (q, k, v carry a bias, o does not)."""

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        refuse_mlp_bias(cfg)
        if cfg.get("use_sliding_window"):
            raise ValueError(
                "Qwen2 sliding-window attention is not supported; set use_sliding_window "
                "false or use a model without it"
            )
        return common_config(cfg, qkv_bias=True, o_bias=False)
