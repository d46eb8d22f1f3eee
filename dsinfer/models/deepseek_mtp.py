"""DeepSeek-V3 multi-token prediction (MTP) module, depth 1, used as a self-speculative drafter.

Checkpoint layer `model.layers.{num_hidden_layers}` holds it: a full decoder layer (MLA + MoE)
plus `enorm`, `hnorm`, `eh_proj` and `shared_head.norm`. At position i it combines the main
model's final hidden state h_i (which predicted token i+1) with the embedding of token i+1 and
predicts token i+2:

    x_i = eh_proj([enorm(embed(t_{i+1})) ; hnorm(h_i)])      # [T, 2·hidden] → [T, hidden]
    draft_{i+2} = argmax lm_head(shared_head.norm(layer(x_i)))

Its embedding and output head are the main model's (DeepSeek-V3 shares them), so the copies a
checkpoint carries under the MTP prefix are not loaded. Like vLLM and SGLang, h_i is the main
model's normed output. The layer keeps its own (extra) layer of the paged KV cache.
"""

from __future__ import annotations

import torch
from torch import nn

from dsinfer.config import ModelConfig
from dsinfer.layers.linear import Linear
from dsinfer.layers.norm import RMSNorm


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def build_mtp_layer(cfg: ModelConfig, layer_cls: type[nn.Module]) -> nn.Module:
    """A decoder layer (index num_layers: MoE like the last layers) with the MTP parts added."""
    layer = layer_cls(cfg, cfg.num_layers)
    layer.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    layer.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    layer.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
    layer.shared_head = SharedHead(cfg)
    return layer


def mtp_forward(
    mtp: nn.Module,
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache: tuple[torch.Tensor, ...],
    meta: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """embeds, hidden: [T, hidden] → (normed MTP output [T, hidden], for logits via the LM
    head; the layer's output before that norm, the hidden state a chained MTP step takes as
    its `hidden`, as vLLM chains a depth-1 MTP layer)."""
    e, _ = mtp.enorm(embeds)
    h, _ = mtp.hnorm(hidden)
    x = mtp.eh_proj(torch.cat([e, h], dim=-1))  # [T, 2·hidden] → [T, hidden]
    x, residual = mtp(x, None, rope, cache, meta)
    out, state = mtp.shared_head.norm(x, residual)
    return out, state


def map_mtp_name(name: str, prefix: str) -> str | None:
    """`model.layers.{N}.X` → `mtp.X`; None for the shared embedding/head copies (skipped)."""
    rest = name[len(prefix) :]
    if rest.startswith(("embed_tokens.", "shared_head.head.")):
        return None
    return f"mtp.{rest}"
