"""Reading GGUF: our header parser and fast block decoder against the gguf package."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from dsinfer.models.gguf_file import _fast_dequantize


@pytest.mark.parametrize("qname", ["Q4_0", "Q4_1", "Q8_0"])
def test_fast_dequantize_is_bit_exact(qname: str) -> None:
    qtype = gguf.GGMLQuantizationType[qname]
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    blocks = gguf.quants.quantize(x, qtype)
    want = np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32).reshape(-1)
    got = _fast_dequantize(blocks, qname)
    assert got is not None and torch.equal(got, torch.from_numpy(want.copy()))


def test_other_types_take_the_reference_path() -> None:
    assert _fast_dequantize(np.zeros(4, dtype=np.uint8), "Q6_K") is None


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
