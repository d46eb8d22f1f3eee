"""Loading diagnostics: each broken checkpoint fails with a message that says what and why."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsinfer import LLM
from dsinfer.models.loader import load_model
from tests.helpers import tiny_llama_dir


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory.mktemp("ck"))


def _copy(src, dst, edit):  # noqa: ANN001
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_missing_tensor(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path / "m", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors.*layers\.1\.mlp\.gate_up_proj.*\[up\]"):
        load_model(str(bad))


def test_unexpected_tensor(ckpt, tmp_path):
    bad = _copy(ckpt, tmp_path / "u", lambda t: t.update(extra=torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected tensors \['extra'\]"):
        load_model(str(bad))


def test_misshaped_tensor(ckpt, tmp_path):
    def edit(t):  # noqa: ANN001
        t["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)

    bad = _copy(ckpt, tmp_path / "s", edit)
    with pytest.raises(
        ValueError, match=r"k_proj.weight.*checkpoint has \(8, 32\).*expects \(16, 32\)"
    ):
        load_model(str(bad))


def test_unsupported_architecture(ckpt, tmp_path):
    import shutil

    shutil.copytree(ckpt, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'MambaForCausalLM'.*Llama"):
        load_model(str(tmp_path / "a"))


def test_bad_dtype_and_paths(ckpt, tmp_path):
    with pytest.raises(ValueError, match="unsupported dtype 'float64'"):
        LLM(str(ckpt), dtype="float64")
    with pytest.raises(ValueError, match="not found"):
        LLM(str(tmp_path / "missing"))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not .gguf"):
        LLM(str(tmp_path / "w.bin"))


def test_sharded_checkpoint_with_index(ckpt, tmp_path):
    import shutil

    d = tmp_path / "sharded"
    shutil.copytree(ckpt, d)
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(d / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(keys, fname))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a = load_model(str(ckpt)).model.state_dict()
    b = load_model(str(d)).model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_prompt_longer_than_context(ckpt):
    llm = LLM(str(ckpt), num_blocks=64, block_size=4)
    with pytest.raises(ValueError, match="70 tokens but this model's context length is 64"):
        llm.generate({"prompt_token_ids": [5] * 70})
    assert not llm.engine.has_unfinished_requests()


def test_auto_quantization_falls_back_to_floats_where_the_device_has_no_kernels():
    """A Q4/Q8 GGUF under `auto` keeps int4/int8 on the CPU and loads as floats on an
    accelerator (its int4/int8 methods, layers/quant_device.py, are asked for by name) and on
    a device with no method; an explicit scheme is kept, so a refusal names the method."""
    from dsinfer.layers.quant import has_method, quant_method
    from dsinfer.models.loader import device_quantization

    assert has_method("int4", "cpu") and has_method("int4", "cuda")
    assert not has_method("int4", "mps") and has_method("none", "mps")
    assert device_quantization("auto", "int4", "cpu") == "int4"
    for device in ("cuda", "npu", "mps"):
        assert device_quantization("auto", "int4", device) == "none"
        assert device_quantization("auto", "int8", device) == "none"
        assert device_quantization("int4", "int4", device) == "int4"
    assert device_quantization("auto", "none", "cuda") == "none"
    with pytest.raises(ValueError, match="no int4 weight method for mps"):
        quant_method("int4", 32, "mps")


def test_auto_dtype_of_a_bf16_checkpoint_is_float32_where_bf16_gemms_are_emulated(
    tmp_path, monkeypatch
):
    """A bf16 checkpoint's float weights meet torch's GEMMs, which a CPU without AVX512-BF16 or
    AMX runs at ~1 GFLOP/s in bf16: `auto` loads it in fp32 there, in bf16 where bf16 is
    native; an explicit dtype is kept either way."""
    import json

    import torch

    import dsinfer.models.loader as loader
    from tests.helpers import tiny_llama_dir

    path = tiny_llama_dir(tmp_path / "m")
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg_file.write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    for native, want in ((False, torch.float32), (True, torch.bfloat16)):
        monkeypatch.setattr(loader, "native_bf16_matmul", lambda dev, n=native: n)
        assert loader.load_model(str(path)).dtype == want
        assert loader.load_model(str(path), dtype="bfloat16").dtype == torch.bfloat16
