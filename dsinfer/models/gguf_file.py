"""Reading GGUF files: metadata → ModelConfig, tensors → dequantised torch tensors, HF names.

llama.cpp stores the Llama Q and K projections with rows permuted for its interleaved rotary
layout; we undo that here, or attention would be silently wrong while everything "runs".
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from dsinfer.config import ModelConfig, RopeConfig
from dsinfer.models import gguf_deepseek
from dsinfer.models.gguf_reader import GGUFFile, GGUFTensor
from dsinfer.models.registry import config_from_hf

_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# Architectures whose metadata is read as the HF config it came from (their own module).
_HF_CONFIG = {gguf_deepseek.ARCH: gguf_deepseek.hf_config}
_SUPPORTED_QTYPES = {
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    **gguf_deepseek.LAYER_NAMES,  # MLA's and DeepSeekMoE's parts
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: str | Path) -> GGUFFile:
    """The GGUF file at `path`, parsed once per process and file version: config, weights and
    tokenizer each need it. The file is mapped; tensors are read from the map when used."""
    st = os.stat(path)
    return _open_gguf(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


def release_gguf_maps() -> None:
    """Drop the cached readers: once the weights are copied out, the file's pages they mapped
    need not stay resident (a reader parsed again later costs ~0.1 s)."""
    _open_gguf.cache_clear()


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def config_from_gguf(reader: GGUFFile) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch in _HF_CONFIG:
        return config_from_hf(_HF_CONFIG[arch](reader))
    if arch not in _ARCH:
        supported = sorted([*_ARCH, *_HF_CONFIG])
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {supported}")

    def get(k: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{k}", default)

    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = get("vocab_size") or len(field_value(reader, "tokenizer.ggml.tokens", []))
    return ModelConfig(
        architecture=_ARCH[arch],
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(get("context_length", 4096)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=RopeConfig(theta=float(get("rope.freq_base", 10000.0))),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
    )


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Invert llama.cpp's rotary row permutation: rows (h, d/2, 2) → (h, 2, d/2)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permuted_heads(name: str, cfg: ModelConfig) -> int | None:
    """Heads of a tensor llama.cpp stored with permuted rows (Llama's q and k), else None."""
    if cfg.architecture != "LlamaForCausalLM":
        return None
    if name.endswith("q_proj.weight"):
        return cfg.num_heads
    return cfg.num_kv_heads if name.endswith("k_proj.weight") else None


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor that maps one to one (every architecture's names are
    distinct), or None."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None
    if parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    whole = gguf_deepseek.TENSOR_NAMES.get(parts[2])
    return None if whole is None else f"model.layers.{parts[1]}.{whole}"


# The weight-only format each GGUF block type loads into. Q4_0 / Q4_1 / Q4_K are 4-bit codes in
# groups of 32 with a scale and a minimum, as our int4 groups of 32 are: exact (q4_codes).
# Types of more bits (Q5_*, Q6_K, Q8_0) keep 8 bits: int8 per row, requantised from their
# values, never fewer bits than the file chose (llama.cpp's *_M mixes give the layers that
# matter most Q6_K). Q2_K / Q3_K have no format of ours; int4 in groups of 32 is the nearest.
_NATIVE_FORMAT = {
    "Q4_0": "int4",
    "Q4_1": "int4",
    "Q4_K": "int4",
    "Q2_K": "int4",
    "Q3_K": "int4",
    "Q5_0": "int8",
    "Q5_1": "int8",
    "Q5_K": "int8",
    "Q6_K": "int8",
    "Q8_0": "int8",
}
# The types whose blocks are our int4 groups of 32 as they are (q4_codes reads them).
EXACT_INT4 = ("Q4_0", "Q4_1", "Q4_K")


def native_format(qname: str) -> str | None:
    """The format a tensor of this GGUF type loads into (int4 | int8), None for floats."""
    return _NATIVE_FORMAT.get(qname)


def native_scheme(reader: GGUFFile) -> str:
    """The weight-only scheme matching this GGUF's projection weights: int4 when any is
    4-bit (a Q4_K_M file, even SmolLM2's, whose rows mostly fall back to Q5_0: its Q4_K layers
    then load as they are and the rest as int8, layer by layer, `keep_file_precision`), else
    int8 when any is quantised, else "none". Left out: the token embedding (it is looked up,
    not multiplied), the LM head (int8 under int4 whatever the file holds; llama.cpp's Q4 files
    keep it Q6_K), MoE routers (llama.cpp keeps them F32) and float matrices beside quantised
    ones (llama.cpp leaves those whose rows are not whole blocks)."""
    found = set()
    for t in reader.tensors:
        if len(t.shape) < 2 or t.name in _NOT_PROJECTIONS or ".ffn_gate_inp." in t.name:
            continue
        found.add(native_format(t.tensor_type.name))
    return next((fmt for fmt in ("int4", "int8") if fmt in found), "none")


_NOT_PROJECTIONS = frozenset({"token_embd.weight", "output.weight"})


# Bytes per block: Q4_0 / Q4_1 / Q5_0 / Q8_0 hold 32 weights (fp16 scale, fp16 minimum for Q4_1,
# then the codes); Q4_K 256 (fp16 d and dmin, 12 bytes of 6-bit scales and minima, 128 of
# codes).
_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q8_0": 34, "Q4_K": 144, "Q6_K": 210}


def q4_codes(
    data: np.ndarray, qname: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A Q4_0 / Q4_1 / Q4_K tensor's groups of 32 → codes [groups, 32] (uint8, 0..15), the
    scale d and the minimum m (None for Q4_0) as fp32 [groups, 1]: Q4_0 x = d·(q − 8); Q4_1
    and Q4_K x = d·q + m. In a Q4_0 / Q4_1 block the codes of weights 0..15 are the low
    nibbles of its 16 code bytes, 16..31 the high ones."""
    if qname == "Q4_K":
        return _q4k_codes(data)
    raw = file_bytes(data).view(-1, _BLOCK_BYTES[qname])
    d = raw[:, 0:2].contiguous().view(torch.float16).float()
    codes = raw[:, 4:] if qname == "Q4_1" else raw[:, 2:]
    m = raw[:, 2:4].contiguous().view(torch.float16).float() if qname == "Q4_1" else None
    out = torch.empty(codes.shape[0], 32, dtype=torch.uint8)
    torch.bitwise_and(codes, 15, out=out[:, :16])
    torch.bitwise_right_shift(codes, 4, out=out[:, 16:])
    return out, d, m


def _q4k_codes(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K super-blocks of 256 → 8 groups of 32 each: x = (d·sc_j)·q − dmin·mn_j, so the
    group's scale is d·sc_j and its minimum −dmin·mn_j (sc_j, mn_j: 6-bit, packed in 12 bytes:
    bytes 0..3 hold sc_0..3 in their low 6 bits, 4..7 mn_0..3; sc_4..7 and mn_4..7 take their
    low 4 bits from bytes 8..11 (low / high nibble) and their top 2 bits from the top 2 bits
    of bytes 0..3 / 4..7). Each 32 code bytes hold two groups: 2j in the low nibbles, 2j + 1
    in the high ones. The products are fp32, as llama.cpp and the gguf package compute them."""
    raw = file_bytes(data).view(-1, _BLOCK_BYTES["Q4_K"])
    n = raw.shape[0]
    d = raw[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1]
    dmin = raw[:, 2:4].contiguous().view(torch.float16).float()
    lo_sc, lo_mn, high = raw[:, 4:8], raw[:, 8:12], raw[:, 12:16]  # [n, 4] each
    sc = torch.cat([lo_sc & 63, (high & 15) | ((lo_sc >> 6) << 4)], dim=1)  # [n, 8]
    mn = torch.cat([lo_mn & 63, (high >> 4) | ((lo_mn >> 6) << 4)], dim=1)
    qs = raw[:, 16:].reshape(n, 4, 1, 32)  # [n, chunk, 1, 32]
    codes = torch.cat([qs & 15, qs >> 4], dim=2)  # [n, chunk, nibble, 32]: group 2·chunk + nibble
    scale = (d * sc.float()).reshape(-1, 1)  # [n·8, 1]
    minimum = -(dmin * mn.float()).reshape(-1, 1)
    return codes.reshape(-1, 32), scale, minimum


def file_bytes(data: np.ndarray) -> torch.Tensor:
    """A tensor over a tensor's bytes in the (read-only) file map, without a copy: only read
    from, never written (torch warns on any non-writable buffer; the warning is moot here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(data)


def _fast_dequantize(data: np.ndarray, qname: str) -> torch.Tensor | None:
    """Q4_0 / Q4_1 / Q4_K / Q5_0 / Q8_0 / Q6_K blocks → flat fp32 with torch's vectorised ops
    (the gguf package's numpy path took ~5 s for SmolLM2, this ~0.3 s; a V2-Lite Q4_K_M's 13
    Q6_K tensors ~5.5 s in numpy); None for other types. Q8_0 x = d·q."""
    if qname not in _CHUNKED and qname not in EXACT_INT4:
        return None
    return _chunked_values(data, qname)


def _chunked_values(data: np.ndarray, qname: str) -> torch.Tensor:
    """Blocks → flat fp32, in cache-sized chunks (see _VALUES_A_PASS)."""
    per = 256 if qname in ("Q6_K", "Q4_K") else 32  # values a block
    nbytes = _BLOCK_BYTES[qname]
    data = data.reshape(-1)  # a tensor's bytes (a view: the map is contiguous)
    blocks = data.shape[0] // nbytes
    out = torch.empty(blocks, per)
    step = _VALUES_A_PASS // per
    for start in range(0, blocks, step):
        values, chunk = out[start : start + step], data[start * nbytes : (start + step) * nbytes]
        if qname in EXACT_INT4:  # Q4_0 x = d·(q − 8); Q4_1 and Q4_K x = d·q + m
            q, d, m = q4_codes(chunk, qname)
            groups = values.view(-1, 32)
            if m is None:
                groups.copy_(q).sub_(8).mul_(d)  # (not torch.sub on uint8: it wraps)
            else:
                torch.mul(q, d, out=groups)
                groups.add_(m)
            continue
        raw = file_bytes(chunk).view(-1, nbytes)
        if qname == "Q6_K":
            _q6_k_values(raw, values)
            continue
        d = raw[:, 0:2].contiguous().view(torch.float16).float()  # [n, 1]
        q = _q8_0_codes(raw) if qname == "Q8_0" else _q5_0_codes(raw)
        torch.mul(q, d, out=values)
    return out.reshape(-1)


def _q6_k_values(raw: torch.Tensor, out: torch.Tensor) -> None:
    """Q6_K super-blocks of 256 [n, 210] → values [n, 256] (out), the gguf package's steps
    in fp32: 128 bytes of low nibbles (ql), 64 of high 2-bit pairs (qh), 16 int8 scales of 16
    weights each, fp16 d; weight 32·j + i (j < 8) has q = (low | high << 4) − 32 from ql's
    half j // 4, nibble (j // 2) % 2 and qh's half j // 4, bit pair j % 4, and x = (d·sc)·q."""
    n = raw.shape[0]
    ql = raw[:, :128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    qh = raw[:, 128:192].reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(
        4, 1
    )
    low = (ql & 15).reshape(n, 8, 32)
    high = (qh & 3).reshape(n, 8, 32)
    q = (low | (high << 4)).view(torch.int8).float() - 32  # [n, 8, 32]
    sc = raw[:, 192:208].contiguous().view(torch.int8).float()  # [n, 16]
    d = raw[:, 208:210].contiguous().view(torch.float16).float()  # [n, 1]
    torch.mul((d * sc)[..., None], q.view(n, 16, 16), out=out.view(n, 16, 16))


def _q8_0_codes(raw: torch.Tensor) -> torch.Tensor:
    """Q8_0 (fp16 d, 32 int8 codes; x = d·q) → q as fp32 [n, 32]."""
    return raw[:, 2:].contiguous().view(torch.int8).float()


def _q5_0_codes(raw: torch.Tensor) -> torch.Tensor:
    """Q5_0 (fp16 d; 4 bytes of high bits, weight j's in bit j of the little-endian u32; 16
    bytes of low nibbles, weights 0..15 low, 16..31 high; x = d·(q − 16)) → q − 16 as fp32
    [n, 32]. The type llama-quantize gives Q4_K_M's rows that are not whole super-blocks
    (SmolLM2's 576, DeepSeek-V2-Lite's experts' 1,408)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    high = ((raw[:, 2:6, None] >> shifts) & 1).reshape(-1, 32)  # [n, 32]: byte j // 8, bit j % 8
    low = torch.cat([raw[:, 6:] & 15, raw[:, 6:] >> 4], dim=1)  # [n, 32]
    return (low | (high << 4)).float() - 16


_CHUNKED = ("Q8_0", "Q5_0", "Q6_K")  # decoded by _chunked_values, beside EXACT_INT4's
# Values decoded a pass: ~4 MB of fp32, so each pass's temporaries stay in cache (a whole
# 184M-weight expert stack at once ran ~4× slower, memory-bound; V2-Lite's Q4_K embedding,
# 210M weights, 3.9 s whole and 0.56 s in such chunks, session 37).
_VALUES_A_PASS = 1 << 20


def iter_gguf_tensors(
    reader: GGUFFile, cfg: ModelConfig, skip: frozenset[str] | set[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF-style name, fp32 tensor) one at a time, so only one dequantised copy is live
    (a stack of routed experts is one tensor); tensors named in `skip` (GGUF names, loaded
    another way) are left out."""
    tensors = _dequantised(reader, skip)
    if cfg.mla is not None:  # DeepSeek-V2/V3: experts stacked, kv_b split (gguf_deepseek.py)
        named = gguf_deepseek.hf_tensors(tensors, hf_name)
    else:
        named = ((hf_name(n), n, w) for n, w in tensors)
    for name, gguf_name, w in named:
        if name is None:
            raise ValueError(
                f"unexpected GGUF tensor {gguf_name!r}; this GGUF has tensors dsinfer "
                f"does not know for {cfg.architecture}"
            )
        heads = permuted_heads(name, cfg)
        yield name, w if heads is None else unpermute_rows(w, heads)


def _dequantised(
    reader: GGUFFile, skip: frozenset[str] | set[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, fp32 tensor in torch's dim order) for every tensor not in `skip`."""
    for t in reader.tensors:
        if t.name in skip:
            continue
        w = dequantised(t)
        reader.release(t)  # copied out: the file's pages need not stay resident
        yield t.name, w


def dequantised(t: GGUFTensor) -> torch.Tensor:
    """One GGUF tensor as fp32 in torch's dim order (a copy: the file map stays unwritten)."""
    qname = t.tensor_type.name
    if qname not in _SUPPORTED_QTYPES:
        raise ValueError(
            f"GGUF tensor {t.name} uses quantisation {qname}, which dsinfer "
            f"cannot dequantise; supported: {sorted(_SUPPORTED_QTYPES)}"
        )
    shape = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
    return block_values(t.data, t.tensor_type).reshape(shape)


def block_values(data: np.ndarray, tensor_type: gguf.GGMLQuantizationType) -> torch.Tensor:
    """A tensor's bytes, or a slice of whole rows of them, as flat fp32 (a copy)."""
    w = _fast_dequantize(data, tensor_type.name)
    if w is None:
        arr = gguf.quants.dequantize(data, tensor_type)
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not arr.flags.writeable:  # F32 tensors come back as a read-only view of the mmap
            arr = arr.copy()
        w = torch.from_numpy(arr)
    return w.reshape(-1)
