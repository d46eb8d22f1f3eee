"""A Q4_0 / Q4_1 GGUF straight into the int4 layout: no float copy of the projections.

GGUF's 4-bit blocks are our int4 groups of 32: a Q4_1 block is x = d·q + m, which is
(q − 8)·d + (m + 8d), our (q − 8)·scale + zero with scale = d and zero = m + 8d; a Q4_0 block
is x = d·(q − 8), zero = 0. So the codes are packed for the kernel as they are, and only d and
m are converted (fp16 → the activation dtype of the scales). The fused projections (q|k|v,
gate|up) are packed once all their checkpoint shards have arrived. Everything else (norms,
the embedding, a layer whose format is not int4) is dequantised and loaded as before, then
quantised as `dsinfer compile` would (the LM head to int8).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from dsinfer.config import ModelConfig
from dsinfer.layers.linear import Linear
from dsinfer.layers.quant import apply_format, plan_formats, quant_method, quantizable_linears
from dsinfer.models.gguf_file import _BLOCK_BYTES, hf_name, unpermute_rows
from dsinfer.models.gguf_reader import GGUFFile

logger = logging.getLogger(__name__)
GROUP = 32


def q4_blocks(data: torch.Tensor, qname: str, rows: int) -> tuple[torch.Tensor, ...]:
    """One Q4_0/Q4_1 tensor's bytes → codes [rows, K] (int32, 0..15), scale and zero
    [rows, K / 32] fp32 such that x = (q − 8)·scale + zero."""
    raw = data.view(-1, _BLOCK_BYTES[qname])  # [blocks, bytes]
    d = raw[:, 0:2].contiguous().view(torch.float16).float().view(rows, -1)
    codes = raw[:, 4:] if qname == "Q4_1" else raw[:, 2:]
    q = torch.cat([codes & 15, codes >> 4], dim=1).to(torch.int32).view(rows, -1)
    if qname == "Q4_1":
        m = raw[:, 2:4].contiguous().view(torch.float16).float().view(rows, -1)
        return q, d, m + 8 * d
    return q, d, torch.zeros_like(d)


def pack_gguf_int4(
    net: nn.Module, reader: GGUFFile, cfg: ModelConfig, dtype: torch.dtype
) -> set[str]:
    """Pack every Q4 projection of an int4-format layer into `net` (float, unsplit: one
    process); returns the GGUF names it consumed (the generic loader takes the rest)."""
    formats = plan_formats(net, "int4", GROUP)
    layers = {n: m for n, m in quantizable_linears(net) if formats.get(n, "int4") == "int4"}
    packed: dict[str, tuple[str, str]] = getattr(net, "packed_modules", {})
    pending: dict[str, dict[str | None, tuple[torch.Tensor, ...]]] = {}
    direct = {
        t.name
        for t in reader.tensors
        if t.tensor_type.name in ("Q4_0", "Q4_1") and _target(hf_name(t.name), packed)[0] in layers
    }
    permute = cfg.architecture == "LlamaForCausalLM"
    for t in reader.tensors:
        if t.name not in direct:
            continue
        name = hf_name(t.name)
        module, shard = _target(name, packed)
        rows = int(t.shape[1])
        q, scale, zero = q4_blocks(torch.from_numpy(t.data.copy()), t.tensor_type.name, rows)
        if permute and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_heads if name.endswith("q_proj.weight") else cfg.num_kv_heads
            q, scale, zero = (unpermute_rows(x, heads) for x in (q, scale, zero))
        pending.setdefault(module, {})[shard] = (q, scale, zero)
        layer = layers[module]
        if set(pending[module]) >= set(layer.shards or [None]):
            _pack(layer, pending.pop(module), dtype)
    if pending:
        raise ValueError(f"GGUF lacks shards of {sorted(pending)}: incomplete checkpoint")
    return direct


def finish_gguf_int4(net: nn.Module, dtype: torch.dtype) -> None:
    """After the generic load: the layers left float under int4 (the LM head → int8)."""
    formats = plan_formats(net, "int4", GROUP)
    for name, layer in quantizable_linears(net):
        fmt = formats.get(name, "int4")
        if fmt == "int8":
            apply_format(layer, fmt, GROUP, dtype)
    logger.info("GGUF Q4 weights loaded as int4 without a float copy")


def _target(name: str | None, packed: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    """Checkpoint name → (our Linear module's name, shard) under the packed-module rule."""
    if name is None or not name.endswith(".weight"):
        return "", None
    parts = name.split(".")
    if parts[-2] in packed:
        module, shard = packed[parts[-2]]
        return ".".join(parts[:-2] + [module]), shard
    return ".".join(parts[:-1]), None


def _pack(layer: Linear, shards: dict[str | None, tuple[torch.Tensor, ...]], dtype) -> None:  # noqa: ANN001
    order = list(layer.shards) or [None]
    q, scale, zero = (torch.cat([shards[s][i] for s in order]) for i in range(3))
    if tuple(q.shape) != (layer.out_features, layer.in_features):
        raise ValueError(
            f"GGUF projection {tuple(q.shape)} does not match the model's "
            f"{(layer.out_features, layer.in_features)}"
        )
    layer.set_method(quant_method("int4", GROUP))  # type: ignore[arg-type]
    layer.qweight.data = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    layer.scales_zeros.data = torch.stack([scale.t(), zero.t()], dim=-1).to(dtype).contiguous()
