"""Pipeline-parallel forward pass: each stage runs its own decoder layers in turn.

Stage 0 embeds and runs its layers, sends (hidden, residual) [2, T, H] to the next stage, …; the
last stage applies the final norm and sends the hidden states back to stage 0, which holds the
scheduler, the LM head and the sampler. With tensor parallel inside the stages, every rank has
the whole hidden states after its layer's all-reduce, so rank i of a stage sends to rank i of
the next. All stages know T from the broadcast SchedulerOutput, so every
receive buffer is sized without a handshake. Tensors travel as fp32 (exact for bf16; gloo's
point-to-point has no bf16).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dsinfer.distributed.parallel_state import parallel_state


def _send(x: torch.Tensor, dst: int) -> None:
    dist.send(x.float().contiguous(), dst=dst)


def _recv(
    shape: tuple[int, ...], dtype: torch.dtype, src: int, device: torch.device
) -> torch.Tensor:
    buf = torch.empty(shape, dtype=torch.float32, device=device)
    dist.recv(buf, src=src)
    return buf.to(dtype)


def pipeline_forward(
    model: Any, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: Any
) -> torch.Tensor:
    """This stage's part of the forward pass; on stage 0, the final hidden states [T, H]."""
    state = parallel_state()
    stage, stages = state.pp_rank, state.pp_size
    inner = model.model
    dtype = inner.norm.weight.dtype  # the embedding lives on stage 0 only
    t, h = input_ids.shape[0], model.config.hidden_size
    rope = inner.rotary.cos_sin(positions, dtype)
    if stage == 0:
        x, residual = inner.embed_tokens(input_ids), None
    else:
        both = _recv((2, t, h), dtype, state.global_rank(stage - 1), input_ids.device)
        x, residual = both[0], both[1]
    for i in state.stage_layers(len(inner.layers)):
        x, residual = inner.layers[i](x, residual, rope, kv_caches[i], meta)
    if stage < stages - 1:
        _send(torch.stack([x, residual]), state.global_rank(stage + 1))
        if stage:
            return x  # a middle stage: done
        return _recv((t, h), dtype, state.global_rank(stages - 1), input_ids.device)
    x, _ = inner.norm(x, residual)
    _send(x, state.global_rank(0))
    return x
