"""What the cost model needs of a model, counted from the real graph built on the meta device
(no memory): parameters by kind, active parameters per token, KV bytes per token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsinfer.config import ModelConfig

WEIGHT_BYTES = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "float16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
}


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    vocab: int
    dense_params: int  # everything but routed experts (embeddings included)
    expert_params: int  # all routed experts, all layers
    num_experts: int
    experts_per_token: int
    moe_layers: int
    embedding_params: int  # looked up, not multiplied
    head_params: int  # the LM head's matrix (the embedding's when tied)
    body_params: int  # decoder layers and final norm, routed experts excepted
    kv_bytes_per_token: int  # at 2 bytes per element, all layers
    latent_kv: bool  # MLA: one latent per token, replicated across tensor-parallel ranks

    @property
    def expert_params_per_layer_expert(self) -> int:
        return self.expert_params // max(1, self.moe_layers * self.num_experts)

    def active_params(self) -> float:
        """Parameters one token multiplies with (routed experts: top-k of them)."""
        share = self.experts_per_token / self.num_experts if self.num_experts else 0.0
        return self.dense_params - self.embedding_params + self.expert_params * share


def model_shape(cfg: ModelConfig, name: str = "model") -> ModelShape:
    from dsinfer.models.loader import build_model

    net = build_model(cfg, torch.bfloat16, "meta")
    dense = expert = embed = 0
    head = net.lm_head.weight.numel()
    tied = net.lm_head.weight is net.model.embed_tokens.weight
    moe_layers = 0
    for pname, p in net.named_parameters():
        if ".experts.w" in pname:
            expert += p.numel()
            moe_layers += pname.endswith("w13")
        else:
            dense += p.numel()
            if pname.endswith("embed_tokens.weight"):
                embed += p.numel()
    moe = cfg.moe
    return ModelShape(
        name=name,
        num_layers=cfg.num_layers,
        hidden=cfg.hidden_size,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        vocab=cfg.vocab_size,
        dense_params=dense,
        expert_params=expert,
        num_experts=moe.n_routed_experts if moe else 0,
        experts_per_token=moe.num_experts_per_tok if moe else 0,
        moe_layers=moe_layers,
        embedding_params=embed,
        head_params=head,
        body_params=dense - embed - (0 if tied else head),
        kv_bytes_per_token=cfg.kv_bytes_per_token(torch.bfloat16),
        latent_kv=cfg.mla is not None,
    )
