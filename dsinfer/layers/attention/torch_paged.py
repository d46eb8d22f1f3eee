"""Reference paged attention in plain PyTorch (CPU and any device torch supports).

Decodes are batched: their keys are gathered through the block tables into a padded
[B, Lmax] layout and masked. Prefill chunks run one sequence each through SDPA with a causal
mask offset by the tokens already cached. Softmax always runs in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.layers.attention.backend import AttentionBackend, AttentionMetadata


class TorchPagedAttention(AttentionBackend):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache  # [blocks, bs, KV, D]
        kc = k_cache.view(-1, self.num_kv_heads, self.head_dim)  # [blocks*bs, KV, D]
        vc = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        kc.index_copy_(0, meta.slot_mapping, k.to(kc.dtype))
        vc.index_copy_(0, meta.slot_mapping, v.to(vc.dtype))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if meta.num_decode:
            out[: meta.num_decode] = self._decode(q[: meta.num_decode], k_cache, v_cache, meta)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            if p.ctx_len == p.q_len:  # nothing cached before: use the fresh keys directly
                ks, vs = k[rows], v[rows]
            else:
                ks, vs = kc[p.slots], vc[p.slots]
            out[rows] = self._prefill(q[rows], ks, vs, p.ctx_len - p.q_len)
        return out

    def _decode(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        b = q.shape[0]
        kv, g, d = self.num_kv_heads, self.group, self.head_dim
        qf = q.float().view(b, kv, g, d)  # [B, KV, G, D]
        bt = meta.decode_block_tables
        keys = kc[bt].view(b, -1, kv, d).float().permute(0, 2, 3, 1)  # [B, KV, D, L]
        vals = vc[bt].view(b, -1, kv, d).float().transpose(1, 2)  # [B, KV, L, D]
        scores = torch.matmul(qf, keys) * self.scale  # [B, KV, G, L]
        scores.masked_fill_(meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        return torch.matmul(probs, vals).view(b, kv * g, d).to(q.dtype)  # [B, H, D]

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_before: int
    ) -> torch.Tensor:
        ql, ctx = q.shape[0], k.shape[0]
        qh = q.float().transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
        kh = k.float().transpose(0, 1).unsqueeze(0)  # [1, KV, C, D]
        vh = v.float().transpose(0, 1).unsqueeze(0)
        if num_before == 0:
            o = F.scaled_dot_product_attention(
                qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=self.group > 1
            )
        else:
            qpos = torch.arange(num_before, num_before + ql, device=q.device).unsqueeze(1)
            mask = torch.arange(ctx, device=q.device).unsqueeze(0) <= qpos  # [Q, C] True = attend
            o = F.scaled_dot_product_attention(
                qh, kh, vh, attn_mask=mask, scale=self.scale, enable_gqa=self.group > 1
            )
        return o.squeeze(0).transpose(0, 1).to(q.dtype)  # [Q, H, D]
