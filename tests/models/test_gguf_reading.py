"""Reading GGUF: our header parser and fast block decoder against the gguf package."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from dsinfer.models.gguf_file import _fast_dequantize


@pytest.mark.parametrize("qname", ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q6_K"])
def test_fast_dequantize_is_bit_exact(qname: str) -> None:
    """Our torch decoders against the gguf package's (Q6_K's blocks written by our test
    writer, which the package only reads: the layer types a Q4_K_M file keeps in 6 bits)."""
    from tests.gguf_writer import quantize

    qtype = gguf.GGMLQuantizationType[qname]
    x = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    blocks = quantize(x, qname)
    want = np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32).reshape(-1)
    got = _fast_dequantize(blocks.reshape(-1), qname)
    assert got is not None and torch.equal(got, torch.from_numpy(want.copy()))


@pytest.mark.parametrize("qname", ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0", "Q6_K"])
def test_fast_dequantize_in_many_chunks_is_the_same(qname: str, monkeypatch) -> None:
    """Every type is decoded a cache-sized chunk at a time: chunks that do not divide the
    tensor give the same values as the gguf package's whole-tensor decode."""
    import dsinfer.models.gguf_file as gguf_file
    from tests.gguf_writer import quantize

    monkeypatch.setattr(gguf_file, "_VALUES_A_PASS", 768)  # 3 Q4_K/Q6_K blocks, 24 of 32
    x = np.random.default_rng(2).standard_normal((5, 1024)).astype(np.float32) * 0.05
    blocks = quantize(x, qname)
    qtype = gguf.GGMLQuantizationType[qname]
    want = np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32).reshape(-1)
    got = _fast_dequantize(blocks, qname)  # as a tensor's [rows, bytes] map hands it over
    assert got is not None and torch.equal(got, torch.from_numpy(want.copy()))


def test_other_types_take_the_reference_path() -> None:
    assert _fast_dequantize(np.zeros(4, dtype=np.uint8), "Q5_K") is None


def test_reader_equals_the_gguf_package_on_the_real_file(smol_path, tmp_path) -> None:
    from dsinfer.models.gguf_reader import GGUFFile

    ours, ref = GGUFFile(smol_path), gguf.GGUFReader(str(smol_path))
    header = {"GGUF.tensor_count", "GGUF.kv_count", "GGUF.version"}
    assert set(ours.fields) == set(ref.fields) - header
    assert all(ours.fields[k] == ref.fields[k].contents() for k in ours.fields)
    for a, b in zip(ours.tensors, ref.tensors, strict=True):
        assert (a.name, list(a.shape), a.tensor_type) == (b.name, list(b.shape), b.tensor_type)
        assert np.array_equal(a.data, np.asarray(b.data).view(np.uint8).reshape(-1)), a.name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smol_path.read_bytes()[: 50 * 2**20])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        GGUFFile(cut)
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        GGUFFile(tmp_path / "bad.gguf")


@pytest.mark.parametrize("qname", ["Q4_0", "Q4_1"])
def test_q4_blocks_are_our_int4_groups_exactly(qname: str) -> None:
    """x = (q − 8)·scale + zero reproduces the GGUF's own dequantisation in fp32."""
    from dsinfer.models.gguf_int4 import q4_blocks

    qtype = gguf.GGMLQuantizationType[qname]
    x = np.random.default_rng(1).standard_normal((6, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(x, qtype)
    want = np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32).reshape(6, 96)
    q, scale, zero = q4_blocks(blocks.reshape(-1), qname, rows=6)
    got = (q.float() - 8).view(6, 3, 32) * scale[..., None] + zero[..., None]
    torch.testing.assert_close(got.view(6, 96), torch.from_numpy(want), atol=1e-6, rtol=1e-6)


def test_q4_gguf_loads_straight_into_int4(smol_path) -> None:
    """The embedded Q4_1 GGUF: projections packed from its codes (no float copy), equal to
    its dequantised weights up to the bf16 rounding of scale and zero."""
    from dsinfer.models.gguf_file import iter_gguf_tensors, open_gguf
    from dsinfer.models.loader import load_model, read_model_config

    loaded = load_model("smollm2", quantization="auto")
    assert loaded.dtype == torch.bfloat16
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    assert not hasattr(qkv, "weight") and qkv.qweight.dtype == torch.uint8
    cfg = read_model_config(smol_path)
    q_proj = dict(iter_gguf_tensors(open_gguf(smol_path), cfg))[
        "model.layers.0.self_attn.q_proj.weight"
    ]
    eye = torch.eye(qkv.in_features, dtype=torch.bfloat16)
    ours = torch._weight_int4pack_mm_for_cpu(eye, qkv.qweight, 32, qkv.scales_zeros).t().float()
    err = (ours[: q_proj.shape[0]] - q_proj).abs().max().item()
    assert err <= 1e-2 * q_proj.abs().max().item(), err
    head = loaded.model.lm_head
    assert head.qweight.dtype == torch.int8  # the head keeps 8 bits
