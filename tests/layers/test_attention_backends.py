"""The attention backends in isolation, against dense attention written out in the test.

Sequences of different lengths live in scattered blocks of a paged pool; each backend gets the
neutral per-step batch (AttentionMetadata) a runner would build and must give what plain
softmax attention over each whole sequence gives. The fused CPU backend is compared with the
reference in tests/layers/test_fused_kernels.py; here the reference itself is checked, and the
accelerators' SDPA decode (layers/attention/sdpa_paged.py, run here on the CPU)."""

from __future__ import annotations

import pytest
import torch

from dsinfer.layers.attention import AttentionMetadata, PrefillSeq
from dsinfer.layers.attention.mla import MLAPagedAttention
from dsinfer.layers.attention.registry import attention_class, make_attention
from dsinfer.layers.attention.sdpa_paged import SdpaPagedAttention
from dsinfer.layers.attention.torch_paged import TorchPagedAttention
from tests.helpers import decode_metadata

BS = 4  # block size


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    """The fused backend's C++ kernels, built and loaded (as the engine does when it picks it)."""
    from dsinfer.layers.backend import resolve_backend

    assert resolve_backend("fused", torch.device("cpu")).name == "fused"


def _tables(lengths: list[int], num_blocks: int, g: torch.Generator) -> list[list[int]]:
    """Each sequence's blocks, drawn without replacement from a shuffled pool."""
    free = torch.randperm(num_blocks, generator=g).tolist()
    return [[free.pop() for _ in range(-(-n // BS))] for n in lengths]


def _decode_meta(lengths: list[int], tables: list[list[int]]) -> AttentionMetadata:
    """One decode row per sequence: its new token is the last of `lengths[i]`."""
    return decode_metadata(lengths, tables, BS)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H, D] as the last Q positions of k/v [C, KV, Dv] (grouped heads) → [Q, H, Dv]."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,chd->hqc", q, k) * scale
    c, ql = k.shape[0], q.shape[0]
    future = torch.arange(c).unsqueeze(0) > torch.arange(c - ql, c).unsqueeze(1)  # [Q, C]
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("hqc,chd->qhd", probs, v)


def _write_history(cache: torch.Tensor, table: list[int], rows: torch.Tensor) -> None:
    """rows [n, KV, D] into an MHA cache [blocks, KV, BS, D] along the block table."""
    for i in range(rows.shape[0]):
        cache[table[i // BS], :, i % BS] = rows[i]


# (dtype, tolerance): bf16 caches hold the rounded keys and values the dense oracle reads too;
# the tolerance covers bf16 products and the bf16 result.
MHA_DTYPES = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", list(MHA_DTYPES), ids=str)
@pytest.mark.parametrize("cls", [TorchPagedAttention, SdpaPagedAttention])
@pytest.mark.parametrize(("heads", "kv"), [(4, 4), (6, 2)])
def test_mha_decode_equals_dense_attention(
    heads: int, kv: int, cls: type, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(0)
    d, lengths = 8, [1, 6, 13, 4]
    tables = _tables(lengths, 16, g)
    k_cache, v_cache = torch.zeros(2, 16, kv, BS, d, dtype=dtype)
    ks = [torch.randn(n, kv, d, generator=g).to(dtype).float() for n in lengths]
    vs = [torch.randn(n, kv, d, generator=g).to(dtype).float() for n in lengths]
    for t, k, v in zip(tables, ks, vs, strict=True):  # everything before this step's token
        _write_history(k_cache, t, k[:-1])
        _write_history(v_cache, t, v[:-1])
    q = torch.randn(len(lengths), heads, d, generator=g).to(dtype)
    k_new = torch.stack([k[-1] for k in ks]).to(dtype)
    v_new = torch.stack([v[-1] for v in vs]).to(dtype)
    attn = cls(num_heads=heads, num_kv_heads=kv, head_dim=d, scale=d**-0.5)
    got = attn.forward(q, k_new, v_new, (k_cache, v_cache), _decode_meta(lengths, tables))
    assert got.dtype == dtype
    tol = MHA_DTYPES[dtype]
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        want = _dense(q[i : i + 1].float(), k, v, d**-0.5)
        torch.testing.assert_close(got[i : i + 1].float(), want, atol=tol, rtol=tol)
    # This step's keys and values were written into their slots.
    for i, t in enumerate(tables):
        p = lengths[i] - 1
        torch.testing.assert_close(k_cache[t[p // BS], :, p % BS], k_new[i])


def test_reference_mha_prefill_chunk_after_a_cached_prefix_equals_dense() -> None:
    """A chunk of 5 queries whose first 7 tokens were cached by an earlier step."""
    g = torch.Generator().manual_seed(1)
    heads, kv, d, cached, q_len = 4, 2, 8, 7, 5
    ctx = cached + q_len
    (table,) = _tables([ctx], 8, g)
    k_cache, v_cache = torch.zeros(2, 8, kv, BS, d)
    k, v = torch.randn(ctx, kv, d, generator=g), torch.randn(ctx, kv, d, generator=g)
    _write_history(k_cache, table, k[:cached])
    _write_history(v_cache, table, v[:cached])
    pos = torch.arange(cached, ctx)
    meta = AttentionMetadata(
        slot_blocks=torch.tensor([table[p // BS] for p in pos.tolist()]),
        slot_offsets=pos % BS,
        num_decode=0,
        decode_block_tables=None,
        decode_mask=None,
        prefills=(PrefillSeq(0, q_len, ctx, torch.tensor(table)),),
    )
    q = torch.randn(q_len, heads, d, generator=g)
    attn = TorchPagedAttention(num_heads=heads, num_kv_heads=kv, head_dim=d, scale=d**-0.5)
    got = attn.forward(q, k[cached:], v[cached:], (k_cache, v_cache), meta)
    torch.testing.assert_close(got, _dense(q, k, v, d**-0.5), atol=1e-5, rtol=1e-5)


def _mla_dense(q_nope, q_pe, latents, kv_b, h, nope, v_dim, lora, scale):  # noqa: ANN001, ANN202
    """MLA written out: expand every latent into per-head keys and values, then attend."""
    w = kv_b.view(h, nope + v_dim, lora)
    c, k_pe = latents[:, :lora], latents[:, lora:]
    k_nope = torch.einsum("cl,hnl->chn", c, w[:, :nope])
    v = torch.einsum("cl,hvl->chv", c, w[:, nope:])
    k = torch.cat([k_nope, k_pe.unsqueeze(1).expand(-1, h, -1)], dim=-1)
    return _dense(torch.cat([q_nope, q_pe], dim=-1), k, v, scale)


# (heads, lora, rope): odd sizes take the fused kernel's plain loops; 4 heads with lora 64 and
# rope 16 take its register-blocked AVX-512 loops (heads in fours, latent in 64s).
MLA_SHAPES = {"plain": (3, 10, 4), "blocked": (4, 64, 16)}


@pytest.mark.parametrize("shape", sorted(MLA_SHAPES))
@pytest.mark.parametrize(
    ("backend", "absorbed", "dtype"),
    [
        ("reference", True, torch.float32),
        ("reference", False, torch.float32),
        ("fused", True, torch.float32),  # the C++ latent-space decode kernel
        ("fused", True, torch.bfloat16),
    ],
)
def test_mla_decode_and_prefill_equal_dense_attention(
    backend: str, absorbed: bool, dtype: torch.dtype, shape: str
) -> None:
    """Two decode rows (absorbed or expanded) and a fresh prefill of 3, in one step; the latent
    cache in `dtype` (the dense oracle reads the same rounded latents). Context lengths 5 and 9
    leave a remainder after blocks of four tokens."""
    g = torch.Generator().manual_seed(2)
    (h, lora, rope), nope, v_dim = MLA_SHAPES[shape], 8, 6
    scale = (nope + rope) ** -0.5
    kv_b = torch.randn(h * (nope + v_dim), lora, generator=g) * 0.3
    lengths = [5, 9]
    tables = _tables([*lengths, 3], 12, g)
    cache = torch.zeros(12, BS, lora + rope, dtype=dtype)
    latents = [torch.randn(n, lora + rope, generator=g).to(dtype).float() for n in [*lengths, 3]]
    for t, lat in zip(tables[:2], latents[:2], strict=True):
        for i in range(lat.shape[0] - 1):
            cache[t[i // BS], i % BS] = lat[i]
    dec = _decode_meta(lengths, tables[:2])
    meta = AttentionMetadata(
        slot_blocks=torch.cat([dec.slot_blocks, torch.tensor([tables[2][0]] * 3)]),
        slot_offsets=torch.cat([dec.slot_offsets, torch.arange(3)]),
        num_decode=2,
        decode_block_tables=dec.decode_block_tables,
        decode_mask=dec.decode_mask,
        prefills=(PrefillSeq(2, 3, 3, torch.tensor(tables[2])),),
        decode_seq_lens=dec.decode_seq_lens,
    )
    q_nope, q_pe = torch.randn(5, h, nope, generator=g), torch.randn(5, h, rope, generator=g)
    step_latents = torch.cat([latents[0][-1:], latents[1][-1:], latents[2]])
    attn = attention_class(backend, "cpu", "mla")(h, nope, rope, v_dim, lora, scale)
    attn.absorb_decode = absorbed
    got = attn.forward(q_nope, q_pe, step_latents, cache, kv_b, meta)
    rows = [slice(0, 1), slice(1, 2), slice(2, 5)]
    for r, lat in zip(rows, latents, strict=True):
        want = _mla_dense(q_nope[r], q_pe[r], lat, kv_b, h, nope, v_dim, lora, scale)
        torch.testing.assert_close(got[r], want, atol=1e-4, rtol=1e-4)


def test_registry_gives_the_fused_cpu_mha_and_the_reference_elsewhere() -> None:
    from dsinfer.layers.attention.fused_cpu import FusedCpuMLAAttention, FusedCpuPagedAttention

    assert attention_class("fused", "cpu", "mha") is FusedCpuPagedAttention
    assert attention_class("reference", "cpu", "mha") is TorchPagedAttention
    assert attention_class("fused", "npu", "mha") is TorchPagedAttention  # none registered
    assert attention_class("fused", "cpu", "mla") is FusedCpuMLAAttention
    assert attention_class("fused", "cuda", "mla") is MLAPagedAttention
    assert attention_class("fused", "cuda", "mha") is SdpaPagedAttention
    assert attention_class("reference", "cuda", "mha") is TorchPagedAttention
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=8, scale=0.1)
    ref = make_attention("mha", **shape)
    assert isinstance(ref, TorchPagedAttention)
    fused = ref.rebuilt("fused", "cpu")
    assert isinstance(fused, FusedCpuPagedAttention) and fused.shape == ref.shape
    assert ref.rebuilt("reference", "cpu") is ref
