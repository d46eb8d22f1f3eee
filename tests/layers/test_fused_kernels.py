"""The fused CPU kernels against the reference ops they replace, on random inputs."""

from __future__ import annotations

import pytest
import torch

from dsinfer.config import RopeConfig
from dsinfer.layers.attention import AttentionMetadata, FusedCpuPagedAttention, PrefillSeq
from dsinfer.layers.attention.torch_paged import TorchPagedAttention
from dsinfer.layers.backend import resolve_backend
from dsinfer.layers.kernels import FUSED_CPU, REFERENCE
from dsinfer.layers.linear import Linear
from dsinfer.layers.quant import int8_mm, quantize_int8
from dsinfer.layers.rotary import RotaryEmbedding
from tests.helpers import decode_metadata, fused_cpu_has

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    assert resolve_backend("fused", torch.device("cpu")).name == "fused"


def _build_target_defines() -> set[str]:
    """The ISA macros the library was compiled under (its -march: this CPU's, or
    DSINFER_CPU_MARCH's), as the compiler torch builds it with defines them."""
    import os
    import subprocess

    from dsinfer.layers.kernels.cpu_build import MARCH

    cxx = os.environ.get("CXX", "c++")  # torch.utils.cpp_extension's compiler
    out = subprocess.run(
        [cxx, f"-march={MARCH}", "-dM", "-E", "-x", "c++", "/dev/null"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return {line.split()[1] for line in out.splitlines() if line.startswith("#define __")}


def test_the_library_has_every_kernel_its_isa_can_run() -> None:
    """Tests of what a kernel does skip where the CPU lacks its instructions
    (tests/helpers.skip_without): this one fails instead where a build that has them reports
    a stub, so that a broken build cannot pass as an older CPU."""
    isa = _build_target_defines()
    avx2 = {"__AVX2__", "__FMA__"} <= isa
    vnni = {"__AVX512F__", "__AVX512VNNI__", "__AVX512BF16__"} <= isa
    assert fused_cpu_has("int4_vnni") == (avx2 or vnni), sorted(isa)
    assert fused_cpu_has("int4_i8") == avx2, sorted(isa)
    assert fused_cpu_has("int8_vnni") == vnni, sorted(isa)
    assert fused_cpu_has("mla_projections", 48) == (avx2 or "__AVX512F__" in isa), sorted(isa)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_activation_match_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 96, generator=g).to(dtype)
    r = torch.randn(5, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    torch.testing.assert_close(
        FUSED_CPU.rms_norm(x, w, 1e-5), REFERENCE.rms_norm(x, w, 1e-5), atol=TOL[dtype], rtol=0
    )
    (a, ra), (b, rb) = FUSED_CPU.add_rms_norm(x, r, w, 1e-5), REFERENCE.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(ra, rb)  # the residual sum rounds like the reference's add
    torch.testing.assert_close(a, b, atol=TOL[dtype], rtol=0)
    gu = torch.randn(3, 2 * 40, generator=g).to(dtype)
    torch.testing.assert_close(
        FUSED_CPU.silu_and_mul(gu), REFERENCE.silu_and_mul(gu), atol=TOL[dtype], rtol=TOL[dtype]
    )


def test_fused_ops_fall_back_on_what_they_do_not_take() -> None:
    x = torch.randn(4, 2, 8).to(torch.float16)  # 3-D, fp16: the reference runs
    w = torch.ones(8, dtype=torch.float16)
    torch.testing.assert_close(FUSED_CPU.rms_norm(x, w, 1e-6), REFERENCE.rms_norm(x, w, 1e-6))


def _paged_step(dtype: torch.dtype, lens: list[int], heads: int, kv: int, d: int, bs: int = 4):
    """A decode step over random caches: block tables scattered over the pool."""
    g = torch.Generator().manual_seed(1)
    nblocks = sum(-(-n // bs) for n in lens) + 3
    k_cache = torch.randn(nblocks, kv, bs, d, generator=g).to(dtype)
    v_cache = torch.randn(nblocks, kv, bs, d, generator=g).to(dtype)
    perm = torch.randperm(nblocks, generator=g).tolist()
    tables, at = [], 0
    for n in lens:
        need = -(-n // bs)
        tables.append(perm[at : at + need])
        at += need
    meta = decode_metadata(lens, tables, bs)
    pos = meta.decode_seq_lens - 1
    qkv = torch.randn(len(lens), (heads + 2 * kv) * d, generator=g).to(dtype)
    rope = RotaryEmbedding(d, max(128, max(lens)), RopeConfig()).cos_sin(pos, dtype)
    return qkv, rope, (k_cache, v_cache), meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# (16, 1): more query heads per KV head than the bf16-pair loops take (they fall back);
# (8, 1): more value sums than registers hold (the pair loops' unpack-once variant).
@pytest.mark.parametrize("heads,kv", [(4, 4), (6, 2), (9, 3), (8, 1), (16, 1)])
@pytest.mark.parametrize(
    "d,bs",
    # head dims of 1, 4 and 8 vectors; blocks shorter than, equal to and longer than a run of
    # 16 tokens (partial runs, whole runs, two runs a block); d=24: the generic loops.
    [(16, 4), (64, 16), (128, 32), (64, 8), (24, 16)],
)
def test_paged_decode_attention_matches_reference(
    dtype: torch.dtype, heads: int, kv: int, d: int, bs: int
) -> None:
    qkv, rope, caches, meta = _paged_step(dtype, [1, 5, 9, 23, 16, 70], heads, kv, d, bs)
    ref_caches = tuple(c.clone() for c in caches)
    shape = dict(num_heads=heads, num_kv_heads=kv, head_dim=d, scale=d**-0.5)
    want = TorchPagedAttention(**shape).forward_qkv(qkv, rope, ref_caches, meta)
    got = FusedCpuPagedAttention(**shape).forward_qkv(qkv, rope, caches, meta)
    # Both wrote the new keys and values into the same slots (the fused kernel rotates k in
    # fp32 before rounding it once; the reference rounds each rotary op).
    for a, b in zip(caches, ref_caches, strict=True):
        torch.testing.assert_close(a, b, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got, want, atol=2 * TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_of_one_sequence_see_each_others_keys(dtype: torch.dtype) -> None:
    """A decode and its drafts go in as consecutive decode rows of one sequence (one table,
    lengths p + 1, p + 2, …; worker/input_batch.py): each row must attend to the keys and
    values the rows before it write in the same call. Sequence 0: five rows at positions
    20-24 (its blocks hold stale values there until written); sequence 1: one row."""
    heads, kv, d, bs = 9, 3, 64, 4
    _, _, caches, meta = _paged_step(dtype, [25, 9], heads, kv, d, bs)
    tables = meta.decode_block_tables.tolist()
    table0, table1 = tables[0][: -(-25 // bs)], tables[1][: -(-9 // bs)]
    lens = [21, 22, 23, 24, 25, 9]
    meta = decode_metadata(lens, [table0] * 5 + [table1], bs)
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(len(lens), (heads + 2 * kv) * d, generator=g).to(dtype)
    rope = RotaryEmbedding(d, 128, RopeConfig()).cos_sin(meta.decode_seq_lens - 1, dtype)
    shape = dict(num_heads=heads, num_kv_heads=kv, head_dim=d, scale=d**-0.5)
    ref_caches = tuple(c.clone() for c in caches)
    want = TorchPagedAttention(**shape).forward_qkv(qkv, rope, ref_caches, meta)
    got = FusedCpuPagedAttention(**shape).forward_qkv(qkv, rope, caches, meta)
    torch.testing.assert_close(got, want, atol=2 * TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [16, 48])  # 48 does not tile the 512-token chunks: no split
def test_long_sequences_split_into_chunks_match_reference_and_their_batch(dtype, bs):
    """A sequence past 1,024 tokens is attended in chunks of 512 merged after; it matches the
    reference, and gives the same bits alone as among other rows (the cut depends on its own
    length only)."""
    lens = [1025, 7, 1600, 2100]
    heads, kv, d = 6, 2, 64
    qkv, rope, caches, meta = _paged_step(dtype, lens, heads, kv, d, bs)
    shape = dict(num_heads=heads, num_kv_heads=kv, head_dim=d, scale=d**-0.5)
    ref_caches = tuple(c.clone() for c in caches)
    want = TorchPagedAttention(**shape).forward_qkv(qkv, rope, ref_caches, meta)
    got = FusedCpuPagedAttention(**shape).forward_qkv(qkv, rope, caches, meta)
    torch.testing.assert_close(got, want, atol=2 * TOL[dtype], rtol=TOL[dtype])
    tables = meta.decode_block_tables
    for i in (2, 3):  # alone: its own metadata, the same caches
        one = decode_metadata([lens[i]], [tables[i, : -(-lens[i] // bs)].tolist()], bs)
        rope_i = type(rope)(
            rope.cos[i : i + 1], rope.sin[i : i + 1], rope.table_cos, rope.table_sin
        )
        alone = FusedCpuPagedAttention(**shape).forward_qkv(qkv[i : i + 1], rope_i, caches, one)
        assert torch.equal(alone[0], got[i])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,bs", [(64, 16), (128, 32), (64, 8)])
def test_paged_decode_attention_ignores_stale_cache_rows(dtype: torch.dtype, d: int, bs: int):
    """Rows past a sequence's end (a freed sequence's leftovers: anything, NaN included) must
    not reach the output: the kernels read whole runs of 16 rows and pairs of tokens, so a
    short run is copied and zero-padded rather than multiplied by a zero probability."""
    lens = [1, 5, 9, 23, 16, 70]
    heads, kv = 9, 3
    qkv, rope, (k_cache, v_cache), meta = _paged_step(dtype, lens, heads, kv, d, bs)
    stale = torch.ones(k_cache.shape[0], bs, dtype=torch.bool)  # [block, offset] unused
    for n, table in zip(lens, meta.decode_block_tables.tolist(), strict=True):
        for p in range(n):
            stale[table[p // bs], p % bs] = False
    shape = dict(num_heads=heads, num_kv_heads=kv, head_dim=d, scale=d**-0.5)
    outs = []
    for fill in (0.0, float("nan")):
        caches = tuple(c.clone() for c in (k_cache, v_cache))
        for c in caches:
            c.permute(0, 2, 1, 3)[stale] = fill  # [block, offset, KV, D] rows
        outs.append(FusedCpuPagedAttention(**shape).forward_qkv(qkv, rope, caches, meta))
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])


def test_mixed_step_runs_prefill_rows_on_the_reference() -> None:
    """Decode rows first, then a prefill chunk: the fused backend hands the chunk on."""
    d, heads, kv, bs = 8, 4, 2, 4
    qkv_dec, rope_dec, caches, meta_dec = _paged_step(torch.float32, [6, 3], heads, kv, d, bs)
    nblocks = caches[0].shape[0]
    prefill_table = torch.tensor([nblocks - 1])  # an unused block of the pool
    q_len = 3
    qkv_pre = torch.randn(q_len, (heads + 2 * kv) * d)
    qkv = torch.cat([qkv_dec, qkv_pre])
    positions = torch.cat([meta_dec.decode_seq_lens - 1, torch.arange(q_len)])
    rope = RotaryEmbedding(d, 128, RopeConfig()).cos_sin(positions, torch.float32)
    meta = AttentionMetadata(
        slot_blocks=torch.cat([meta_dec.slot_blocks, prefill_table.repeat(q_len)]),
        slot_offsets=torch.cat([meta_dec.slot_offsets, torch.arange(q_len)]),
        num_decode=2,
        decode_block_tables=meta_dec.decode_block_tables,
        decode_mask=meta_dec.decode_mask,
        prefills=(PrefillSeq(2, q_len, q_len, prefill_table),),
        decode_seq_lens=meta_dec.decode_seq_lens,
    )
    ref_caches = tuple(c.clone() for c in caches)
    shape = dict(num_heads=heads, num_kv_heads=kv, head_dim=d, scale=d**-0.5)
    want = TorchPagedAttention(**shape).forward_qkv(qkv, rope, ref_caches, meta)
    got = FusedCpuPagedAttention(**shape).forward_qkv(qkv, rope, caches, meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "heads,kv,d,bs",
    # d=64, 128: whole vectors per half; d=48: a vector and a scalar tail; d=24: scalar only.
    [(9, 3, 64, 16), (6, 2, 128, 32), (4, 4, 48, 8), (8, 1, 24, 4)],
)
def test_prefill_rows_rotate_and_write_the_cache_bit_for_bit(
    heads: int, kv: int, d: int, bs: int
) -> None:
    """bf16 prefill rows (three fresh sequences in one step, after two decode rows): rotary
    and the KV write run in one kernel that rounds as the reference's ops do, so the caches
    equal the reference's exactly; the attention over them (the paged prefill kernel, the
    reference's causal SDPA) agrees to one rounding of the output."""
    g = torch.Generator().manual_seed(11)
    lens = [5, 17, 33]
    qkv_dec, rope_dec, caches, meta_dec = _paged_step(torch.bfloat16, [6, 3], heads, kv, d, bs)
    # The prefill sequences' blocks: appended to the pool the decode rows use.
    nblocks, extra = caches[0].shape[0], sum(-(-n // bs) for n in lens)
    caches = tuple(torch.cat([c, torch.zeros(extra, *c.shape[1:], dtype=c.dtype)]) for c in caches)
    free = torch.arange(nblocks, nblocks + extra)
    tables, at = [], 0
    for n in lens:
        tables.append(free[at : at + -(-n // bs)])
        at += -(-n // bs)
    positions = torch.cat([torch.arange(n) for n in lens])
    qkv = torch.cat([qkv_dec, torch.randn(sum(lens), (heads + 2 * kv) * d, generator=g).bfloat16()])
    rope = RotaryEmbedding(d, 128, RopeConfig()).cos_sin(
        torch.cat([meta_dec.decode_seq_lens - 1, positions]), torch.bfloat16
    )
    starts = [2 + sum(lens[:i]) for i in range(len(lens))]
    meta = AttentionMetadata(
        slot_blocks=torch.cat(
            [
                meta_dec.slot_blocks,
                *(t[torch.arange(n) // bs] for t, n in zip(tables, lens, strict=True)),
            ]
        ),
        slot_offsets=torch.cat([meta_dec.slot_offsets, positions % bs]),
        num_decode=2,
        decode_block_tables=meta_dec.decode_block_tables,
        decode_mask=meta_dec.decode_mask,
        prefills=tuple(
            PrefillSeq(s, n, n, t) for s, n, t in zip(starts, lens, tables, strict=True)
        ),
        decode_seq_lens=meta_dec.decode_seq_lens,
    )
    ref_caches = tuple(c.clone() for c in caches)
    shape = dict(num_heads=heads, num_kv_heads=kv, head_dim=d, scale=d**-0.5)
    want = TorchPagedAttention(**shape).forward_qkv(qkv, rope, ref_caches, meta)
    got = FusedCpuPagedAttention(**shape).forward_qkv(qkv, rope, caches, meta)
    prefill_slots = (meta.slot_blocks[2:], slice(None), meta.slot_offsets[2:])
    for a, b in zip(caches, ref_caches, strict=True):
        assert torch.equal(a[prefill_slots], b[prefill_slots])
    # Rows 2.. are the prefill rows (the decode rows: the decode kernel's own test).
    torch.testing.assert_close(got[2:].float(), want[2:].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv,d,bs,q_len,ctx",
    [
        (9, 3, 64, 16, 20, 100),  # SmolLM2's heads: a later chunk of a long prompt
        (9, 3, 64, 16, 1, 33),  # one query
        (4, 4, 16, 4, 5, 9),  # tiny blocks: runs shorter than 16 keys
        (6, 2, 128, 32, 70, 90),  # two runs a block, a partial last tile of queries
        (8, 1, 64, 8, 17, 50),  # 8 query heads on one KV head
        (9, 3, 64, 16, 128, 128),  # nothing cached before: a fresh prompt's one chunk
        (6, 2, 128, 32, 37, 37),  # fresh, a partial last block and tile
    ],
)
def test_prefill_chunk_with_cached_context_matches_reference(
    dtype: torch.dtype, heads: int, kv: int, d: int, bs: int, q_len: int, ctx: int
) -> None:
    """A prefill chunk whose sequence has ctx − q_len tokens cached before it (none: a fresh
    prompt): the fused backend attends from the pages in one kernel, the reference gathers,
    masks and runs SDPA (fresh: causal SDPA on the chunk's keys). Same cache writes, same
    outputs (fp32: to rounding; bf16: one rounding of the output)."""
    g = torch.Generator().manual_seed(6)
    need = -(-ctx // bs)
    nblocks = need + 4
    k_cache = torch.randn(nblocks, kv, bs, d, generator=g).to(dtype)
    v_cache = torch.randn(nblocks, kv, bs, d, generator=g).to(dtype)
    table = torch.randperm(nblocks, generator=g)[:need]
    positions = torch.arange(ctx - q_len, ctx)
    qkv = torch.randn(q_len, (heads + 2 * kv) * d, generator=g).to(dtype)
    rope = RotaryEmbedding(d, 256, RopeConfig()).cos_sin(positions, dtype)
    meta = AttentionMetadata(
        slot_blocks=table[positions // bs],
        slot_offsets=positions % bs,
        num_decode=0,
        decode_block_tables=None,
        decode_mask=None,
        prefills=(PrefillSeq(0, q_len, ctx, table),),
    )
    ref_caches = (k_cache.clone(), v_cache.clone())
    shape = dict(num_heads=heads, num_kv_heads=kv, head_dim=d, scale=d**-0.5)
    want = TorchPagedAttention(**shape).forward_qkv(qkv, rope, ref_caches, meta)
    got = FusedCpuPagedAttention(**shape).forward_qkv(qkv, rope, (k_cache, v_cache), meta)
    assert torch.equal(k_cache, ref_caches[0]) and torch.equal(v_cache, ref_caches[1])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])
def test_int8_head_kernel_matches_dequantised_matmul_and_is_batch_invariant(rows: int) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(8192, 64, generator=g) * 0.05
    q = quantize_int8(w, torch.bfloat16)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    got = int8_mm(x, q["qweight"], q["scales"], fused=True)
    want = (x.float() @ (q["qweight"].float() * q["scales"].float()[:, None]).t()).to(x.dtype)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
    # A row's result does not depend on the other rows of its batch.
    alone = torch.cat(
        [int8_mm(x[i : i + 1], q["qweight"], q["scales"], fused=True) for i in range(rows)]
    )
    assert torch.equal(got, alone)


def test_backend_choice_is_explained() -> None:
    assert resolve_backend("reference", torch.device("cpu")).name == "reference"
    auto = resolve_backend("auto", torch.device("meta"))
    assert auto.name == "reference" and "no fused backend for meta" in auto.reason
    with pytest.raises(ValueError, match="fused backend cannot run here"):
        resolve_backend("fused", torch.device("meta"))
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        resolve_backend("fast", torch.device("cpu"))


def test_int8_activations_policy_is_explained() -> None:
    """--int8-activations: none anywhere; out_proj and all with the fused CPU backend only, and
    a reason otherwise; auto (the default) takes all wherever the kernel runs (AVX2 + FMA)
    and none elsewhere; the kernel set says which layers take them."""
    from dsinfer.layers.backend import kernels_of, resolve_int8_activations

    cpu = torch.device("cpu")
    assert resolve_int8_activations("none", "reference", cpu) == "none"
    assert resolve_int8_activations("auto", "reference", cpu) == "none"
    assert resolve_int8_activations("auto", "fused", torch.device("cuda")) == "none"
    runs = torch.ops.dsinfer.int4_i8_supported()
    assert resolve_int8_activations("auto", "fused", cpu) == ("all" if runs else "none")
    with pytest.raises(ValueError, match="kernel of the fused CPU backend.*use none"):
        resolve_int8_activations("all", "reference", cpu)
    with pytest.raises(ValueError, match="unknown int8 activations 'some'"):
        resolve_int8_activations("some", "fused", cpu)
    if torch.ops.dsinfer.int4_i8_supported():
        assert resolve_int8_activations("out_proj", "fused", cpu) == "out_proj"
    out_proj, every = kernels_of("fused", "out_proj"), kernels_of("fused", "all")
    assert out_proj.int8_for(True) and not out_proj.int8_for(False)
    assert every.int8_for(True) and every.int8_for(False)
    assert not kernels_of("fused").int8_for(True)


@pytest.mark.parametrize("out_f,in_f,group", [(128, 64, 32), (192, 128, 64)])
def test_int4_widening_for_prefill_equals_the_packed_kernel(out_f: int, in_f: int, group: int):
    """Many rows take a dense GEMM over the widened weight: same values as torch's kernel."""
    from dsinfer.layers.quant import quantize_int4

    if not torch.ops.dsinfer.int4_dense_supported():
        pytest.skip("no AVX512-BF16 on this CPU: every int4 call takes the packed kernel")
    g = torch.Generator().manual_seed(3)
    q = quantize_int4(torch.randn(out_f, in_f, generator=g) * 0.05, group, torch.bfloat16)
    eye = torch.eye(in_f, dtype=torch.bfloat16)
    want = torch._weight_int4pack_mm_for_cpu(eye, q["qweight"], group, q["scales_zeros"])
    got = torch.ops.dsinfer.int4_dequantize_t(q["qweight"], group, q["scales_zeros"])
    assert torch.equal(got, want)  # W^T exactly as the packed kernel sees it
    x = torch.randn(64, in_f, generator=g).to(torch.bfloat16)
    packed = torch._weight_int4pack_mm_for_cpu(x, q["qweight"], group, q["scales_zeros"])
    torch.testing.assert_close((x @ got).float(), packed.float(), atol=2e-2, rtol=2e-2)


def _q8_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """int4 × int8 activations (llama.cpp's arithmetic), in torch: each group of 32 inputs
    rounded to int8 (scale d = max|x| / 127, round half to even) and multiplied with the exact
    weight w [in, out] (fp32). The kernel's zero-point term meets d · Σ xq, the rounded values'
    sum, so its result is this one up to fp32 rounding."""
    m, k = x.shape
    groups = x.float().view(m, k // 32, 32)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127.0
    xq = torch.where(scale > 0, torch.round(groups / scale), torch.zeros_like(groups)) * scale
    return xq.view(m, k) @ w


def _int16_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What quantising each group of 32 activations to int16 (scale max|x| / 32767, the AVX2
    kernel's) may move each output by at most: half a step per activation times |w|."""
    m, k = x.shape
    half_step = x.double().view(m, k // 32, 32).abs().amax(-1) / 32767 / 2  # [M, G]
    return half_step @ w.double().abs().view(k // 32, 32, -1).sum(1)  # [M, out]


@pytest.mark.parametrize("rows", [1, 2, 5, 13, 16])
@pytest.mark.parametrize("out_f,in_f", [(128, 64), (192, 256)])
def test_int4_bf16_dot_kernel_keeps_the_activations_exact(rows: int, out_f: int, in_f: int) -> None:
    """The fused backend's int4 path for few rows: codes widened in registers, multiplied with
    the activations as they are (AVX-512: bf16 exactly, fp32 as two bf16 terms; AVX2: each
    group of 32 rounded to int16, within half a step of 2^-15 of its largest value). Against
    the exact product in fp64 it is off by that and its output's rounding only — where the int8
    activations of llama.cpp's arithmetic lose a group's precision to an outlier — and a row's
    result does not depend on the rows beside it. On AVX-512 its repacked weight widens to
    exactly torch's (the prefill path)."""
    from dsinfer.layers.int4_pack import int4_block_rows
    from dsinfer.layers.quant import quantize_int4

    if not torch.ops.dsinfer.int4_vnni_supported():
        pytest.skip("neither AVX512-VNNI/BF16 nor AVX2/FMA: int4 keeps torch's packed kernel")
    g = torch.Generator().manual_seed(5)
    q = quantize_int4(torch.randn(out_f, in_f, generator=g) * 0.05, 32, torch.bfloat16)
    codes, sz = torch.ops.dsinfer.int4_vnni_pack(
        q["qweight"], 32, q["scales_zeros"], int4_block_rows()
    )
    avx512 = torch.ops.dsinfer.int8_vnni_supported()
    if avx512:
        wt = torch.ops.dsinfer.int4_dequantize_t(q["qweight"], 32, q["scales_zeros"])
        assert torch.equal(torch.ops.dsinfer.int4_vnni_dequantize_t(codes, sz), wt)
    w_exact = torch._weight_int4pack_mm_for_cpu(
        torch.eye(in_f), q["qweight"], 32, q["scales_zeros"].float()
    )  # [in, out]: (q - 8)·s + z in fp32
    x = torch.randn(rows, in_f, generator=g)
    x[:, 5] = 8.0  # an outlier: int8 activations would lose its group's small values
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-8)):
        xd = x.to(dtype)
        want = xd.double() @ w_exact.double()
        got = torch.ops.dsinfer.int4_bf16_linear(xd, codes, sz)
        assert got.dtype == dtype and got.shape == (rows, out_f)
        err = (got.double() - want).abs()
        bound = tol * want.abs() + 1e-4
        if not avx512:
            bound = bound + _int16_bound(xd, w_exact)
        assert (err <= bound).all(), err.max()
        int8_err = (_q8_reference(xd, w_exact).double() - want).abs()
        assert err.mean() * 4 < int8_err.mean()
        alone = torch.cat([torch.ops.dsinfer.int4_bf16_linear(r, codes, sz) for r in xd.split(1)])
        assert torch.equal(got, alone)


def test_torch_int4_blocks_of_32_rows_repack_like_blocks_of_64() -> None:
    """AVX2 builds of torch pack int4 in 32-row blocks: the repacking reads either layout into
    the same packed weight (codes given in both layouts here, whatever this CPU packs)."""
    from dsinfer.layers.int4_pack import pack_blocks64

    g = torch.Generator().manual_seed(8)
    codes = torch.randint(0, 16, (128, 64), generator=g, dtype=torch.uint8)
    blocks = codes.reshape(4, 32, 64).transpose(-1, -2)  # [O/32, K, 32]
    blocks32 = (blocks[..., :16] | (blocks[..., 16:] << 4)).reshape(128, 32)
    sz = torch.rand(2, 128, 2, generator=g)
    a = torch.ops.dsinfer.int4_vnni_pack(pack_blocks64(codes), 32, sz, 64)
    b = torch.ops.dsinfer.int4_vnni_pack(blocks32, 32, sz, 32)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # The layout's definition: per 16 outputs and 8 inputs, lane l's byte i holds input i of
    # output l (low nibble) and input i + 4 (high).
    c = codes.view(128 // 16, 16, 64 // 8, 2, 4)  # [ob, l, kc, half, i]
    want = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 1, 3).reshape(8, 8, 64)
    assert torch.equal(a[0], want)
    with pytest.raises(RuntimeError, match="blocks of 64 or 32"):
        torch.ops.dsinfer.int4_vnni_pack(blocks32, 32, sz, 16)


@pytest.mark.parametrize("rows", [1, 3, 16, 65])
def test_int8_int8_dot_kernel_equals_its_definition(rows: int) -> None:
    """The wide int8 layers' VNNI kernel (the LM head under int4/int8) against the same
    arithmetic in torch (activations quantised per group of 32, exact integer dots); its packed
    weight widens back to exactly the int8 values; a row's result does not depend on its batch;
    and a layer repacked by the fused backend answers as the kernel does (rows > 64: widened)."""
    from dsinfer.layers.quant import Int8LinearMethod, quantize_int8

    if not torch.ops.dsinfer.int8_vnni_supported():
        pytest.skip("no AVX512-VNNI/BF16 on this CPU: int8 keeps its fp32-widening kernel")
    out_f, in_f = 8192, 96
    g = torch.Generator().manual_seed(5)
    q = quantize_int8(torch.randn(out_f, in_f, generator=g), torch.float32)
    packed = torch.ops.dsinfer.int8_vnni_pack(q["qweight"])
    widened = torch.ops.dsinfer.int8_vnni_dequantize_t(packed)
    assert torch.equal(widened.float(), q["qweight"].float().t())
    x = torch.randn(rows, in_f, generator=g)
    x[:, 7] = 9.0  # an outlier: its group's other activations lose precision, as defined
    groups = x.view(rows, in_f // 32, 32)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 127.0
    xq = (torch.round(groups / scale) * scale).view(rows, in_f)
    want = (xq.double() @ q["qweight"].double().t()) * q["scales"].double()
    got = torch.ops.dsinfer.int8_vnni_linear(x, packed, q["scales"])
    torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=1e-4)
    one = torch.ops.dsinfer.int8_vnni_linear(x[-1:].contiguous(), packed, q["scales"])
    assert torch.equal(one, got[-1:])
    layer = Linear(in_f, out_f, method=Int8LinearMethod())
    layer.qweight.data.copy_(q["qweight"])
    layer.scales.data.copy_(q["scales"])
    layer.use_kernels(FUSED_CPU, "cpu")
    assert layer.method.vnni and layer.qweight.shape == packed.shape
    y = layer(x)
    if rows <= 64:
        assert torch.equal(y, got)
    else:  # the dense path: the exact int8 weight, the activations unquantised
        torch.testing.assert_close(
            y.double(),
            (x.double() @ q["qweight"].double().t()) * q["scales"].double(),
            atol=1e-3,
            rtol=1e-4,
        )


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 127, 128])
@pytest.mark.parametrize("out_f,in_f", [(64, 96), (576, 1536)])
def test_narrow_int8_kernel_equals_its_definition(rows: int, out_f: int, in_f: int) -> None:
    """The other int8 layers' AVX-512 kernel (int8_vnni_i16_linear, over the repacked weight):
    activations rounded to int16 per group of 32, d = max|x| / 32767, exact integer dots.
    Against that definition in fp64 (fp32 rows) and against the unrounded product within half
    a step a weight (both dtypes); a row's result does not depend on its batch; a layer the
    fused backend repacked answers as the kernel below 128 rows and as the exact int8 weight
    widened from 128; and a stack of int8 experts is repacked and multiplied the same way."""
    from dsinfer.layers.moe import MoEConfig, RoutedExperts
    from dsinfer.layers.quant import Int8ExpertsMethod, Int8LinearMethod

    if not torch.ops.dsinfer.int8_vnni_i16_supported():
        pytest.skip("neither AVX512-VNNI/BF16 nor AVX2: narrow int8 layers keep torch's layout")
    # Widened for a dense GEMM from 128 rows where bf16 GEMMs are native (AVX-512), never on
    # AVX2 (torch's bf16 GEMM emulated there).
    dense_from = 128 if torch.ops.dsinfer.int8_vnni_supported() else 0
    g = torch.Generator().manual_seed(13)
    q = quantize_int8(torch.randn(out_f, in_f, generator=g), torch.float32)
    packed = torch.ops.dsinfer.int8_vnni_pack(q["qweight"])
    x = torch.randn(rows, in_f, generator=g)
    x[:, 7] = 9.0  # an outlier sets its group's step
    groups = x.view(rows, in_f // 32, 32)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    # fp32, as the kernel rounds: x · (32767 / max|x|) to nearest even (a tensor division:
    # `32767 / amax` would multiply by amax's reciprocal, another fp32 value).
    inv = torch.full_like(amax, 32767.0) / amax
    xq = torch.round(groups * inv) * (amax / 32767)
    w = q["qweight"].double() * q["scales"].double()[:, None]
    want = xq.view(rows, in_f).double() @ w.t()
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = torch.ops.dsinfer.int8_vnni_i16_linear(xd, packed, q["scales"])
        assert got.dtype == dtype and got.shape == (rows, out_f)
        if dtype == torch.float32:  # fp32 sums of exact integer dots: their rounding only
            scale_of_terms = xq.view(rows, in_f).double().abs() @ w.abs().t()
            assert ((got.double() - want).abs() <= 1e-6 * scale_of_terms + 1e-6).all()
        exact = xd.double() @ w.t()
        step = xd.double().view(rows, -1, 32).abs().amax(-1) / 32767  # [rows, groups]
        half_steps = (step / 2) @ w.abs().view(out_f, -1, 32).sum(-1).t()
        bound = half_steps + (2**-8 if dtype == torch.bfloat16 else 1e-5) * exact.abs() + 1e-4
        assert ((got.double() - exact).abs() <= bound).all()
        alone = torch.cat(
            [torch.ops.dsinfer.int8_vnni_i16_linear(r, packed, q["scales"]) for r in xd.split(1)]
        )
        assert torch.equal(got, alone)
    layer = Linear(in_f, out_f, method=Int8LinearMethod())
    layer.qweight.data.copy_(q["qweight"])
    layer.scales.data.copy_(q["scales"])
    layer.use_kernels(FUSED_CPU, "cpu")
    assert layer.method.vnni and not layer.method.wide and torch.equal(layer.qweight, packed)
    assert layer.method.dense_from == dense_from
    widened = dense_from and rows >= dense_from
    xb = x.bfloat16()
    kernel = torch.ops.dsinfer.int8_vnni_i16_linear(xb, packed, q["scales"])
    # The widened weight is exact: the layer's GEMM equals one on the same [in, out] layout
    # (another layout may take another GEMM, whose sums differ in order: oneDNN on AMX).
    dense = (xb @ q["qweight"].bfloat16().t().contiguous()) * q["scales"]
    assert torch.equal(layer(xb), dense if widened else kernel)
    # Two experts, hidden in_f, intermediate out_f / 2: w13 [2, out_f, in_f], w2 [2, in_f, out_f / 2].
    cfg = MoEConfig(hidden_size=in_f, intermediate_size=out_f // 2, num_experts=2, top_k=1)
    experts = RoutedExperts(cfg)
    experts.set_method(Int8ExpertsMethod())
    for which, shape in (("13", (2, out_f, in_f)), ("2", (2, in_f, out_f // 2))):
        part = [quantize_int8(torch.randn(shape[1:], generator=g), torch.float32) for _ in "ab"]
        getattr(experts, f"q{which}").data.copy_(torch.stack([p["qweight"] for p in part]))
        getattr(experts, f"s{which}").data.copy_(torch.stack([p["scales"] for p in part]))
    plain = experts.q2[1].clone()
    experts.method.use_kernels(experts, FUSED_CPU, "cpu")
    assert experts.method.vnni
    assert torch.equal(experts.q2[1], torch.ops.dsinfer.int8_vnni_pack(plain))
    h = torch.randn(rows, out_f // 2, generator=g).bfloat16()
    got = experts.method.matmul(experts, h, "2", 1)
    if not widened:
        assert torch.equal(
            got, torch.ops.dsinfer.int8_vnni_i16_linear(h, experts.q2[1], experts.s2[1])
        )
    else:
        assert torch.equal(got, (h @ plain.bfloat16().t().contiguous()) * experts.s2[1])


def test_int8_activations_take_the_int8_kernel_on_narrow_int8_layers() -> None:
    """--int8-activations all (or out_proj, for the blocks' output projections): with AVX-512
    a narrow int8 layer meets the head's int8 × int8 kernel up to 64 rows, the widened weight
    past them; other layers keep the int16 kernel."""
    import dataclasses

    from dsinfer.layers.quant import Int8LinearMethod

    if not torch.ops.dsinfer.int8_vnni_supported():
        pytest.skip("no AVX512-VNNI/BF16 on this CPU: int8 layers keep int16 activations")
    g = torch.Generator().manual_seed(14)
    q = quantize_int8(torch.randn(64, 96, generator=g), torch.bfloat16)
    packed = torch.ops.dsinfer.int8_vnni_pack(q["qweight"])
    for policy, out_proj, int8 in (
        ("all", False, True),
        ("out_proj", True, True),
        ("out_proj", False, False),
    ):
        layer = Linear(96, 64, method=Int8LinearMethod(), parallel="row" if out_proj else None)
        layer.qweight.data.copy_(q["qweight"])
        layer.scales.data = q["scales"].clone()  # bf16, the compute dtype (as a model loads)
        layer.use_kernels(dataclasses.replace(FUSED_CPU, int8_activations=policy), "cpu")
        assert layer.method.int8 == int8
        for rows in (1, 64, 65):
            x = torch.randn(rows, 96, generator=g).bfloat16()
            if not int8:
                want = torch.ops.dsinfer.int8_vnni_i16_linear(x, packed, q["scales"])
            elif rows <= 64:
                want = torch.ops.dsinfer.int8_vnni_linear(x, packed, q["scales"])
            else:
                want = (x @ q["qweight"].bfloat16().t()) * q["scales"]
            assert torch.equal(layer(x), want), (policy, out_proj, rows)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16])
@pytest.mark.parametrize("out_f,in_f", [(97, 72), (64, 4128)])
def test_int8_int16_dot_kernel_equals_its_definition(rows: int, out_f: int, in_f: int) -> None:
    """The wide int8 layers' AVX2 kernel (the LM head under int4/int8 on a CPU without
    AVX-512): each row of activations rounded to int16 with one scale, max|x| / 32767, exact
    integer dots in torch's own int8 layout. Against that definition in fp64; against the
    unrounded product within half a step a weight; a row's result does not depend on its
    batch. Shapes: an odd output count (the last weight row pairs with itself), inputs not a
    multiple of 16 (a scalar tail), and past 2048 inputs (the int32 sums are widened to fp32
    every 2048)."""
    from dsinfer.layers.quant import quantize_int8

    if not torch.ops.dsinfer.int8_i16_supported():
        pytest.skip("not an AVX2 build without AVX-512 VNNI/BF16: the head has int8_vnni_linear")
    g = torch.Generator().manual_seed(11)
    q = quantize_int8(torch.randn(out_f, in_f, generator=g), torch.float32)
    x = torch.randn(rows, in_f, generator=g)
    x[:, 7] = 9.0  # an outlier sets the row's step
    amax = x.abs().amax(dim=1, keepdim=True)
    d, xq = amax / 32767, torch.round(x * (32767 / amax))  # fp32, as the kernel rounds
    w = q["qweight"].double() * q["scales"].double()[:, None]
    want = (xq.double() @ q["qweight"].double().t()) * d.double() * q["scales"].double()
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = torch.ops.dsinfer.int8_i16_linear(xd, q["qweight"], q["scales"])
        assert got.dtype == dtype and got.shape == (rows, out_f)
        if dtype == torch.float32:
            torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-5)
        exact = xd.double() @ w.t()
        half_step = xd.double().abs().amax(dim=1, keepdim=True) / 32767 / 2
        bound = (
            half_step * w.abs().sum(1)
            + (2**-8 if dtype == torch.bfloat16 else 1e-5) * exact.abs()
            + 1e-4
        )
        assert ((got.double() - exact).abs() <= bound).all()
        alone = torch.cat(
            [torch.ops.dsinfer.int8_i16_linear(r, q["qweight"], q["scales"]) for r in xd.split(1)]
        )
        assert torch.equal(got, alone)


def test_wide_int8_layers_take_the_int16_kernel_on_avx2() -> None:
    """A wide int8 layer under the fused backend on an AVX2 build keeps torch's layout and
    answers as int8_i16_linear up to 64 rows, as int8_mm past them."""
    from dsinfer.layers.quant import Int8LinearMethod, int8_mm, quantize_int8

    if not torch.ops.dsinfer.int8_i16_supported():
        pytest.skip("not an AVX2 build without AVX-512 VNNI/BF16: the head has int8_vnni_linear")
    out_f, in_f = 8192, 96
    g = torch.Generator().manual_seed(12)
    q = quantize_int8(torch.randn(out_f, in_f, generator=g), torch.float32)
    layer = Linear(in_f, out_f, method=Int8LinearMethod())
    layer.qweight.data.copy_(q["qweight"])
    layer.scales.data.copy_(q["scales"])
    layer.use_kernels(FUSED_CPU, "cpu")
    assert layer.method.i16 and not layer.method.vnni and torch.equal(layer.qweight, q["qweight"])
    for rows in (1, 64, 65):
        x = torch.randn(rows, in_f, generator=g).bfloat16()
        want = (
            torch.ops.dsinfer.int8_i16_linear(x, q["qweight"], q["scales"])
            if rows <= 64
            else int8_mm(x, q["qweight"], q["scales"], fused=True)
        )
        assert torch.equal(layer(x), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 16, 65])
def test_lm_heads_fp32_logits_are_its_output_widened(dtype: torch.dtype, rows: int) -> None:
    """The LM head's logits in fp32 (apply_fp32): the kernel's fp32 output (int8_vnni_linear
    with AVX-512, int8_i16_linear with AVX2) is its x-dtype output widened, bit for bit, and the layer answers as `apply(...).float()` does at any
    row count (rows > 64 and layers with a bias take apply's path)."""
    from dsinfer.layers.quant import Int8LinearMethod, quantize_int8

    vnni = torch.ops.dsinfer.int8_vnni_supported()
    if not (vnni or torch.ops.dsinfer.int8_i16_supported()):
        pytest.skip("neither AVX512-VNNI/BF16 nor AVX2: the head keeps the fp32 kernel")
    out_f, in_f = 8192, 64
    g = torch.Generator().manual_seed(7)
    q = quantize_int8(torch.randn(out_f, in_f, generator=g), torch.float32)
    x = (torch.randn(rows, in_f, generator=g) * 3).to(dtype)
    for bias in (None, torch.randn(out_f, generator=g).to(dtype)):
        layer = Linear(in_f, out_f, bias=bias is not None, method=Int8LinearMethod())
        layer.qweight.data.copy_(q["qweight"])
        layer.scales.data.copy_(q["scales"].to(dtype))
        if bias is not None:
            layer.bias.data.copy_(bias)
        layer.use_kernels(FUSED_CPU, "cpu")
        want = layer.method.apply(layer, x, layer.bias).float()
        got = layer.method.apply_fp32(layer, x, layer.bias)
        assert got.dtype == torch.float32 and torch.equal(got, want)
    kernel = torch.ops.dsinfer.int8_vnni_linear if vnni else torch.ops.dsinfer.int8_i16_linear
    widened = kernel(x, layer.qweight, layer.scales, True)
    narrow = kernel(x, layer.qweight, layer.scales)
    assert narrow.dtype == dtype and torch.equal(widened, narrow.float())


@pytest.mark.parametrize("vocab", [1, 15, 16, 33, 49152])
def test_argmax_kernel_is_torchs_argmax(vocab: int) -> None:
    """Greedy tokens: the first index of the largest value, a row's first NaN if it has one,
    index 0 for a row of -inf (torch.argmax's answers), whatever the vocabulary's tail."""
    from dsinfer.worker.token_draw import greedy_tokens

    g = torch.Generator().manual_seed(8)
    for trial in range(12):
        # Few distinct values: ties everywhere, across lanes and into the tail.
        x = torch.randint(-3, 3, (6, vocab), generator=g).float()
        x[0, -1] = 5.0  # the largest value in the last position
        if trial % 3 == 0:
            x[1][torch.rand(vocab, generator=g) < 0.05] = float("nan")
            x[1, -1] = float("nan")
        x[2] = float("-inf")
        x[3, vocab // 2 :] = float("inf")
        x[4, 0] = float("nan")
        want = x.argmax(dim=-1)
        assert torch.equal(torch.ops.dsinfer.argmax_rows(x), want), (vocab, trial)
        assert greedy_tokens(x) == want.tolist()


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4, 9])
# lora 512: whole passes of lanes (V2-Lite's); 48: one-vector passes after the first.
@pytest.mark.parametrize("heads,nope,v,lora", [(16, 128, 128, 512), (3, 8, 12, 48)])
def test_mla_projections_read_kv_b_as_the_reference_multiplies(
    weight_dtype: torch.dtype, rows: int, heads: int, nope: int, v: int, lora: int
) -> None:
    """MLA's absorbed decode around the latent attention: q_nope · W_UK and o_lat · W_UVᵀ from
    kv_b_proj's weight in its own dtype equal the reference's einsums over an fp32 copy (the
    same products, summed in another order)."""
    if not torch.ops.dsinfer.mla_projections_supported(lora):
        pytest.skip("neither AVX-512 nor AVX2: MLA's projections stay the reference's einsums")
    g = torch.Generator().manual_seed(9)
    kv_b = (torch.randn(heads * (nope + v), lora, generator=g) * 0.05).to(weight_dtype)
    w = kv_b.float().view(heads, nope + v, lora)
    q_nope = torch.randn(rows, heads, nope, generator=g).to(torch.bfloat16)
    o_lat = torch.randn(rows, heads, lora, generator=g)
    want_q = torch.einsum("bhn,hnl->bhl", q_nope.float(), w[:, :nope])
    want_o = torch.einsum("bhl,hvl->bhv", o_lat, w[:, nope:])
    got_q = torch.ops.dsinfer.mla_absorb_query(q_nope, kv_b, v)
    got_o = torch.ops.dsinfer.mla_expand_output(o_lat, kv_b, nope)
    assert got_q.dtype == got_o.dtype == torch.float32
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_o, want_o, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("heads,nope,v,lora", [(16, 128, 128, 512), (3, 8, 12, 48)])
def test_mla_prefill_expansion_reads_kv_b_as_the_reference_multiplies(
    weight_dtype: torch.dtype, tokens: int, heads: int, nope: int, v: int, lora: int
) -> None:
    """MLA's prefill: C latents expanded to every head's keys and values from kv_b_proj's
    weight in its own dtype equal the reference's einsums over an fp32 copy; the fused
    backend's _expand returns them in the reference's [H, C, ·] layout."""
    from dsinfer.layers.attention.fused_cpu import FusedCpuMLAAttention

    if not torch.ops.dsinfer.mla_projections_supported(lora):
        pytest.skip("neither AVX-512 nor AVX2: MLA's prefill keeps the reference's einsums")
    g = torch.Generator().manual_seed(11)
    kv_b = (torch.randn(heads * (nope + v), lora, generator=g) * 0.05).to(weight_dtype)
    w = kv_b.float().view(heads, nope + v, lora)
    c = torch.randn(tokens, lora, generator=g)
    want_k = torch.einsum("cl,hnl->hcn", c, w[:, :nope])
    want_v = torch.einsum("cl,hvl->hcv", c, w[:, nope:])
    got = torch.ops.dsinfer.mla_expand_latent(c, kv_b, heads)  # [C, H, nope + v]
    assert got.shape == (tokens, heads, nope + v) and got.dtype == torch.float32
    torch.testing.assert_close(got[..., :nope].transpose(0, 1), want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[..., nope:].transpose(0, 1), want_v, atol=1e-5, rtol=1e-5)
    attn = FusedCpuMLAAttention.__new__(FusedCpuMLAAttention)
    attn.h, attn.nope, attn.lora = heads, nope, lora
    k_nope, values = attn._expand(c, kv_b)
    torch.testing.assert_close(k_nope, want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, want_v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "queries,before", [(1, 0), (5, 0), (128, 0), (300, 0), (1, 40), (200, 77), (129, 256)]
)
def test_mla_prefill_attends_in_query_chunks_as_the_reference_sdpa(
    queries: int, before: int
) -> None:
    """The fused MLA prefill attends in chunks of 128 queries, each against the keys up to its
    last query with only its diagonal block masked; it equals the reference's SDPA (causal, or
    masked after cached tokens) across chunk edges, short chunks and a chunk after a cache."""
    from dsinfer.layers.attention.fused_cpu import FusedCpuMLAAttention
    from dsinfer.layers.attention.mla import MLAPagedAttention

    heads, nope, rope, v, lora = 4, 16, 8, 12, 32
    g = torch.Generator().manual_seed(queries * 1000 + before)
    q = torch.randn(heads, queries, nope + rope, generator=g)
    k = torch.randn(heads, before + queries, nope + rope, generator=g)
    values = torch.randn(heads, before + queries, v, generator=g)
    want = MLAPagedAttention(heads, nope, rope, v, lora, 0.4)._attend(q, k, values, before)
    got = FusedCpuMLAAttention(heads, nope, rope, v, lora, 0.4)._attend(q, k, values, before)
    assert got.shape == (heads, queries, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tied_embedding_reads_the_quantised_heads_rows() -> None:
    """A tied vocabulary is kept once: after the fused backend repacks the int8 head, the
    embedding drops its float table and looks rows up in the head (w · s, as the head
    multiplies with); on the reference backend both keep their own."""
    from dsinfer.layers.embedding import LMHead, VocabEmbedding
    from dsinfer.layers.quant import Int8LinearMethod, quantize_int8

    vnni = torch.ops.dsinfer.int8_vnni_supported()
    if not (vnni or torch.ops.dsinfer.int8_i16_supported()):
        pytest.skip("neither AVX512-VNNI/BF16 nor AVX2: the head keeps the fp32 kernel")
    vocab, hidden = 8192, 64
    g = torch.Generator().manual_seed(6)
    for kernels, dropped in ((REFERENCE, False), (FUSED_CPU, True)):
        embed = VocabEmbedding(vocab, hidden)
        embed.weight.data = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
        head = LMHead(vocab, hidden, tied_to=embed)
        q = quantize_int8(embed.weight.data, torch.bfloat16)
        head.set_method(Int8LinearMethod())
        head.qweight.data, head.scales.data = q["qweight"], q["scales"]
        ids = torch.tensor([0, 5, 8191, 5, 4096])
        before = embed(ids)
        head.use_kernels(kernels, "cpu")
        assert (embed.weight.numel() == 0) is dropped
        got = embed(ids)
        if dropped:
            want = (q["qweight"][ids].float() * q["scales"][ids].float()[:, None]).bfloat16()
            assert torch.equal(got, want)
            assert (got.float() - before.float()).abs().max() < 0.05  # int8 rows of the table
        else:
            assert torch.equal(got, before)
    if vnni:
        with pytest.raises(RuntimeError, match="out of range"):
            torch.ops.dsinfer.int8_vnni_rows(
                head.qweight, head.scales, torch.tensor([vocab]), torch.float32
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mla_decode_rotary_and_latent_write_match_the_reference(dtype: torch.dtype) -> None:
    """A decode-only MLA step on the fused backend (de-interleave, rotary and the latent's cache
    write in one kernel) gives the reference's attention and cache: fp32 to rounding, bf16
    within the reference's own bf16 rounding of the rotated parts (it rotates in fp32)."""
    from dsinfer.layers.attention import FusedCpuMLAAttention
    from dsinfer.layers.attention.mla import MLAPagedAttention

    heads, nope, rope_d, v, lora, bs = 4, 16, 8, 12, 32, 4
    lens, tables = [5, 9, 1], [[3, 0], [1, 4, 6], [2]]
    g = torch.Generator().manual_seed(11)
    args = (heads, nope, rope_d, v, lora, 0.3)
    ref, fused = MLAPagedAttention(*args), FusedCpuMLAAttention(*args)
    cache = (torch.randn(8, bs, lora + rope_d, generator=g) * 0.5).to(dtype)
    kv_b = (torch.randn(heads * (nope + v), lora, generator=g) * 0.1).to(dtype)
    q = torch.randn(3, heads, nope + rope_d, generator=g).to(dtype)
    kv = torch.randn(3, lora + rope_d, generator=g).to(dtype)
    c = kv[:, :lora] * 0.5  # stands in for the normed latent
    meta = decode_metadata(lens, tables, bs)
    rope = RotaryEmbedding(rope_d, 64, RopeConfig()).cos_sin(meta.decode_seq_lens - 1, dtype)
    calls: list[int] = []
    real = torch.ops.dsinfer.mla_rope_decode

    def counted(*a):  # noqa: ANN002, ANN202
        calls.append(1)
        return real(*a)

    want_cache, got_cache = cache.clone(), cache.clone()
    want = ref.forward_rope(q, kv, c, rope, want_cache, kv_b, meta)
    torch.ops.dsinfer.mla_rope_decode = counted  # type: ignore[misc]
    try:
        got = fused.forward_rope(q, kv, c, rope, got_cache, kv_b, meta)
    finally:
        torch.ops.dsinfer.mla_rope_decode = real  # type: ignore[misc]
    assert calls == [1] and got.dtype == dtype and got.shape == (3, heads, v)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)
    slots = (meta.slot_blocks, meta.slot_offsets)
    assert torch.equal(got_cache[slots][:, :lora], c)  # the latent as given
    assert torch.equal(got_cache[slots][:, :lora], want_cache[slots][:, :lora])
    torch.testing.assert_close(got_cache[slots].float(), want_cache[slots].float(), **tol)
    untouched = torch.ones(8, bs, dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(got_cache[untouched], cache[untouched])  # nothing else written


@pytest.mark.parametrize("rows", [1, 5, 6, 7, 8, 9, 16])
def test_int4_int8_activations_kernel_is_llama_cpps_arithmetic(rows: int) -> None:
    """--int8-activations: int4_i8_linear rounds each group of 32 activations to int8 (scale
    max|x| / 127, half to even) and multiplies them with the codes in exact integers; the zero
    points meet the rounded activations' sum (the exact sum there left each rounding error on
    the uncentred codes: 2.3x the error, until session 22; the rows of all-15 codes below have
    zero points far from -8 s, where that is off by far more than the tolerance). Against the
    same arithmetic in torch (_q8_reference)
    it is off by fp32 rounding only, for fp32 and bf16 rows; a row's result does not depend on
    the rows beside it (chunks of 6 rows, 8 on AVX-512, and their remainders); the int16 pair
    sums of a group (AVX2) do not saturate at the extremes (every code 15, every activation at
    ±127)."""
    from dsinfer.layers.int4_pack import int4_block_rows
    from dsinfer.layers.quant import quantize_int4

    if not torch.ops.dsinfer.int4_i8_supported():
        pytest.skip("no AVX2 + FMA: the int8-activation kernel is not built here")
    g = torch.Generator().manual_seed(11)
    out_f, in_f = 192, 256
    weights = torch.randn(out_f, in_f, generator=g) * 0.05
    weights[:64] = weights[:64].abs() + 1.0  # a block of rows whose codes are all 15 at x ≥ 0
    q = quantize_int4(weights, 32, torch.bfloat16)
    codes, sz = torch.ops.dsinfer.int4_vnni_pack(
        q["qweight"], 32, q["scales_zeros"], int4_block_rows()
    )
    w_exact = torch._weight_int4pack_mm_for_cpu(
        torch.eye(in_f), q["qweight"], 32, q["scales_zeros"].float()
    )  # [in, out]
    x = torch.randn(rows, in_f, generator=g)
    x[0] = 3.0  # every activation of row 0 rounds to +127
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        got = torch.ops.dsinfer.int4_i8_linear(xd, codes, sz)
        assert got.dtype == dtype and got.shape == (rows, out_f)
        want = _q8_reference(xd, w_exact)
        tol = 1e-5 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=1e-4 * want.abs().max().item())
        alone = torch.cat([torch.ops.dsinfer.int4_i8_linear(r, codes, sz) for r in xd.split(1)])
        assert torch.equal(got, alone)
    # Coarser than the int16 kernel (random rows: row 0 above rounds exactly).
    x = torch.randn(4, in_f, generator=g)
    exact = x.double() @ w_exact.double()
    i16 = torch.ops.dsinfer.int4_bf16_linear(x, codes, sz)
    i8 = torch.ops.dsinfer.int4_i8_linear(x, codes, sz)
    assert (i8.double() - exact).abs().mean() > 4 * (i16.double() - exact).abs().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_accelerator_set_norms_as_the_reference_does(dtype: torch.dtype) -> None:
    """Off the CPU the fused backend takes torch's RMSNorm (one fused kernel on CUDA): on the
    same rows it gives the reference's norm to fp32 rounding in fp32 and within one bf16 ulp
    in bf16 (one rounding instead of two), and the same residual sum."""
    from dsinfer.layers.backend import kernels_of
    from dsinfer.layers.kernels import FUSED_ACCELERATOR, FUSED_CPU, REFERENCE

    assert kernels_of("fused", device_type="cuda") is FUSED_ACCELERATOR
    assert kernels_of("fused", device_type="npu") is FUSED_ACCELERATOR
    assert kernels_of("fused", device_type="cpu") is FUSED_CPU
    assert kernels_of("reference", device_type="cuda") is REFERENCE
    g = torch.Generator().manual_seed(0)
    x, res = (torch.randn(5, 96, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    ulp = 1e-6 if dtype == torch.float32 else 2**-7  # relative
    want = REFERENCE.rms_norm(x, w, 1e-6).float()
    got = FUSED_ACCELERATOR.rms_norm(x, w, 1e-6).float()
    assert ((got - want).abs() <= ulp * want.abs() + 1e-6).all()
    (got_n, got_sum), (want_n, want_sum) = (
        k.add_rms_norm(x, res, w, 1e-6) for k in (FUSED_ACCELERATOR, REFERENCE)
    )
    assert torch.equal(got_sum, want_sum)
    assert ((got_n.float() - want_n.float()).abs() <= ulp * want_n.float().abs() + 1e-6).all()
