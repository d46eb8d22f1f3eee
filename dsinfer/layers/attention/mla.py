"""Multi-head latent attention (DeepSeek-V2/V3) over a paged *latent* KV cache.

Per token and layer the pool keeps only [c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)], not
per-head K/V. Two ways to attend, which must agree:
- naive: expand the latent through kv_b_proj into per-head k_nope and v, then plain attention
  (used for prefill chunks, where the expansion is amortised over many queries);
- absorbed: fold kv_b_proj's key half into the query (q_nope · W_UK → latent space) and its value
  half into the output, so scores and values are read straight from the latent (used for decode,
  where it reads ~(kv_lora_rank + rope) numbers per cached token instead of H·(nope + v)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsinfer.layers.attention.backend import AttentionBackend, AttentionMetadata, PrefillSeq
from dsinfer.layers.attention.registry import register_attention
from dsinfer.layers.rotary import StepRope, apply_rotary, deinterleave_pairs


@register_attention("reference", "any", "mla")
class MLAPagedAttention(AttentionBackend):
    kind = "mla"

    def __init__(self, num_heads: int, nope: int, rope: int, v_dim: int, lora: int, scale: float):
        super().__init__(
            num_heads=num_heads, nope=nope, rope=rope, v_dim=v_dim, lora=lora, scale=scale
        )
        self.h, self.nope, self.rope, self.v, self.lora = num_heads, nope, rope, v_dim, lora
        self.scale = scale
        self.absorb_decode = True

    @property
    def graph_safe_decode(self) -> bool:  # type: ignore[override]
        # The absorbed decode has fixed shapes; the naive one splits rows by length on the host.
        return self.absorb_decode

    def forward_rope(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        c: torch.Tensor,
        rope: StepRope,
        cache: torch.Tensor,
        kv_b: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """From the projections: q [T, H, nope + rope] (q_proj's rows), kv [T, lora + rope]
        (kv_a_proj's: the raw k_pe at the end) and the normed latent c [T, lora]. Rotary on
        the rope parts (stored with their pairs interleaved), the latent c | k_pe into the
        cache, attention → [T, H, v]."""
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        q_pe = apply_rotary(deinterleave_pairs(q_pe), rope.cos, rope.sin)  # [T, H, rope]
        k_pe = deinterleave_pairs(kv[:, self.lora :]).unsqueeze(1)  # [T, 1, rope]
        k_pe = apply_rotary(k_pe, rope.cos, rope.sin).squeeze(1)  # [T, rope]
        latent = torch.cat([c, k_pe], dim=-1)  # [T, lora + rope]: all the cache keeps
        return self.forward(q_nope, q_pe, latent, cache, kv_b, meta)

    def forward(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        cache: torch.Tensor,
        kv_b: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope], latent [T, lora + rope] (this step's tokens),
        cache [blocks, bs, lora + rope], kv_b: kv_b_proj weight [H·(nope + v), lora] → [T, H, v]."""
        cache[meta.slot_blocks, meta.slot_offsets] = latent.to(cache.dtype)
        out = torch.empty(q_nope.shape[0], self.h, self.v, dtype=q_nope.dtype, device=q_nope.device)
        nd = meta.num_decode
        if nd:
            decode = self._absorbed if self.absorb_decode else self._naive_decode
            out[:nd] = decode(q_nope[:nd], q_pe[:nd], cache, kv_b, meta)
        for p in meta.prefills:
            rows = slice(p.q_start, p.q_start + p.q_len)
            if p.ctx_len == p.q_len:
                ctx = latent[rows]
            else:
                ctx = cache.view(cache.shape[0], -1).index_select(0, p.block_table)
                ctx = ctx.view(-1, self.lora + self.rope)[: p.ctx_len]
            out[rows] = self._prefill(q_nope[rows], q_pe[rows], ctx, kv_b, p).to(out.dtype)
        return out

    def _prefill(self, q_nope, q_pe, ctx, kv_b, p: PrefillSeq) -> torch.Tensor:  # noqa: ANN001
        """One prefill chunk's rows: q [Q, H, ·] against its context ctx [C, lora + rope]."""
        return self._naive(q_nope, q_pe, ctx, kv_b, p.ctx_len - p.q_len)

    def _split_kv_b(self, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's key and value halves in fp32: [H, nope, lora], [H, v, lora]. Converted
        once per weight tensor (its storage), not on every forward of every layer; weights are
        loaded before the first forward and never written in place after it."""
        key = (kv_b.data_ptr(), kv_b.dtype, tuple(kv_b.shape))
        if getattr(self, "_kv_b_key", None) != key:
            w = kv_b.float().view(self.h, self.nope + self.v, self.lora)
            self._kv_b_split = (w[:, : self.nope].contiguous(), w[:, self.nope :].contiguous())
            self._kv_b_key = key
        return self._kv_b_split

    def _expand(self, c: torch.Tensor, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents c [C, lora] fp32 → every head's keys without rotary [H, C, nope] and values
        [H, C, v], fp32."""
        w_uk, w_uv = self._split_kv_b(kv_b)
        return torch.einsum("cl,hnl->hcn", c, w_uk), torch.einsum("cl,hvl->hcv", c, w_uv)

    def _naive(self, q_nope, q_pe, ctx, kv_b, num_before: int) -> torch.Tensor:  # noqa: ANN001
        """One sequence: q [Q, H, ·], ctx [C, lora + rope] → [Q, H, v]."""
        q, k, v = self._heads(q_nope, q_pe, ctx, kv_b)
        return self._attend(q, k, v, num_before).transpose(0, 1)  # [Q, H, v]

    def _heads(self, q_nope, q_pe, ctx, kv_b) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
        """One sequence's queries [Q, H, ·] and latents ctx [C, lora + rope] as every head's
        fp32 q [H, Q, nope + rope], k [H, C, nope + rope] and v [H, C, v]."""
        c, k_pe = ctx[:, : self.lora].float(), ctx[:, self.lora :].float()
        k_nope, v = self._expand(c, kv_b)  # [H, C, nope], [H, C, v]
        k = torch.cat([k_nope, k_pe.unsqueeze(0).expand(self.h, -1, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1).float().transpose(0, 1)  # [H, Q, nope + rope]
        return q, k, v

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_before: int
    ) -> torch.Tensor:
        """Causal attention of one sequence in fp32: q [H, Q, nope + rope], k [H, C, nope +
        rope], v [H, C, v], query i at position num_before + i (C = num_before + Q) → [H, Q, v]."""
        ql, cl = q.shape[1], k.shape[1]
        if num_before == 0:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        qpos = torch.arange(num_before, num_before + ql, device=q.device).unsqueeze(1)
        mask = torch.arange(cl, device=q.device).unsqueeze(0) <= qpos
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)

    def _gather_decode(self, cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        bt = meta.decode_block_tables
        assert bt is not None
        b = bt.shape[0]
        rows = cache.view(cache.shape[0], -1).index_select(0, bt.reshape(-1))
        return rows.view(b, -1, self.lora + self.rope).float()  # [B, L, lora + rope]

    def _absorbed(self, q_nope, q_pe, cache, kv_b, meta) -> torch.Tensor:  # noqa: ANN001
        w_uk, w_uv = self._split_kv_b(kv_b)
        ctx = self._gather_decode(cache, meta)
        b = ctx.shape[0]
        c, k_pe = ctx[..., : self.lora], ctx[..., self.lora :]  # [B, L, lora], [B, L, rope]
        q_lat = torch.einsum("bhn,hnl->bhl", q_nope.float(), w_uk)  # [B, H, lora]
        scores = torch.matmul(q_lat, c.transpose(1, 2)) + torch.matmul(
            q_pe.float(), k_pe.transpose(1, 2)
        )  # [B, H, L]
        scores = scores * self.scale
        assert meta.decode_mask is not None
        scores.masked_fill_(meta.decode_mask.view(b, 1, -1), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        o_lat = torch.matmul(probs, c)  # [B, H, lora]
        return torch.einsum("bhl,hvl->bhv", o_lat, w_uv)  # [B, H, v]

    def _naive_decode(self, q_nope, q_pe, cache, kv_b, meta) -> torch.Tensor:  # noqa: ANN001
        """Reference for the absorbed path: expand every cached latent, then attend."""
        ctx = self._gather_decode(cache, meta)
        assert meta.decode_mask is not None
        lengths = (~meta.decode_mask.view(ctx.shape[0], -1)).sum(dim=1).tolist()
        outs = [
            self._naive(
                q_nope[i : i + 1], q_pe[i : i + 1], ctx[i, : lengths[i]], kv_b, lengths[i] - 1
            )
            for i in range(ctx.shape[0])
        ]
        return torch.cat(outs, dim=0)
