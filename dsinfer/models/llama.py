"""Llama-family decoder (DeepSeek-LLM, DeepSeek-Coder, R1-Distill-Llama, SmolLM2).

Qwen2 is the same graph with a qkv bias; see qwen2.py. The flat batch layout is the engine's:
`input_ids`/`positions` are [T] over all sequences of the step, attention metadata says which
rows belong to which sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsinfer.config import ModelConfig
from dsinfer.distributed.parallel_state import parallel_state
from dsinfer.distributed.pipeline import pipeline_forward
from dsinfer.layers.activation import get_gated_activation
from dsinfer.layers.attention import AttentionMetadata, make_attention
from dsinfer.layers.kernels import Kernels
from dsinfer.layers.linear import Linear
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.rotary import RotaryEmbedding, StepRope
from dsinfer.layers.step_program import ProgramLayer, StepProgram, capture_step_program
from dsinfer.models.hf_config import common_config, refuse_mlp_bias
from dsinfer.models.stages import skip_other_stage, stage_embedding, stage_lm_head

KVCache = tuple[torch.Tensor, torch.Tensor]
Rope = StepRope


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        tp = parallel_state().tp_size
        if cfg.num_heads % tp or cfg.num_kv_heads % tp:
            raise ValueError(
                f"{cfg.num_heads} heads / {cfg.num_kv_heads} KV heads do not split over "
                f"{tp} tensor-parallel ranks"
            )
        self.d = cfg.head_dim
        # Heads of this tensor-parallel rank (all of them for one process).
        self.h, self.kv = cfg.num_heads // tp, cfg.num_kv_heads // tp
        d, h, kv = self.d, cfg.num_heads, cfg.num_kv_heads
        self.qkv_proj = Linear(
            cfg.hidden_size,
            [h * d, kv * d, kv * d],
            bias=cfg.qkv_bias,
            shard_names=("q", "k", "v"),
            parallel="column",
        )
        self.o_proj = Linear(h * d, cfg.hidden_size, bias=cfg.o_bias, parallel="row")
        self.attn = make_attention(
            "mha", num_heads=self.h, num_kv_heads=self.kv, head_dim=self.d, scale=self.d**-0.5
        )

    def use_kernels(self, kernels: Kernels, device_type: str) -> None:
        self.attn = self.attn.rebuilt(kernels.name, device_type)

    def forward(
        self, x: torch.Tensor, rope: Rope, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [T, (H + 2KV) * D]
        return self.o_proj(self.attn.forward_qkv(qkv, rope, cache, meta))  # [T, H * D] in


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = Linear(
            cfg.hidden_size, [i, i], shard_names=("gate", "up"), parallel="column"
        )
        self.down_proj = Linear(i, cfg.hidden_size, parallel="row")
        self.act_name = cfg.hidden_act
        self.act = get_gated_activation(cfg.hidden_act)

    def use_kernels(self, kernels: Kernels, device_type: str) -> None:
        self.act = get_gated_activation(self.act_name, kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = stage_embedding(cfg)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        # A pipeline stage builds only its own layers; the others are empty placeholders that
        # keep checkpoint indices (model.layers.{i}) aligned.
        owned = parallel_state().stage_layers(cfg.num_layers)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg) if i in owned else nn.Identity() for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections fused into one matmul: checkpoint name → (our module, shard).
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Llama's config.json: `attention_bias` puts a bias on q, k, v and o alike."""
        refuse_mlp_bias(cfg)
        bias = bool(cfg.get("attention_bias", False))
        return common_config(cfg, qkv_bias=bias, o_bias=bias)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if parallel_state().ep_size > 1:
            raise ValueError("expert parallel needs a mixture-of-experts model (DeepSeek-V2/V3)")
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = stage_lm_head(cfg, self.model.embed_tokens)
        self.step_program: StepProgram | None = None  # capture_step_program, after loading

    def capture_step_program(self, kv_caches: list[KVCache]) -> str | None:
        """Bind the decoder stack into one decode-step program; None, or why it stays eager."""
        if parallel_state().pp_size > 1:
            return "pipeline stages hand activations between processes"
        layers = []
        for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches, strict=False)):
            if not isinstance(layer, LlamaDecoderLayer):
                return f"layer {i} is not a Llama decoder layer"
            attn = layer.self_attn
            if not attn.attn.step_program_kernel:
                return f"layer {i}: {type(attn.attn).__name__} has no program kernel"
            if cache[0].dtype != layer.input_layernorm.weight.dtype:
                return "the KV cache dtype differs from the activations'"
            layers.append(
                ProgramLayer(
                    layer.input_layernorm,
                    attn.qkv_proj,
                    attn.o_proj,
                    layer.post_attention_layernorm,
                    layer.mlp.gate_up_proj,
                    layer.mlp.down_proj,
                    cache,
                )
            )
        mha = self.model.layers[0].self_attn.attn
        shape = {"num_heads": mha.num_heads, "num_kv_heads": mha.num_kv_heads, "scale": mha.scale}
        rotary = self.model.rotary
        program = capture_step_program(layers, self.model.norm, rotary.cos, rotary.sin, shape)
        if isinstance(program, str):
            return program
        blocks = kv_caches[0][0].shape[0]
        self.step_program = program.tuned(
            self.config.hidden_size, self.model.norm.weight.dtype, blocks
        )
        return None

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        """Skip what another pipeline stage holds (None: the generic rule)."""
        return ("", None) if skip_other_stage(name, self.config.num_layers) else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] → final hidden states [T, hidden]."""
        if parallel_state().pp_size > 1:
            return pipeline_forward(self, input_ids, positions, kv_caches, meta)
        x = self.model.embed_tokens(input_ids)
        if self.step_program is not None and self.step_program.takes(x.shape[0], meta):
            return self.step_program.run(x, meta)  # every layer in one C++ call
        rope = self.model.rotary.cos_sin(positions, x.dtype)
        residual = None
        # kv_caches may hold one more layer than the model's: the MTP layer's (DeepSeek-V3).
        for layer, cache in zip(
            self.model.layers, kv_caches[: len(self.model.layers)], strict=True
        ):
            x, residual = layer(x, residual, rope, cache, meta)
        x, _ = self.model.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] → fp32 logits [N, vocab]."""
        assert self.lm_head is not None, "logits are computed on the first pipeline stage"
        return self.lm_head(hidden)
