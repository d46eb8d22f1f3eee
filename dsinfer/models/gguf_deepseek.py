"""DeepSeek-V2 / V2-Lite / V3 / R1 GGUF files (llama.cpp's `deepseek2` architecture).

What llama.cpp's converter changes on the way from a Hugging Face checkpoint, undone here:
- The metadata describes MLA as multi-query attention over the latent: `key_length` is
  kv_lora_rank + rope dims and `head_count_kv` is 1. The per-head sizes are in
  `key_length_mla` / `value_length_mla` (files written before that split keep them in
  key_length / value_length instead).
- kv_b_proj is stored as two tensors for llama.cpp's absorbed attention: attn_k_b
  [H, kv_lora_rank, nope] (transposed) and attn_v_b [H, v, kv_lora_rank]. They are joined back
  into kv_b_proj [H · (nope + v), kv_lora_rank]. Older files keep attn_kv_b as it was.
- Routed experts are stacked per layer (ffn_{gate,up,down}_exps [E, out, in]; gate and up
  may be fused into ffn_gate_up_exps); they are split back into one tensor per expert.
- YaRN keeps one magnitude: `yarn_log_multiplier` is 0.1 · mscale_all_dim, and llama.cpp
  takes mscale to equal it (true of every released DeepSeek config).
The router's scoring function says which family a file is: softmax is V2, sigmoid with the
selection bias (exp_probs_b) is V3 / R1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from dsinfer.models.gguf_reader import GGUFFile, GGUFTensor

ARCH = "deepseek2"
_SIGMOID, _SOFTMAX = 2, 1  # llama.cpp's expert_gating_func values

# GGUF per-layer tensor → the HF module under model.layers.N, for the parts Llama's table
# (gguf_file._LAYER_NAMES: norms, attn_q, attn_output, the dense MLP) lacks; weights and
# biases keep their suffix.
LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
# The one tensor whose HF name is not module + suffix: V3's selection bias (exp_probs_b.bias).
TENSOR_NAMES = {"exp_probs_b": "mlp.gate.e_score_correction_bias"}
_LAYER = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_STACKED = {
    "ffn_gate_exps": ("gate",),
    "ffn_up_exps": ("up",),
    "ffn_down_exps": ("down",),
    "ffn_gate_up_exps": ("gate", "up"),
}


def hf_config(reader: GGUFFile) -> dict[str, Any]:
    """The file's metadata as the HF config.json it was converted from (the model class parses
    it as it parses a checkpoint's)."""

    def get(key: str, default: Any = None) -> Any:
        return reader.fields.get(f"{ARCH}.{key}", default)

    def need(*keys: str) -> Any:
        """The first of `keys` the file has (a newer name first), or a clear refusal."""
        for key in keys:
            if get(key) is not None:
                return get(key)
        raise ValueError(f"deepseek2 GGUF lacks {ARCH}.{keys[0]}: not a complete model file")

    names = {t.name for t in reader.tensors}
    bias = any(n.endswith(".exp_probs_b.bias") for n in names)
    # Files without the key: V2's softmax, unless V3's selection bias is there (a config
    # without scoring_func, from which the converter writes no key).
    gating = int(get("expert_gating_func", _SIGMOID if bias else _SOFTMAX))
    if gating not in (_SIGMOID, _SOFTMAX):
        raise ValueError(f"deepseek2 GGUF: expert gating function {gating} is not DeepSeek's")
    v3 = gating == _SIGMOID
    if v3 and not bias:
        raise ValueError("deepseek2 GGUF with sigmoid routing but no exp_probs_b (V3's bias)")
    rope = int(need("rope.dimension_count"))
    k_len = int(need("attention.key_length_mla", "attention.key_length"))
    v_len = int(need("attention.value_length_mla", "attention.value_length"))
    heads = int(need("attention.head_count"))
    groups = int(get("expert_group_count") or 1)
    vocab = get("vocab_size") or len(reader.fields.get("tokenizer.ggml.tokens", []))
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        "vocab_size": int(vocab),
        "hidden_size": int(need("embedding_length")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,  # MLA: every head reads the one latent
        "max_position_embeddings": int(get("context_length", 4096)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in names,
        "q_lora_rank": get("attention.q_lora_rank"),
        "kv_lora_rank": int(need("attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": k_len - rope,
        "v_head_dim": v_len,
        "n_routed_experts": int(get("expert_count") or 0),
        "num_experts_per_tok": int(get("expert_used_count") or 1),
        "n_shared_experts": int(get("expert_shared_count") or 0),
        "moe_intermediate_size": int(get("expert_feed_forward_length") or 0),
        "first_k_dense_replace": int(get("leading_dense_block_count") or 0),
        "routed_scaling_factor": float(get("expert_weights_scale") or 1.0),
        "norm_topk_prob": bool(get("expert_weights_norm", False)),
        "scoring_func": "sigmoid" if v3 else "softmax",
        "topk_method": "noaux_tc" if v3 else ("group_limited_greedy" if groups > 1 else "greedy"),
        "n_group": groups,
        "topk_group": int(get("expert_group_used_count") or 1),
    }
    if get("rope.scaling.type") == "yarn":
        # llama.cpp keeps 0.1 · mscale_all_dim and takes mscale to equal it (module docstring).
        # Stored as float32: rounded back to the config's decimals (0.707 → 0.0707 → 0.707).
        mscale = round(float(get("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1, 6)
        cfg["rope_scaling"] = {
            "type": "yarn",
            "factor": float(get("rope.scaling.factor")),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length")),
            "beta_fast": float(get("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(get("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale,
            "mscale_all_dim": mscale,
        }
    elif get("rope.scaling.type") not in (None, "none"):
        raise ValueError(
            f"deepseek2 GGUF: rope scaling {get('rope.scaling.type')!r} is not DeepSeek's"
        )
    return cfg


def hf_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], rename: Callable[[str], str | None]
) -> Iterator[tuple[str | None, str, torch.Tensor]]:
    """(GGUF name, tensor in torch's dim order) → (HF name, GGUF name, tensor): experts
    unstacked, k_b and v_b joined into kv_b_proj (whichever of the two comes first waits for
    the other), the rest named by `rename` (None: a tensor dsinfer does not know)."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in tensors:
        m = _LAYER.match(name)
        kind = m.group(2) if m else ""
        if kind in _STACKED:
            for hf, part in _unstacked(int(m.group(1)), _STACKED[kind], w):  # type: ignore[union-attr]
                yield hf, name, part
        elif kind in ("attn_k_b", "attn_v_b"):
            block = m.group(1)  # type: ignore[union-attr]
            pair = halves.setdefault(block, {})
            pair[kind] = w
            if len(pair) == 2:
                del halves[block]
                # k_b [H, rank, nope] → [H, nope, rank]; with v_b [H, v, rank] → [H·(nope+v), rank]
                kv_b = torch.cat([pair["attn_k_b"].transpose(1, 2), pair["attn_v_b"]], dim=1)
                hf = f"model.layers.{block}.self_attn.kv_b_proj.weight"
                yield hf, f"blk.{block}.attn_k_b|v_b", kv_b.flatten(0, 1)
        else:
            yield rename(name), name, w
    if halves:
        raise ValueError(f"deepseek2 GGUF: layers {sorted(halves)} lack attn_k_b or attn_v_b")


def expert_stacks(reader: GGUFFile) -> dict[str, dict[str, GGUFTensor]]:
    """{"model.layers.N.mlp.experts": {"gate" | "up" | "gate_up" | "down": tensor}} of the
    file's stacked routed experts (empty for other architectures)."""
    found: dict[str, dict[str, GGUFTensor]] = {}
    for t in reader.tensors:
        m = _LAYER.match(t.name)
        if m is not None and m.group(2) in _STACKED:
            kind = "_".join(_STACKED[m.group(2)])
            found.setdefault(f"model.layers.{m.group(1)}.mlp.experts", {})[kind] = t
    return found


def _unstacked(
    block: int, kinds: tuple[str, ...], stack: torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """[E, out, in] (gate | up fused along out when two kinds) → one weight per expert."""
    for kind, part in zip(kinds, stack.chunk(len(kinds), dim=1), strict=True):
        for e in range(part.shape[0]):
            yield f"model.layers.{block}.mlp.experts.{e}.{kind}_proj.weight", part[e]
