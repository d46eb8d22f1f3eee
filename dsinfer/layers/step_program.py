"""The decode step as one program (the fused CPU backend's compiled step).

A model whose decoder stack the program can express captures it once after loading and binding
the KV pool (`capture_step_program`): weights in their kernel layouts, norms, KV pages and the
rotary tables are bound into a C++ `DecodeProgram` (layers/kernels/step_program.cpp), which
then runs every decoder layer of a decode-only step in one call: no Python, no dispatcher and
no tensor wrappers between kernels. Steps with prefill rows (or drafts) stay on the eager path.

Capture is all or nothing: a layer the program cannot express (a tensor-parallel cut, a weight
format without a program kernel, another attention) leaves the model eager, with the reason
logged once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from dsinfer.layers.attention import AttentionMetadata
from dsinfer.layers.linear import Linear, ProgramOperand
from dsinfer.layers.norm import RMSNorm

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProgramLayer:
    """One pre-norm decoder layer as the program runs it: input norm, qkv, rotary + KV write +
    paged attention, o, post-attention norm, gate|up, SiLU·mul, down."""

    input_norm: RMSNorm
    qkv: Linear
    o: Linear
    post_norm: RMSNorm
    gate_up: Linear
    down: Linear
    kv_cache: tuple[torch.Tensor, torch.Tensor]


class StepProgram:
    """A captured decode step: `run` takes the embedded decode tokens of a decode-only step."""

    def __init__(self, program: torch.ScriptObject) -> None:
        self._program = program

    @staticmethod
    def takes(rows: int, meta: AttentionMetadata) -> bool:
        """Whether the program can run this step: every row a single-token decode."""
        return meta.num_decode == rows and not meta.prefills and meta.decode_seq_lens is not None

    def run(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: [B, hidden] embedded tokens → final-normed hidden states [B, hidden]."""
        # One range around the call (a few µs a step): the profiler shows the program's
        # kernels under the one call Python made.
        with record_function("dsinfer::DecodeProgram.run"):
            return self._program.run(x, meta.decode_block_tables, meta.decode_seq_lens)


def capture_step_program(
    layers: list[ProgramLayer],
    final_norm: RMSNorm,
    table_cos: torch.Tensor,
    table_sin: torch.Tensor,
    shape: dict[str, float],
) -> StepProgram | str:
    """Bind the layers into a DecodeProgram; or say why they cannot be (the step stays eager).

    `shape`: num_heads, num_kv_heads (this rank's), scale, eps — shared by every layer."""
    if table_cos.dtype != torch.float32:
        return "the rotary tables are not fp32"
    eps = final_norm.eps
    if any(n.eps != eps for layer in layers for n in (layer.input_norm, layer.post_norm)):
        return "the norms do not share one epsilon"
    program = torch.classes.dsinfer.DecodeProgram(
        table_cos,
        table_sin,
        final_norm.weight.data,
        int(shape["num_heads"]),
        int(shape["num_kv_heads"]),
        float(shape["scale"]),
        float(eps),
    )
    for i, layer in enumerate(layers):
        operands = [
            lin.program_operand() for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        for lin, op in zip(("qkv", "o", "gate_up", "down"), operands, strict=True):
            if isinstance(op, str):
                return f"layer {i} {lin}: {op}"
        k_cache, v_cache = layer.kv_cache
        program.add_layer(
            layer.input_norm.weight.data, layer.post_norm.weight.data, k_cache, v_cache
        )
        for lin, op in zip((layer.qkv, layer.o, layer.gate_up, layer.down), operands, strict=True):
            assert isinstance(op, ProgramOperand)
            bias = None if lin.bias is None else lin.bias.data
            program.add_linear(op.kind, op.a.data, _second(op), bias, op.dense_from_rows)
    return StepProgram(program)


def _second(op: ProgramOperand) -> torch.Tensor:
    # The C++ signature takes a tensor; a dense weight has no second one.
    return op.b.data if op.b is not None else torch.empty(0)
