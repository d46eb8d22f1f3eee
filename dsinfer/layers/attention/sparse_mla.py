"""DeepSeek Sparse Attention (DeepSeek-V3.2): MLA restricted, per query, to the `index_topk`
cached tokens a lightning indexer ranks highest.

The indexer (models/deepseek_v2.py, `Indexer`) gives each token a small key (index_head_dim,
cached beside the latent: the layer's cache is the pair (latent [blocks, bs, lora + rope],
index keys [blocks, bs, index_head_dim])) and each query index_n_heads small queries with a
weight each. A query's score of a cached token is

    I(q, t) = Σ_h w_h · relu(scale · q_h · k_t)

and the query attends to the top `index_topk` tokens of its causal context by I (all of them
while the context is no longer than that: the selection then changes nothing and is skipped).
The attention itself is MLA's (the absorbed decode, the naive prefill), with the unselected
tokens masked out.

Ties in I choose by torch.topk's order; the scores are continuous except where every head's
relu is zero (I = 0 exactly), which a trained indexer's 64 heads make vanishingly rare.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dsinfer.layers.attention.backend import AttentionMetadata, PrefillSeq
from dsinfer.layers.attention.fused_cpu import FusedCpuMLAAttention
from dsinfer.layers.attention.mla import MLAPagedAttention
from dsinfer.layers.attention.registry import register_attention
from dsinfer.layers.rotary import StepRope


@dataclass(frozen=True, slots=True)
class IndexQuery:
    """The indexer's side of one step: q [T, index heads, index_head_dim], the heads' weights
    w [T, index heads] (fp32, with the indexer's scale folded in) and this step's tokens' keys
    k [T, index_head_dim], all after rotary."""

    q: torch.Tensor
    w: torch.Tensor
    k: torch.Tensor


@register_attention("reference", "any", "mla_sparse")
class SparseMLAPagedAttention(MLAPagedAttention):
    kind = "mla_sparse"

    def __init__(
        self,
        num_heads: int,
        nope: int,
        rope: int,
        v_dim: int,
        lora: int,
        scale: float,
        index_topk: int,
        index_scale: float,
    ) -> None:
        super().__init__(num_heads, nope, rope, v_dim, lora, scale)
        self.shape.update(index_topk=index_topk, index_scale=index_scale)
        self.index_topk = index_topk
        self.index_scale = index_scale
        self._step: tuple[IndexQuery, torch.Tensor] | None = None

    @property
    def graph_safe_decode(self) -> bool:  # type: ignore[override]
        return False  # the selection is skipped or not by the context's length, on the host

    def forward_sparse(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        c: torch.Tensor,
        index: IndexQuery,
        rope: StepRope,
        cache: tuple[torch.Tensor, torch.Tensor],
        kv_b: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """forward_rope's projections and the indexer's (`index`); `cache` is the pair (latent,
        index keys). Writes this step's index keys, then attends as MLA over the tokens each
        query selects → [T, H, v]."""
        latent_cache, key_cache = cache
        key_cache[meta.slot_blocks, meta.slot_offsets] = index.k.to(key_cache.dtype)
        # The decode and prefill hooks below read the step's indexer queries and key cache:
        # set for this call only (MLA's forward_rope → forward → hooks carry no extra argument).
        self._step = (index, key_cache)
        try:
            return self.forward_rope(q, kv, c, rope, latent_cache, kv_b, meta)
        finally:
            self._step = None

    def _scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Index scores, fp32: q [..., Hi, Di], w [..., Hi], keys [..., C, Di] → [..., C]."""
        s = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * self.index_scale
        return torch.matmul(w.float().unsqueeze(-2), F.relu(s)).squeeze(-2)  # [..., C]

    def _keys(self, key_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
        """The index keys of the blocks of `block_table` [..., NB] → [..., NB · bs, Di]."""
        rows = key_cache.view(key_cache.shape[0], -1).index_select(0, block_table.reshape(-1))
        return rows.view(*block_table.shape[:-1], -1, key_cache.shape[-1])

    def _absorbed(self, q_nope, q_pe, cache, kv_b, meta) -> torch.Tensor:  # noqa: ANN001
        """The absorbed decode, with each row's unselected tokens masked out (rows whose
        context fits in index_topk keep the padding mask only)."""
        mask, tables = meta.decode_mask, meta.decode_block_tables
        assert mask is not None and tables is not None and self._step is not None
        b, width = mask.shape[0], mask.shape[-1]
        if width > self.index_topk:
            index, key_cache = self._step
            keys = self._keys(key_cache, tables)  # [B, L, Di]
            scores = self._scores(index.q[:b], index.w[:b], keys)  # [B, L]
            padding = mask.view(b, width)
            top = scores.masked_fill(padding, float("-inf")).topk(self.index_topk, dim=-1)
            unselected = torch.ones_like(padding).scatter(1, top.indices, False)
            # A row whose context fits keeps all of it (its top-k would hold padding).
            fits = (~padding).sum(dim=1, keepdim=True) <= self.index_topk
            mask = (padding | (unselected & ~fits)).view_as(mask)
            meta = dataclasses.replace(meta, decode_mask=mask)
            # The reference's absorbed decode: it reads decode_mask (a fused kernel that
            # takes the sequences' lengths only would attend to every token).
            return MLAPagedAttention._absorbed(self, q_nope, q_pe, cache, kv_b, meta)
        return super()._absorbed(q_nope, q_pe, cache, kv_b, meta)

    def _naive_decode(self, q_nope, q_pe, cache, kv_b, meta) -> torch.Tensor:  # noqa: ANN001
        raise NotImplementedError("sparse MLA decodes absorbed only")

    def _prefill(self, q_nope, q_pe, ctx, kv_b, p: PrefillSeq) -> torch.Tensor:  # noqa: ANN001
        """One prefill chunk: its queries at positions ctx_len − q_len.., each attending to the
        tokens of its causal context it selects (all of them while they fit)."""
        num_before = p.ctx_len - p.q_len
        if p.ctx_len <= self.index_topk:
            return self._naive(q_nope, q_pe, ctx, kv_b, num_before)
        assert self._step is not None
        index, key_cache = self._step
        keys = self._keys(key_cache, p.block_table)[: p.ctx_len]  # [C, Di]: this chunk's too
        rows = slice(p.q_start, p.q_start + p.q_len)
        scores = self._scores(index.q[rows], index.w[rows], keys)  # [Q, C]
        device = scores.device
        qpos = torch.arange(num_before, p.ctx_len, device=device).unsqueeze(1)  # [Q, 1]
        causal = torch.arange(p.ctx_len, device=device).unsqueeze(0) <= qpos  # [Q, C]
        top = scores.masked_fill(~causal, float("-inf")).topk(self.index_topk, dim=-1)
        selected = torch.zeros_like(causal).scatter(1, top.indices, True)
        allowed = causal & (selected | (qpos < self.index_topk))  # fits: the whole context
        q, k, v = self._heads(q_nope, q_pe, ctx, kv_b)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.scale)
        return out.transpose(0, 1)  # [Q, H, v]


@register_attention("fused", "cpu", "mla_sparse")
class FusedCpuSparseMLAAttention(SparseMLAPagedAttention, FusedCpuMLAAttention):
    """The sparse attention on the fused CPU backend: while a step's contexts fit in
    index_topk (every selection keeps everything: up to 2,048 tokens for V3.2) it is the fused
    MLA path, rotary and latent write in one kernel and the latent-space decode kernel; the
    expansion and chunked attention of prefill are fused MLA's too. Past index_topk a decode
    row's selection masks the reference's absorbed decode."""
