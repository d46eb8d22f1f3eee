"""DeepSeek-V2 / V3 / R1 / V3.2 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM,
DeepseekV32ForCausalLM): MLA + DeepSeekMoE; V3.2's attention is sparse (an indexer selects).

V2 and V3 differ only in config flags: router scoring (softmax / sigmoid with a selection bias),
group-limited routing, q_lora_rank (null in V2-Lite), YaRN parameters. The rope part of q and k
is stored by checkpoints with adjacent pairs rotated together; we de-interleave it once (q and k
the same way, so dot products are unchanged) and use the NeoX rotation shared with Llama.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from dsinfer.config import ModelConfig
from dsinfer.distributed.parallel_state import parallel_state
from dsinfer.layers.attention import AttentionMetadata, IndexQuery, make_attention
from dsinfer.layers.kernels import Kernels
from dsinfer.layers.linear import Linear, fused_target
from dsinfer.layers.moe import DeepseekMoE, MoEConfig
from dsinfer.layers.norm import RMSNorm
from dsinfer.layers.rotary import RotaryEmbedding, StepRope, apply_rotary, yarn_mscale
from dsinfer.layers.step_program import MlaProgramLayer, capture_mla_step_program
from dsinfer.models.deepseek_mtp import build_mtp_layer, map_mtp_name, mtp_forward
from dsinfer.models.hf_config import common_config, refuse_mlp_bias
from dsinfer.models.llama import LlamaForCausalLM, LlamaMLP
from dsinfer.models.stages import skip_other_stage, stage_embedding, stage_lm_head

Rope = StepRope
_EXPERT = re.compile(
    r"^((?:model\.layers\.\d+|mtp)\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$"
)


class Indexer(nn.Module):
    """DeepSeek-V3.2's lightning indexer: per token a key (wk, LayerNorm, rotary on its first
    rope dims, not interleaved), per query index_n_heads queries from the query latent (wq_b)
    and a weight each (weights_proj, fp32); the sparse attention ranks cached tokens by them
    (layers/attention/sparse_mla.py). Replicated under tensor parallel: every rank selects for
    all its heads. Its projections stay float in quantised artifacts (the selection is a
    ranking: DeepSeek's own kernels keep it at fp8 or better)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        dsa, m = cfg.sparse_attention, cfg.mla
        assert dsa is not None and m is not None and m.q_lora_rank, "V3.2 has a query latent"
        self.heads, self.dim, self.rope_dim = (
            dsa.index_n_heads,
            dsa.index_head_dim,
            m.qk_rope_head_dim,
        )
        self.wq_b = Linear(m.q_lora_rank, self.heads * self.dim, quantizable=False)
        self.wk = Linear(cfg.hidden_size, self.dim, quantizable=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False, dtype=torch.float32)
        self.weights_proj.weight.keep_fp32 = True  # type: ignore[attr-defined]  # as the reference
        for p in (*self.k_norm.parameters(), *self.weights_proj.parameters()):
            p.requires_grad_(False)  # inference only, as every other parameter here

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, rope: Rope) -> IndexQuery:
        """x [T, hidden], the normed query latent [T, q_lora] → the step's IndexQuery."""
        t = x.shape[0]
        q = self.wq_b(q_latent).view(t, self.heads, self.dim)
        k = self.k_norm(self.wk(x)).unsqueeze(1)  # [T, 1, D]
        w = self.weights_proj(x.float()) * self.heads**-0.5  # [T, heads], fp32
        return IndexQuery(q=self._rotate(q, rope), w=w, k=self._rotate(k, rope).squeeze(1))

    def _rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """[T, heads, D] with rotary on its first rope dims (half-split, not interleaved)."""
        head, tail = x[..., : self.rope_dim], x[..., self.rope_dim :]
        return torch.cat([apply_rotary(head, rope.cos, rope.sin), tail], dim=-1)


class MLA(nn.Module):
    """Under tensor parallel each rank owns num_heads / tp heads after the latent: the latent
    projections (q_a, kv_a) are replicated, q_b / kv_b keep the rank's heads' rows, o_proj its
    heads' columns; the latent cache is whole on every rank."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.mla
        assert m is not None, "an MLA layer needs MLA hyper-parameters"
        h, hidden = cfg.num_heads, cfg.hidden_size
        tp = parallel_state().tp_size
        if h % tp:
            raise ValueError(f"{h} attention heads do not split over {tp} tensor-parallel ranks")
        self.h, self.nope, self.rope_dim = h // tp, m.qk_nope_head_dim, m.qk_rope_head_dim
        self.v, self.lora = m.v_head_dim, m.kv_lora_rank
        qk = self.nope + self.rope_dim
        self.q_lora = m.q_lora_rank
        if self.q_lora:
            self.q_a_proj = Linear(hidden, self.q_lora)
            self.q_a_layernorm = RMSNorm(self.q_lora, cfg.rms_norm_eps)
            self.q_b_proj = Linear(self.q_lora, h * qk, parallel="column")
        else:
            self.q_proj = Linear(hidden, h * qk, parallel="column")
        self.kv_a_proj_with_mqa = Linear(hidden, self.lora + self.rope_dim)
        self.kv_a_layernorm = RMSNorm(self.lora, cfg.rms_norm_eps)
        # Rows are per head ([H, nope + v] × lora), so a column split keeps whole heads.
        self.kv_b_proj = Linear(
            self.lora, h * (self.nope + self.v), quantizable=False, parallel="column"
        )
        self.o_proj = Linear(h * self.v, hidden, parallel="row")
        scale = qk**-0.5
        if cfg.rope.kind == "yarn" and cfg.rope.mscale_all_dim:
            scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
        shape = dict(
            num_heads=self.h, nope=self.nope, rope=self.rope_dim, v_dim=self.v, lora=self.lora
        )
        dsa = cfg.sparse_attention
        # DeepSeek-V3.2: sparse attention over the tokens its indexer selects.
        self.indexer = Indexer(cfg) if dsa is not None else None
        if dsa is None:
            self.attn = make_attention("mla", **shape, scale=scale)
        else:
            self.attn = make_attention(
                "mla_sparse",
                **shape,
                scale=scale,
                index_topk=dsa.index_topk,
                index_scale=dsa.index_head_dim**-0.5,
            )

    def use_kernels(self, kernels: Kernels, device_type: str) -> None:
        self.attn = self.attn.rebuilt(kernels.name, device_type)

    def forward(
        self, x: torch.Tensor, rope: Rope, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata
    ) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))[0]
            q = self.q_b_proj(q_latent)
        else:
            q = self.q_proj(x)
        q = q.view(t, self.h, self.nope + self.rope_dim)
        kv = self.kv_a_proj_with_mqa(x)  # [T, lora + rope]
        # Contiguous, so that the fused backend's norm kernel takes it (and the step program
        # can run the same kernel).
        c = self.kv_a_layernorm(kv[:, : self.lora].contiguous())[0]  # [T, lora]
        kv_b = self.kv_b_proj.weight
        if self.indexer is not None:  # the pair (latent, index keys) is the layer's cache
            index = self.indexer(x, q_latent, rope)
            o = self.attn.forward_sparse(q, kv, c, index, rope, cache, kv_b, meta)
        else:
            # Rotary on the rope parts, the latent (c | k_pe) into the cache, attention: the
            # backend's (one kernel for decode rows on the fused CPU backend).
            o = self.attn.forward_rope(q, kv, c, rope, cache[0], kv_b, meta)
        return self.o_proj(o.reshape(t, self.h * self.v))


def moe_config(cfg: ModelConfig) -> MoEConfig:
    m = cfg.moe
    assert m is not None, "a MoE layer needs routed experts"
    return MoEConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=m.moe_intermediate_size,
        num_experts=m.n_routed_experts,
        top_k=m.num_experts_per_tok,
        num_shared_experts=m.n_shared_experts,
        scoring=m.scoring_func,
        n_group=m.n_group,
        topk_group=m.topk_group,
        norm_topk_prob=m.norm_topk_prob,
        routed_scaling_factor=m.routed_scaling_factor,
        score_correction_bias=m.score_correction_bias,
    )


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        routed = cfg.moe is not None and cfg.moe.is_moe_layer(index)
        self.mlp = DeepseekMoE(moe_config(cfg)) if routed else LlamaMLP(cfg)

    def forward(self, x, residual, rope, cache, meta):  # noqa: ANN001, ANN201
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = stage_embedding(cfg)
        assert cfg.mla is not None
        self.rotary = RotaryEmbedding(
            cfg.mla.qk_rope_head_dim, cfg.max_position_embeddings, cfg.rope
        )
        owned = parallel_state().stage_layers(
            cfg.num_layers
        )  # as LlamaModel: other stages' are empty
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(cfg, i) if i in owned else nn.Identity()
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def deepseek_hyperparameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """MLA and MoE hyper-parameters of DeepSeek-V2/V3 configs."""
    v3 = cfg["architectures"][0] in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
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
        **sparse_attention_hyperparameters(cfg),
    }


def sparse_attention_hyperparameters(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3.2's indexer (config.SparseAttentionConfig); none for V2/V3."""
    if cfg["architectures"][0] != "DeepseekV32ForCausalLM":
        return {}
    if not cfg.get("q_lora_rank"):
        raise ValueError(
            "a DeepSeek-V3.2 config needs q_lora_rank (its indexer reads the query latent)"
        )
    return {
        "index_topk": int(cfg.get("index_topk", 2048)),
        "index_head_dim": int(cfg.get("index_head_dim", 128)),
        "index_n_heads": int(cfg.get("index_n_heads", 64)),
    }


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    """Shares the Llama driver (embed → layers → norm → LM head); layers are MLA + MoE."""

    # Only the dense and shared-expert MLPs fuse gate|up; MLA's projections load as they are.
    packed_modules = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}

    def capture_step_program(self, kv_caches: list) -> str | None:
        """Bind the decoder stack (MLA + dense MLP or DeepSeekMoE layers) into one decode-step
        program; None, or why it stays eager. The MTP layer is not part of it (drafts are
        steps of their own, on the eager path)."""
        state = parallel_state()
        if state.pp_size > 1:
            return "pipeline stages hand activations between processes"
        dtype = self.model.norm.weight.dtype
        layers = []
        for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches, strict=False)):
            if not isinstance(layer, DeepseekDecoderLayer):
                return f"layer {i} is not a DeepSeek decoder layer"
            mla = layer.self_attn
            unsupported = getattr(mla.attn, "program_unsupported", None)
            if unsupported is None:
                return f"layer {i}: {type(mla.attn).__name__} has no program kernel"
            why = unsupported(mla.kv_b_proj.weight, cache[0], dtype)
            if why:
                return f"layer {i}: {why}"
            dense = isinstance(layer.mlp, LlamaMLP)
            layers.append(
                MlaProgramLayer(
                    input_norm=layer.input_layernorm,
                    q=(mla.q_a_proj, mla.q_b_proj) if mla.q_lora else (mla.q_proj,),
                    q_a_norm=mla.q_a_layernorm if mla.q_lora else None,
                    kv_a=mla.kv_a_proj_with_mqa,
                    kv_a_norm=mla.kv_a_layernorm,
                    kv_b=mla.kv_b_proj.weight.data,
                    o=mla.o_proj,
                    post_norm=layer.post_attention_layernorm,
                    mlp=(layer.mlp.gate_up_proj, layer.mlp.down_proj) if dense else None,
                    moe=None if dense else layer.mlp,
                    cache=cache[0],
                )
            )
        first = self.model.layers[0].self_attn
        shape = {
            "num_heads": first.h,
            "nope": first.nope,
            "rope": first.rope_dim,
            "v_dim": first.v,
            "lora": first.lora,
            "scale": first.attn.scale,
        }
        rotary = self.model.rotary
        program = capture_mla_step_program(layers, self.model.norm, rotary.cos, rotary.sin, shape)
        if isinstance(program, str):
            return program
        blocks = kv_caches[0][0].shape[0]
        self.step_program = program.tuned(self.config.hidden_size, dtype, blocks)
        return None

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """MLA and MoE hyper-parameters join the shared fields (typed views: cfg.mla, cfg.moe).
        transformers writes head_dim = the rope part; the real q/k head is nope + rope."""
        refuse_mlp_bias(cfg)
        extra = deepseek_hyperparameters(cfg)
        bias = bool(cfg.get("attention_bias", False))
        head_dim = extra["qk_nope_head_dim"] + extra["qk_rope_head_dim"]
        return common_config(cfg, head_dim=head_dim, qkv_bias=bias, o_bias=bias, extra=extra)

    def __init__(self, cfg: ModelConfig) -> None:
        nn.Module.__init__(self)
        self.config = cfg
        self.model = DeepseekModel(cfg)
        self.lm_head = stage_lm_head(cfg, self.model.embed_tokens)
        self.step_program = None  # the shared forward checks it; see capture_step_program
        self._mtp_prefix = f"model.layers.{cfg.num_layers}."
        # The multi-token-prediction layer, when the checkpoint carries it and it is enabled: on
        # the first pipeline stage, beside the embedding and the head it shares.
        wanted = cfg.num_mtp_layers and parallel_state().is_first_stage
        self.mtp = build_mtp_layer(cfg, DeepseekDecoderLayer) if wanted else None

    @classmethod
    def configure_for_checkpoint(cls, cfg: ModelConfig, names: set[str] | None) -> ModelConfig:
        """Enable the MTP layer only when the checkpoint has its weights (names None: random
        weights, which have whatever the config describes)."""
        prefix = f"model.layers.{cfg.num_layers}."
        wanted = cfg.num_nextn_predict_layers > 0
        has = names is None or any(n.startswith(prefix) for n in names)
        return cfg.with_mtp(1 if wanted and has else 0)

    def mtp_hidden(
        self,
        next_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] next tokens and [T, hidden] states (the main model's, or a chained MTP step's
        un-normed output) → (MTP states for draft logits, the un-normed states a next chained
        step takes), both [T, hidden]."""
        assert self.mtp is not None
        embeds = self.model.embed_tokens(next_ids)
        rope = self.model.rotary.cos_sin(positions, embeds.dtype)
        return mtp_forward(self.mtp, embeds, hidden, rope, kv_caches[self.config.num_layers], meta)

    def map_checkpoint_name(self, name: str) -> tuple[str, object] | None:
        if skip_other_stage(name, self.config.num_layers):
            return "", None
        if name.startswith(self._mtp_prefix):
            if self.mtp is None:
                return "", None  # MTP off (or not wanted): its weights are not loaded
            mapped = map_mtp_name(name, self._mtp_prefix)
            if mapped is None:
                return "", None
            name = mapped
            if _EXPERT.match(name) is None:  # the shared experts' gate|up are fused
                return fused_target(name, self.packed_modules)
        m = _EXPERT.match(name)
        if m is None:
            return None
        prefix, expert, kind = m.group(1), int(m.group(2)), m.group(3)
        moe = self.config.moe
        if moe is not None and expert not in parallel_state().expert_range(moe.n_routed_experts):
            return "", None  # another expert-parallel rank's expert
        return f"{prefix}.{'w2' if kind == 'down' else 'w13'}", (kind, expert)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """V3 / R1: the config parser sets sigmoid scoring with the selection bias."""


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """V3.2: V3 whose attention is DeepSeek Sparse Attention (MLA over the tokens a lightning
    indexer selects: Indexer above, layers/attention/sparse_mla.py)."""

    def capture_step_program(self, kv_caches: list) -> str | None:
        return "the sparse attention's indexer has no program kernel"
