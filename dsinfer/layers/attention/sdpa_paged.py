"""Paged attention for accelerators: decode rows through one fused SDPA call per layer.

The reference's decode (torch_paged.py) spells attention out as two batched matmuls around a
masked fp32 softmax: on a GPU that is ~8 kernels a layer and a [B, H, L] score tensor written
to and read back from memory. Here the decode rows go through
`F.scaled_dot_product_attention`, which dispatches to the device's fused kernel (on CUDA the
memory-efficient one: a boolean mask rules out flash), computing scores, softmax and the
weighted values in one pass with fp32 accumulation:
- the block tables' blocks are gathered straight into [B, KV, L, D] (one indexing kernel on the
  heads-first view of the pool; the reference gathers [B, NB, KV, bs, D] and permutes later);
- grouped-query heads need no expansion: the G query heads that share a KV head are that head's
  G query rows ([B, KV, G, D] against [B, KV, L, D]);
- fixed shapes for fixed metadata shapes and no host syncs, so a step graph can record it
  (worker/decode_graphs.py).

Prefill chunks keep the reference's exact fp32 SDPA. Registered for CUDA as the `fused`
backend's MHA; the parity tests run it on the CPU against the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.layers.attention.backend import AttentionMetadata
from dsinfer.layers.attention.registry import register_attention
from dsinfer.layers.attention.torch_paged import TorchPagedAttention


@register_attention("fused", "cuda", "mha")
class SdpaPagedAttention(TorchPagedAttention):
    graph_safe_decode = True

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q [B, H, D] → [B, H, D] over each row's cached tokens (its K/V already written)."""
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        b = q.shape[0]
        kv, g, d = self.num_kv_heads, self.group, self.head_dim
        keys = _gather_heads_first(kc, meta.decode_block_tables)  # [B, KV, L, D]
        vals = _gather_heads_first(vc, meta.decode_block_tables)
        qh = q.view(b, kv, g, d).to(kc.dtype)  # the G heads of a KV head as its G query rows
        keep = ~meta.decode_mask  # [B, 1, 1, L], True = attend; broadcast over KV and G
        o = F.scaled_dot_product_attention(qh, keys, vals, attn_mask=keep, scale=self.scale)
        return o.reshape(b, kv * g, d).to(q.dtype)  # [B, KV, G, D] → [B, H, D]


def _gather_heads_first(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [N, KV, bs, D], tables [B, NB] → [B, KV, NB·bs, D] (a view of one gathered copy).

    Indexing the heads-first view gathers [KV, B, NB, bs, D] contiguously; moving B to the front
    is a view, and NB and bs then merge into one token axis without a copy."""
    b, nb = tables.shape
    kv, bs, d = cache.shape[1:]
    gathered = cache.transpose(0, 1)[:, tables]  # [KV, B, NB, bs, D]
    return gathered.transpose(0, 1).reshape(b, kv, nb * bs, d)
