"""Fused paged attention on CPU: the decode rows of a step in one C++ kernel per layer.

MHA: for each decode row the kernel rotates q and k (fp32, from the whole rotary table), writes
k and v into the paged cache and attends over the sequence's cached tokens through its block
table: no gathered copies, no masks, no dtype round trips.

MLA: a decode-only step rotates q's and k's rope parts and writes the latent into the cache in
one kernel; the absorbed decode attends in latent space straight from the paged latent cache
(one kernel for the batch's decode rows); the two per-head projections around it (into latent space
through W_UK, back through W_UV) read kv_b_proj's weight in its own dtype with fp32 sums (one
kernel each; the reference's einsums multiply an fp32 copy: twice the bytes).

Prefill chunks: rotary and the KV write in one kernel that rounds as the reference does (bf16:
its result is the reference's bit for bit, ~5x faster); then every chunk attends from the paged
cache in one kernel (flash-style, 16 queries a vector; no gathered copy of the context, no mask
tensor, no fp32 copies): ~2x the reference's gather + masked SDPA at 1,024 queries × 4,000
tokens, and 1.15-1.35x its causal SDPA on a chunk with nothing cached before it (a 16-prompt
burst's prefill ~10% faster). One kernel for every chunk also means a prompt's attention does
not change arithmetic with how it was chunked or what the prefix cache held.
"""

from __future__ import annotations

import functools

import torch

from dsinfer.layers.attention.backend import AttentionMetadata, PrefillSeq
from dsinfer.layers.attention.mla import MLAPagedAttention
from dsinfer.layers.attention.registry import register_attention
from dsinfer.layers.attention.torch_paged import TorchPagedAttention
from dsinfer.layers.rotary import StepRope

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)

# MLA prefill attends in query chunks of this many rows (see attend_in_query_chunks).
_QUERY_CHUNK = 128


@functools.cache
def _future_mask() -> torch.Tensor:
    """[i, j] True where key j of a chunk's diagonal block is later than its query i. Made on
    first use, never at import: a torch op on the importing (main) thread can start an OpenMP
    pool there, and a second pool makes libgomp stop spinning for every other thread's
    parallel regions (tests/device/test_host_threads.py)."""
    return torch.ones(_QUERY_CHUNK, _QUERY_CHUNK, dtype=torch.bool).triu_(1)


def attend_in_query_chunks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_before: int, scale: float
) -> torch.Tensor:
    """Causal attention, fp32: q [H, Q, D], k [H, C, D], v [H, C, Dv], query i at position
    num_before + i → [H, Q, Dv]. Each chunk of 128 queries multiplies only the keys up to its
    last query (two batched GEMMs over the heads) and masks only its diagonal block.

    Why not torch's SDPA: with MLA's unequal head sizes (192 for q·k, 128 for v) it takes the
    math path, which scores and masks the whole square; the flash kernel (v padded to 192)
    is no faster on this CPU. Measured alone, 16 heads, fp32: 512 tokens 21.6 → 9.0 ms,
    2,048 tokens 394 → 121 ms, 1,024 after 1,024 cached 199 → 88 ms; the same products
    (max |Δ| ~4e-6 against SDPA: only the sums' order differs)."""
    ql = q.shape[1]
    out = []
    for q0 in range(0, ql, _QUERY_CHUNK):
        n = min(_QUERY_CHUNK, ql - q0)
        keys = num_before + q0 + n  # this chunk's last query sees keys [0, keys)
        s = torch.bmm(q[:, q0 : q0 + n], k[:, :keys].transpose(1, 2)).mul_(scale)  # [H, n, keys]
        s[:, :, keys - n :].masked_fill_(_future_mask()[:n, :n], float("-inf"))
        out.append(torch.bmm(torch.softmax(s, dim=-1), v[:, :keys]))  # [H, n, Dv]
    return out[0] if len(out) == 1 else torch.cat(out, dim=1)


@register_attention("fused", "cpu", "mha")
class FusedCpuPagedAttention(TorchPagedAttention):
    step_program_kernel = True
    graph_safe_decode = False  # its kernels are CPU ops: the CPU's step is the C++ program

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        rope: StepRope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        nd, t = meta.num_decode, qkv.shape[0]
        k_cache, v_cache = kv_cache
        if (
            qkv.dtype not in _KERNEL_DTYPES
            or k_cache.dtype != qkv.dtype
            or (nd and (meta.decode_seq_lens is None or rope.table_cos.dtype != torch.float32))
        ):
            return super().forward_qkv(qkv, rope, kv_cache, meta)
        parts = []
        if nd:
            parts.append(
                torch.ops.dsinfer.rope_decode_attention(
                    qkv[:nd].contiguous(),  # [B, (H + 2KV)·D]: rows of a contiguous batch
                    rope.table_cos,
                    rope.table_sin,
                    k_cache,
                    v_cache,
                    meta.decode_block_tables,
                    meta.decode_seq_lens,
                    self.num_heads,
                    self.num_kv_heads,
                    self.scale,
                )  # [B, H·D]
            )
        if nd < t:
            rest_rope = StepRope(rope.cos[nd:], rope.sin[nd:], rope.table_cos, rope.table_sin)
            rest_meta = meta.without_decodes() if nd else meta
            parts.append(self._prefill_rows(qkv[nd:], rest_rope, kv_cache, rest_meta))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _prefill_rows(
        self,
        qkv: torch.Tensor,
        rope: StepRope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The prefill chunks' rows (no decodes): rotary and the cache write in one kernel, bit
        for bit the reference's (bf16), then the chunks' attention."""
        if qkv.dtype != torch.bfloat16 or rope.cos.dtype != torch.bfloat16:
            return super().forward_qkv(qkv, rope, kv_cache, meta)
        t, h, kv, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        k_cache, v_cache = kv_cache
        qk = torch.ops.dsinfer.rope_write_prefill(
            qkv.contiguous(),
            rope.cos.reshape(t, d).contiguous(),  # [T, 1, D] → the step's rows [T, D]
            rope.sin.reshape(t, d).contiguous(),
            k_cache,
            v_cache,
            meta.slot_blocks.contiguous(),
            meta.slot_offsets.contiguous(),
            h,
            kv,
        )  # [T, H + KV, D]: q and k rotated; k and v are in the cache
        q, k = qk.split([h, kv], dim=1)
        v = qkv[:, (h + kv) * d :].view(t, kv, d)
        return self._attend(q, k, v, kv_cache, meta).reshape(t, h * d)

    def _prefill_seq(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        p: PrefillSeq,
    ) -> torch.Tensor:
        # The reference gathers a cached context, copies it to fp32 and masks (~2x slower at
        # 1,024 × 4,000); with nothing cached it runs a causal fp32 SDPA on the fresh keys
        # (1.15-1.35x slower). The kernel's one-ulp differences from that SDPA move an 81-token
        # text's perplexity by ~0.8% (single roundings dominate so short a text) and a
        # 1,388-token or 2,000-token text's by < 0.3% (session 15; docs/backends.md).
        k_cache, v_cache = kv_cache
        if (
            q.dtype not in _KERNEL_DTYPES
            or k_cache.dtype != q.dtype
            or not torch.ops.dsinfer.paged_prefill_supported(self.head_dim, self.group)
        ):
            return super()._prefill_seq(q, k, v, kv_cache, p)
        return torch.ops.dsinfer.paged_prefill_attention(
            q.contiguous(),  # [Q, H, D]: a view into the rotated q|k rows
            k_cache,
            v_cache,
            p.block_table,
            p.ctx_len,
            self.scale,
        )


@register_attention("fused", "cpu", "mla")
class FusedCpuMLAAttention(MLAPagedAttention):
    graph_safe_decode = False  # a CPU op (see FusedCpuPagedAttention)

    def program_unsupported(
        self, kv_b: torch.Tensor, cache: torch.Tensor, dtype: torch.dtype
    ) -> str | None:
        """Why the MLA step program cannot run this layer's decode (it runs this class's
        decode-only path: the rotary kernel, the direct projections and the latent attention),
        or None."""
        if not self.absorb_decode:
            return "the naive MLA decode is on"
        if cache.dtype not in _KERNEL_DTYPES or cache.dtype != dtype:
            return "the latent cache's dtype is not the activations' (fp32 or bf16)"
        if not self._kernels_take_lora():
            return (
                f"this CPU's MLA projection kernels do not take kv_lora_rank {self.lora} "
                "(they need AVX2 + FMA or AVX-512, and a multiple of their lanes)"
            )
        if not self.reads_kv_b(kv_b):
            return "the MLA projection kernels cannot read kv_b_proj's weight as it is"
        return None

    def reads_kv_b(self, kv_b: torch.Tensor) -> bool:
        """Whether the projection kernels take this weight as it is."""
        return kv_b.dtype in _KERNEL_DTYPES and kv_b.is_contiguous() and self._kernels_take_lora()

    def _kernels_take_lora(self) -> bool:
        """Whether this build's projection kernels take the layer's kv_lora_rank (a property
        of the build: asked once)."""
        if not hasattr(self, "_lora_supported"):
            self._lora_supported = bool(torch.ops.dsinfer.mla_projections_supported(self.lora))
        return self._lora_supported

    def _expand(self, c: torch.Tensor, kv_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # One kernel reads kv_b as it is, where the reference widens all of it to fp32 (and
        # keeps that copy: +178 MiB resident for DeepSeek-V2-Lite, ~2 GiB at V3's shapes) for
        # two einsums. Decode reads kv_b itself too, so the fused backend keeps no copy.
        if not self.reads_kv_b(kv_b):
            return super()._expand(c, kv_b)
        kv = torch.ops.dsinfer.mla_expand_latent(c.contiguous(), kv_b, self.h)  # [C, H, nope + v]
        kv = kv.transpose(0, 1)  # [H, C, nope + v]
        return kv[..., : self.nope], kv[..., self.nope :]

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_before: int
    ) -> torch.Tensor:
        return attend_in_query_chunks(q, k, v, num_before, self.scale)

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
        # A decode-only step: rotary (fp32, from the table, as the MHA decode kernel does) and
        # the latent's cache write in one kernel, then the absorbed decode; ~15 small ops a
        # layer fewer. Steps with prefill rows keep the reference's rotary (their latents feed
        # the naive prefill directly).
        nd = meta.num_decode
        if (
            nd == q.shape[0]
            and not meta.prefills
            and self.absorb_decode
            and meta.decode_seq_lens is not None
            and cache.dtype in _KERNEL_DTYPES
            and q.dtype == cache.dtype
            and rope.table_cos.dtype == torch.float32
        ):
            q_pe = torch.ops.dsinfer.mla_rope_decode(
                q,
                kv,
                c.contiguous(),
                rope.table_cos,
                rope.table_sin,
                cache,
                meta.slot_blocks.contiguous(),
                meta.slot_offsets.contiguous(),
                meta.decode_seq_lens,
                self.nope,
            )  # [B, H, rope] fp32; the latents are in the cache
            return self._absorbed(q[..., : self.nope], q_pe, cache, kv_b, meta).to(q.dtype)
        return super().forward_rope(q, kv, c, rope, cache, kv_b, meta)

    def _absorbed(self, q_nope, q_pe, cache, kv_b, meta) -> torch.Tensor:  # noqa: ANN001
        if meta.decode_seq_lens is None or cache.dtype not in _KERNEL_DTYPES:
            return super()._absorbed(q_nope, q_pe, cache, kv_b, meta)
        # The projections read kv_b_proj's weight as it is (bf16: half the bytes of the
        # reference's fp32 copy, the same products): 2.4x the einsums at batch 1 for V2-Lite.
        direct = self.reads_kv_b(kv_b)
        if direct:
            q_lat = torch.ops.dsinfer.mla_absorb_query(q_nope.contiguous(), kv_b, self.v)
        else:
            w_uk, w_uv = self._split_kv_b(kv_b)
            q_lat = torch.einsum("bhn,hnl->bhl", q_nope.float(), w_uk)  # [B, H, lora]
        o_lat = torch.ops.dsinfer.mla_decode_attention(
            q_lat.contiguous(),
            q_pe.float().contiguous(),  # [B, H, rope]
            cache,  # [blocks, bs, lora + rope]
            meta.decode_block_tables,
            meta.decode_seq_lens,
            self.scale,
        )  # [B, H, lora]
        if direct:
            return torch.ops.dsinfer.mla_expand_output(o_lat, kv_b, self.nope)  # [B, H, v]
        return torch.einsum("bhl,hvl->bhv", o_lat, w_uv)  # [B, H, v]
