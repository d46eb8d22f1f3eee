"""GGUF files written the way llama.cpp's converter (convert_hf_to_gguf.py) writes them, for
tests: DeepSeek-V2/V3 checkpoints (`deepseek2`) and BPE vocabularies.

The converter ships only inside llama-cpp-python's source archive (22 MB, all of llama.cpp),
which the test suite does not fetch. This writer follows what it does (metadata keys and their meaning, kv_b split into k_b / v_b, experts stacked) using
the `gguf` package's own writer and tensor-name table, so the names come from llama.cpp's
side, not from dsinfer's reader. In session 33 its output was checked field by field and
tensor by tensor against the real converter (llama-cpp-python 0.3.36's vendored tree) on
the same tiny checkpoints and on the real DeepSeek tokenizers (docs/deepseek.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import load_file

ARCH = gguf.MODEL_ARCH.DEEPSEEK2
# Tensors the converter keeps in F32 whatever the requested type (norms, biases, router).
_F32_KINDS = ("norm", "ffn_gate_inp", "exp_probs_b")


def _hf_state(path: Path) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def _converted_tensors(state: dict[str, torch.Tensor], hp: dict[str, Any]):  # noqa: ANN202
    """HF name → tensor, as the converter's modify_tensors hands them to its name table:
    experts stacked per layer, kv_b_proj split into k_b (transposed) and v_b."""
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, w in state.items():
        parts = name.split(".")
        if ".mlp.experts." in name and parts[5].isdigit():  # model.layers.B.mlp.experts.E.X.weight
            experts.setdefault((int(parts[2]), parts[6]), {})[int(parts[5])] = w
            continue
        if name.endswith("kv_b_proj.weight"):
            heads, nope, v = hp["num_attention_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
            kv_b = w.view(heads, nope + v, w.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v], dim=1)
            yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)
            yield name.replace("kv_b_proj", "v_b_proj"), v_b
            continue
        yield name, w
    for (block, kind), per_expert in sorted(experts.items()):
        stack = torch.stack([per_expert[e] for e in range(len(per_expert))])
        yield f"model.layers.{block}.mlp.experts.{kind}.weight", stack


def _add_tensor(
    writer: gguf.GGUFWriter, name: str, w: torch.Tensor, qtype: str, layers: int = 0
) -> None:
    arr = w.float().contiguous().numpy()
    keep_f32 = arr.ndim == 1 or any(k in name for k in _F32_KINDS) or arr.shape[-1] % 32
    if qtype == "F32" or keep_f32:
        writer.add_tensor(name, arr)
        return
    if qtype == "Q4_K_M":
        qtype = q4_k_m_type(name, layers)
    if qtype in _K_QUANTS and arr.shape[-1] % 256:  # rows not whole super-blocks
        qtype = _K_FALLBACK[qtype]
    kind = gguf.GGMLQuantizationType[qtype]
    writer.add_tensor(name, quantize(arr, qtype), raw_dtype=kind)


def quantize(arr: np.ndarray, qtype: str) -> np.ndarray:
    """`arr` [..., K] as GGUF blocks of `qtype` (the gguf package's quantisers, and ours for
    the K-quants it only reads)."""
    if qtype in _K_QUANTS:
        return _K_QUANTS[qtype](arr.reshape(-1, 256)).reshape(*arr.shape[:-1], -1)
    return gguf.quants.quantize(arr, gguf.GGMLQuantizationType[qtype])


def q4_k_m_type(name: str, layers: int) -> str:
    """The type llama-quantize's Q4_K_M gives a matrix (src/llama-quant.cpp, simplified to
    what DeepSeek-V2/V3 and Llama files hold): Q6_K for the output, attn_v and ffn_down (dense,
    shared or routed) in the layers `use_more_bits` picks, Q4_K for the rest (rows that are
    not whole super-blocks of 256 then fall back, as there: _K_FALLBACK)."""
    parts = name.split(".")
    block = int(parts[1]) if parts[0] == "blk" else -1
    more = block < layers // 8 or block >= 7 * layers // 8 or (block - layers // 8) % 3 == 2
    kind = parts[2] if parts[0] == "blk" else name
    wide = name == "output.weight" or (more and (kind == "attn_v" or kind.startswith("ffn_down")))
    return "Q6_K" if wide else "Q4_K"


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Super-blocks of 256 [n, 256] → Q4_K bytes [n, 144]: per group of 32 a min/max scale and
    minimum, both as 6-bit multiples of the block's fp16 d and dmin (llama.cpp searches
    for better ones; any valid choice serves a reader's test), codes 0..15."""
    n = x.shape[0]
    g = x.reshape(n, 8, 32).astype(np.float32)
    lo = np.minimum(g.min(-1), 0.0)  # x = scale·q − minimum, minimum ≥ 0
    scale = (g.max(-1) - lo) / 15.0
    d = _f16(scale.max(-1) / 63.0)
    dmin = _f16(-lo.min(-1) / 63.0)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), 0, 63)
    mn = np.clip(np.round(np.divide(-lo, dminf, out=np.zeros_like(lo), where=dminf > 0)), 0, 63)
    step, offset = df * sc, dminf * mn  # [n, 8]
    q = np.round(
        np.divide(
            g + offset[..., None], step[..., None], out=np.zeros_like(g), where=step[..., None] > 0
        )
    )
    q = np.clip(q, 0, 15).astype(np.uint8)  # [n, 8, 32]
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    scales = np.empty((n, 12), dtype=np.uint8)
    scales[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    scales[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n, 128)  # groups 2j (low) and 2j+1 (high)
    head = np.concatenate([d[:, None].view(np.uint8), dmin[:, None].view(np.uint8)], axis=1)
    return np.concatenate([head.reshape(n, 4), scales, qs], axis=1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """Super-blocks of 256 [n, 256] → Q6_K bytes [n, 210]: per 16 weights an int8 multiple of
    the block's fp16 d as scale, codes −32..31 (stored +32: 4 low bits in ql, 2 high in qh)."""
    n = x.shape[0]
    g = x.reshape(n, 16, 16).astype(np.float32)
    scale = np.abs(g).max(-1) / 31.0  # [n, 16]
    d = _f16(np.abs(scale).max(-1) / 127.0)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(np.divide(scale, df, out=np.zeros_like(scale), where=df > 0)), -128, 127)
    step = (df * sc)[..., None]
    q = np.round(np.divide(g, step, out=np.zeros_like(g), where=step > 0))
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # [n, half, k, l]
    low, high = q & 15, q >> 4
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1
    )  # [n, half, 64]: byte (k % 2)·32 + l holds k < 2 low, k ≥ 2 high
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [
            ql.reshape(n, 128),
            qh.reshape(n, 64),
            sc.astype(np.int8).view(np.uint8),
            d[:, None].view(np.uint8).reshape(n, 2),
        ],
        axis=1,
    )


_K_QUANTS = {"Q4_K": quantize_q4_k, "Q6_K": quantize_q6_k}
_K_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama-quantize's, for rows of 32-blocks only


def write_deepseek2(
    src: Path, dst: Path, qtype: str = "F32", vocab: list[str] | None = None
) -> Path:
    """The HF checkpoint in `src` (written by save_pretrained) → a deepseek2 GGUF at `dst`.
    qtype: F32, Q8_0, Q4_0, Q4_1, Q4_K or Q6_K for the weight matrices whose rows are whole
    blocks, or Q4_K_M: llama-quantize's mix of them (q4_k_m_type)."""
    hp = json.loads((src / "config.json").read_text())
    writer = gguf.GGUFWriter(str(dst), gguf.MODEL_ARCH_NAMES[ARCH])
    add_deepseek2_metadata(writer, hp)
    _add_word_vocab(writer, vocab or [f"w{i}" for i in range(hp["vocab_size"])])
    names = gguf.get_tensor_name_map(ARCH, hp["num_hidden_layers"])
    for hf, w in _converted_tensors(_hf_state(src), hp):
        # The converter's one rename before its table: V3's bias as a ".bias" suffix.
        hf = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"the gguf package's table has no name for {hf}"
        _add_tensor(writer, name, w, qtype, hp["num_hidden_layers"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def add_deepseek2_metadata(writer: gguf.GGUFWriter, hp: dict[str, Any]) -> None:
    """The model keys the converter writes for a DeepSeek-V2/V3 config.json `hp`."""
    rope = {**(hp.get("rope_scaling") or {}), **(hp.get("rope_parameters") or {})}
    writer.add_context_length(hp["max_position_embeddings"])
    writer.add_embedding_length(hp["hidden_size"])
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_head_count(hp["num_attention_heads"])
    writer.add_head_count_kv(1)  # MLA as multi-query attention over the latent
    writer.add_rope_freq_base(rope.get("rope_theta", hp.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(hp.get("rms_norm_eps", 1e-6))
    writer.add_expert_count(hp["n_routed_experts"])
    writer.add_expert_used_count(hp["num_experts_per_tok"])
    if hp.get("n_group") is not None:
        writer.add_expert_group_count(hp["n_group"])
    if hp.get("topk_group") is not None:
        writer.add_expert_group_used_count(hp["topk_group"])
    if hp.get("scoring_func") is not None:  # released DeepSeek configs all name it
        sigmoid = hp["scoring_func"] == "sigmoid"
        writer.add_expert_gating_func(
            gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX
        )
    writer.add_leading_dense_block_count(hp["first_k_dense_replace"])
    writer.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank"):
        writer.add_q_lora_rank(hp["q_lora_rank"])
    lora, rope_dim = hp["kv_lora_rank"], hp["qk_rope_head_dim"]
    writer.add_kv_lora_rank(lora)
    writer.add_key_length(lora + rope_dim)
    writer.add_value_length(lora)
    writer.add_key_length_mla(hp["qk_nope_head_dim"] + rope_dim)
    writer.add_value_length_mla(hp["v_head_dim"])
    writer.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    writer.add_expert_shared_count(hp.get("n_shared_experts", 0))
    if hp.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rope_dim)
    if rope.get("rope_type", rope.get("type")) == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (
            ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
        ):
            if rope.get(key) is not None:
                add(rope[key])
        if rope.get("mscale_all_dim") is not None:
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _add_word_vocab(writer: gguf.GGUFWriter, tokens: list[str]) -> None:
    """The tiny test tokenizer's words as a merge-free BPE vocabulary (tests feed ids)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def bpe_vocab(tokenizer_dir: Path, vocab_size: int | None = None) -> tuple[list[str], list[int]]:
    """Tokens and types as the converter's get_vocab_base writes them: every id below the
    model's vocab size, padding ids as [PADi] (UNUSED), added tokens CONTROL when special or
    shaped like a control token (DeepSeek's <｜User｜> is not special in tokenizer.json), else
    USER_DEFINED."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    vocab = tok.get_vocab()
    size = vocab_size or len(vocab)
    reverse = {i: t for t, i in vocab.items()}
    added = tok.added_tokens_decoder
    tokens, types = [], []
    for i in range(size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if i in added:
            if not added[i].normalized:
                token = tok.decode(tok.encode(token, add_special_tokens=False))
            control = added[i].special or _looks_special(token)
            types.append(gguf.TokenType.CONTROL if control else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def _looks_special(token: str) -> bool:
    """The converter's rule for added tokens it makes CONTROL although they are not special."""
    bars = (token.startswith("<|") and token.endswith("|>")) or (
        token.startswith("<\uff5c") and token.endswith("\uff5c>")
    )
    return bars or token == "<pad>"


def write_vocab_only(
    tokenizer_dir: Path, pre: str, dst: Path, arch: str = "llama", vocab_size: int | None = None
) -> Path:
    """A vocabulary-only GGUF of a Hugging Face tokenizer (tokenizer.json + its config), as
    `convert_hf_to_gguf.py --vocab-only` writes it; `pre` is the name the converter's hash
    table gives that tokenizer, `vocab_size` the model's (ids past the tokenizer's padded)."""
    tokens, types = bpe_vocab(tokenizer_dir, vocab_size)
    writer = gguf.GGUFWriter(str(dst), arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    gguf.SpecialVocab(tokenizer_dir, load_merges=True).add_to_gguf(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return dst


def tensor_arrays(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file, dequantised, in torch's dim order (for comparisons)."""
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = np.asarray(arr, dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
    return out
