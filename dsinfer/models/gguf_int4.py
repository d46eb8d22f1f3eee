"""A 4-bit GGUF (Q4_0, Q4_1, Q4_K_M, …) straight into the int4 layout: no float copy.

GGUF's 4-bit blocks are our int4 groups of 32: a Q4_1 block is x = d·q + m, which is
(q − 8)·d + (m + 8d), our (q − 8)·scale + zero with scale = d and zero = m + 8d; a Q4_0 block
is x = d·(q − 8), zero = 0; a Q4_K super-block is 8 such groups, each with its own scale and
minimum. So the codes are packed for the kernel as they are, and only the scales and minima
are converted (fp32 → the activation dtype of the scales). The fused projections (q|k|v,
gate|up) are packed once all their checkpoint shards have arrived. DeepSeek's routed experts
(one [E, out, in] stack per projection, gguf_deepseek.py) are packed the same way when
their gate and up stacks are 4-bit (a Q4_K_M file's Q5_0/Q8_0/Q6_K down stack is quantised to
int4 beside them: a stack has one format): for the fused backend straight into its own int4
layout, an expert at a time (gguf_int4_vnni_into: one pass, no torch layout to repack), else
into torch's, two experts a pass. Everything else (norms, the
embedding, layers of other types) is dequantised one tensor at a time and quantised as each
layer completes (QuantiseOnLoad): under `--quantization auto` a layer the file holds in 5 to
8 bits (a Q4_K_M file's Q6_K and Q5_0 layers) becomes int8, never fewer bits than the file
chose (`keep_file_precision`); under `int4` it becomes int4, as `dsinfer compile` would.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from dsinfer.config import ModelConfig
from dsinfer.layers.int4_pack import int4pack_from_codes
from dsinfer.layers.kernels import Kernels
from dsinfer.layers.kernels.cpu_build import load_cpu_ops
from dsinfer.layers.linear import Linear, fused_target
from dsinfer.layers.moe import RoutedExperts
from dsinfer.layers.quant import (
    experts_method,
    fused_int4_stacks,
    int4_codes,
    int4_pairs,
    quant_method,
    quantizable_linears,
    routed_experts,
)
from dsinfer.models.gguf_deepseek import expert_stacks
from dsinfer.models.gguf_file import (
    EXACT_INT4,
    block_values,
    file_bytes,
    hf_name,
    native_format,
    permuted_heads,
    q4_codes,
    unpermute_rows,
)
from dsinfer.models.gguf_reader import GGUFFile, GGUFTensor

logger = logging.getLogger(__name__)
GROUP = 32


def q4_blocks(data: np.ndarray, qname: str, rows: int) -> tuple[torch.Tensor, ...]:
    """One Q4_0/Q4_1/Q4_K tensor's bytes → codes [rows, K] (uint8, 0..15), scale and zero
    [rows, K / 32] fp32 such that x = (q − 8)·scale + zero (torch's ops: int4_groups' fallback
    and the definition the kernel is tested against)."""
    q, d, m = q4_codes(data, qname)
    zero = m + 8 * d if m is not None else torch.zeros_like(d)
    return q.view(rows, -1), d.view(rows, -1), zero.view(rows, -1)


# The block types the fused kernels' one-pass decoder takes (cpu_ops.cpp: gguf_int4_groups).
_KERNEL_TYPES = {"Q4_0": 0, "Q4_1": 1, "Q4_K": 2, "Q5_0": 3, "Q8_0": 4}


def int4_groups(
    data: np.ndarray, tensor_type: GGMLQuantizationType, rows: int, in_f: int
) -> tuple[torch.Tensor, ...]:
    """Whole rows of a GGUF tensor's bytes → codes [rows, in_f] (uint8, 0..15), scale and
    zero [rows, in_f / 32] fp32: a 4-bit type's blocks as they are, another type's values (a
    Q4_K_M file's Q5_0/Q8_0/Q6_K expert down stacks) quantised as compile would (int4_codes).
    In one pass by the fused kernels where they load (the same bits as torch's passes, ~10x
    faster), else with torch's ops."""
    qname = tensor_type.name
    if qname in _KERNEL_TYPES and load_cpu_ops() is None:
        raw = file_bytes(data.reshape(-1))
        return torch.ops.dsinfer.gguf_int4_groups(raw, _KERNEL_TYPES[qname], rows, in_f)
    if qname in EXACT_INT4:
        return q4_blocks(data, qname, rows)
    return int4_codes(block_values(data, tensor_type).view(rows, in_f), GROUP)


def pack_gguf_int4(
    net: nn.Module,
    reader: GGUFFile,
    cfg: ModelConfig,
    dtype: torch.dtype,
    formats: dict[str, str],
    kernels: Kernels | None = None,
) -> set[str]:
    """Pack every Q4 projection of an int4-format layer into `net` (float, unsplit: one
    process; `formats`: plan_formats under int4, groups of GROUP); returns the GGUF names it
    consumed (the generic loader takes the rest). `kernels`: those the model will run on; the
    expert stacks are written in their layout at once where it is the fused int4 one."""
    layers = {n: m for n, m in quantizable_linears(net) if formats.get(n, "int4") == "int4"}
    packed: dict[str, tuple[str, str]] = getattr(net, "packed_modules", {})
    pending: dict[str, dict[str | None, tuple[torch.Tensor, ...]]] = {}
    direct: set[str] = set()
    for t in reader.tensors:
        name = hf_name(t.name)
        if t.tensor_type.name not in EXACT_INT4 or name is None:
            continue
        target, shard = fused_target(name, packed)
        module = target.removesuffix(".weight")
        if module not in layers or not target.endswith(".weight"):
            continue
        direct.add(t.name)
        q, scale, zero = int4_groups(t.data, t.tensor_type, int(t.shape[1]), int(t.shape[0]))
        reader.release(t)
        heads = permuted_heads(name, cfg)
        if heads is not None:
            q, scale, zero = (unpermute_rows(x, heads) for x in (q, scale, zero))
        pending.setdefault(module, {})[shard] = (q, scale, zero)
        layer = layers[module]
        if set(pending[module]) >= set(layer.shards or [None]):
            _pack(layer, pending.pop(module), dtype)
    if pending:
        raise ValueError(f"GGUF lacks shards of {sorted(pending)}: incomplete checkpoint")
    return direct | _pack_experts(net, reader, formats, dtype, kernels)


def _pack_experts(
    net: nn.Module,
    reader: GGUFFile,
    formats: dict[str, str],
    dtype: torch.dtype,
    kernels: Kernels | None,
) -> set[str]:
    """Every int4-format stack of routed experts whose GGUF gate and up stacks are 4-bit,
    packed from the blocks (a down stack of another type quantised to int4); the GGUF names
    consumed."""
    stacks = expert_stacks(reader)
    direct: set[str] = set()
    for name, experts in routed_experts(net):
        found = stacks.get(name)
        if formats.get(name, "int4") != "int4" or found is None:
            continue
        if any(t.tensor_type.name not in EXACT_INT4 for k, t in found.items() if k != "down"):
            continue
        _pack_expert_stacks(experts, found, dtype, kernels)
        for t in found.values():
            reader.release(t)
        direct.update(t.name for t in found.values())
    return direct


# Experts decoded and packed a pass: a pass's temporaries stay in cache (a DeepSeek-V2-Lite
# expert is 2.9M weights: 2.9 MB of codes, 11.5 MB as fp32 for a Q8_0 down stack). Whole
# stacks at once (184M weights) spent ~60 s of its 70 s load in memory-bound torch passes.
_EXPERTS_A_PASS = 2


def _pack_expert_stacks(
    experts: RoutedExperts,
    found: dict[str, GGUFTensor],
    dtype: torch.dtype,
    kernels: Kernels | None,
) -> None:
    """gate | up (w13) and down (w2) stacks → Int4ExpertsMethod's q / sz stacks: in the fused
    kernels' layout where `kernels` take it (_write_fused_layout), else in torch's, a few
    experts at a time (_EXPERTS_A_PASS)."""
    n = experts.num_experts
    gate_up = [found["gate_up"]] if "gate_up" in found else [found["gate"], found["up"]]
    method = experts_method("int4", GROUP)
    experts.set_method(method)
    projections = (("13", gate_up), ("2", [found["down"]]))
    for which, stacks in projections:
        out_f, in_f = _stack_dims(stacks)
        want = tuple(getattr(experts, f"q{which}").shape)
        if (n, out_f, in_f // 2) != want:
            raise ValueError(
                f"GGUF expert stack {(n, out_f, in_f // 2)} does not match the model's {want}"
            )
    fused = kernels is not None and method.repacks(experts, kernels, "cpu")
    if fused and all(_one_pass(t) for _, stacks in projections for t in stacks):
        for which, stacks in projections:
            _write_fused_layout(experts, which, stacks)
        method.vnni = True  # use_kernels' repack has nothing left to do
        return
    for which, stacks in projections:
        out_f, in_f = _stack_dims(stacks)
        q = torch.empty(n, out_f, in_f // 2, dtype=torch.uint8)
        sz = torch.empty(n, in_f // GROUP, out_f, 2, dtype=dtype)
        for e0 in range(0, n, _EXPERTS_A_PASS):
            e1 = min(n, e0 + _EXPERTS_A_PASS)
            parts = [_expert_codes(t, n, e0, e1) for t in stacks]  # joined along `out`
            codes, scale, zero = (torch.cat([p[i] for p in parts], dim=1) for i in range(3))
            q[e0:e1] = int4pack_from_codes(codes)
            sz[e0:e1] = int4_pairs(scale, zero, dtype)  # [e, G, out, 2]
        getattr(experts, f"q{which}").data = q
        getattr(experts, f"sz{which}").data = sz


def _stack_dims(stacks: list[GGUFTensor]) -> tuple[int, int]:
    """(out, in) of one projection's GGUF stacks joined along `out` (dims [in, out, E])."""
    return sum(int(t.shape[1]) for t in stacks), int(stacks[0].shape[0])


def _one_pass(t: GGUFTensor) -> bool:
    """Whether gguf_int4_vnni_into takes this stack's blocks (the kernels are loaded wherever
    the fused layout is chosen: Int4ExpertsMethod.repacks)."""
    return t.tensor_type.name in _KERNEL_TYPES and int(t.shape[1]) % 16 == 0


def _write_fused_layout(experts: RoutedExperts, which: str, stacks: list[GGUFTensor]) -> None:
    """One projection's GGUF stacks (gate and up, joined along `out`; or down) → the fused
    int4 layout of Int4ExpertsMethod._repack_for_vnni, an expert's rows at a time straight from
    the blocks: q [E, out/16, in/8, 64], sz [E, out/16, in/32, 2, 16] bf16."""
    n = experts.num_experts
    out_f, in_f = _stack_dims(stacks)
    q, sz = fused_int4_stacks(n, out_f, in_f, GROUP)
    lo = 0  # the stack's first block of 16 rows in `out`
    for t in stacks:
        raw = t.data.reshape(-1)
        per = raw.shape[0] // n  # bytes an expert: whole rows of blocks
        code, rows = _KERNEL_TYPES[t.tensor_type.name], int(t.shape[1])
        for e in range(n):
            torch.ops.dsinfer.gguf_int4_vnni_into(
                file_bytes(raw[e * per : (e + 1) * per]),
                code,
                rows,
                in_f,
                q[e, lo : lo + rows // 16],
                sz[e, lo : lo + rows // 16],
            )
        lo += rows // 16
    getattr(experts, f"q{which}").data = q
    getattr(experts, f"sz{which}").data = sz


def _expert_codes(t: GGUFTensor, n: int, e0: int, e1: int) -> tuple[torch.Tensor, ...]:
    """Experts [e0, e1) of a GGUF stack of n (dims [in, out, E] innermost first) → codes
    [e, out, in], scale and zero [e, out, in / 32]: a 4-bit stack's blocks as they are, another
    type's values (a Q4_K_M file's Q5_0/Q8_0/Q6_K down) quantised as compile would."""
    out_f, in_f = int(t.shape[1]), int(t.shape[0])
    raw = t.data.reshape(-1)
    per = raw.shape[0] // n  # bytes an expert: whole rows of blocks
    q, scale, zero = int4_groups(raw[e0 * per : e1 * per], t.tensor_type, (e1 - e0) * out_f, in_f)
    e = e1 - e0
    return q.view(e, out_f, in_f), scale.view(e, out_f, -1), zero.view(e, out_f, -1)


def keep_file_precision(
    net: nn.Module, reader: GGUFFile, formats: dict[str, str]
) -> dict[str, str]:
    """`formats` (plan_formats under int4) with every int4 layer the file holds in more than
    4 bits made int8, and every int4 expert stack whose gate and up it holds so: a Q4_K_M
    file's Q6_K / Q5_0 / Q8_0 layers keep 8 bits, never fewer than the file chose. A fused
    layer (q|k|v, gate|up) is int8 when any of its parts is."""
    packed: dict[str, tuple[str, str]] = getattr(net, "packed_modules", {})
    eight_bit: set[str] = set()
    for t in reader.tensors:
        name = hf_name(t.name)
        if name is not None and native_format(t.tensor_type.name) == "int8":
            eight_bit.add(fused_target(name, packed)[0].removesuffix(".weight"))
    stacks = expert_stacks(reader)
    kept = dict(formats)
    for name, _ in quantizable_linears(net):
        if name in eight_bit and formats.get(name, "int4") == "int4":
            kept[name] = "int8"
    for name, _ in routed_experts(net):
        parts = [t for k, t in stacks.get(name, {}).items() if k != "down"]
        wide = any(native_format(t.tensor_type.name) == "int8" for t in parts)
        if wide and formats.get(name, "int4") == "int4":
            kept[name] = "int8"
    if kept != formats:
        logger.info(
            "%d layers the file holds in 5 to 8 bits load as int8 (--quantization int4: int4)",
            len(kept) - len(formats),
        )
    return kept


def _pack(layer: Linear, shards: dict[str | None, tuple[torch.Tensor, ...]], dtype) -> None:  # noqa: ANN001
    order = list(layer.shards) or [None]
    q, scale, zero = (torch.cat([shards[s][i] for s in order]) for i in range(3))
    if tuple(q.shape) != (layer.out_features, layer.in_features):
        raise ValueError(
            f"GGUF projection {tuple(q.shape)} does not match the model's "
            f"{(layer.out_features, layer.in_features)}"
        )
    layer.set_method(quant_method("int4", GROUP))  # type: ignore[arg-type]
    layer.qweight.data = int4pack_from_codes(q)
    layer.scales_zeros.data = int4_pairs(scale, zero, dtype)
