"""compile → verify → load → generate, for none, int8 and int4, from GGUF and from HF."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.artifact.manifest import read_manifest
from dsinfer.artifact.verify import verify_signed
from tests.conftest import PROMPTS
from tests.helpers import assert_pool_clean, full_logits

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]


@pytest.mark.slow  # make test keeps the int8/int4 SmolLM2 artifacts (test_quality.py)
def test_fp32_smollm2_artifact_gives_the_direct_loads_tokens(smol_artifacts, keys, smol_llm):
    art = smol_artifacts["none"]
    manifest = read_manifest(art)
    assert manifest.quantization["dtype"] == "float32"
    assert verify_signed(art, [keys[1]]) == keys[1]
    llm = LLM(str(art), trusted_keys=[str(keys[1])], kv_cache_memory="128MiB")
    assert llm.engine.version == manifest.short_version
    assert _greedy(llm, PROMPTS[:4]) == _greedy(smol_llm, PROMPTS[:4])
    assert_pool_clean(llm.engine)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantised_smollm2_artifacts_answer(smol_artifacts, keys, quant):
    llm = LLM(str(smol_artifacts[quant]), trusted_keys=[str(keys[1])], kv_cache_memory="64MiB")
    assert read_manifest(smol_artifacts[quant]).quantization["dtype"] == "bfloat16"
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))[0]
    assert "Paris" in out.outputs[0].text
    assert_pool_clean(llm.engine)


def test_quantised_artifacts_are_smaller(smol_artifacts):
    from dsinfer.artifact.manifest import config_from_dict
    from dsinfer.planner.model_shape import model_shape

    manifests = {q: read_manifest(smol_artifacts[q]) for q in ("int8", "int4")}
    sizes = {q: sum(f.size for f in m.files) for q, m in manifests.items()}
    # What the fp32 artifact holds: every parameter in 4 bytes (tied head stored once).
    fp32 = 4 * model_shape(config_from_dict(manifests["int8"].model_config)).dense_params
    assert sizes["int8"] < 0.4 * fp32  # the embedding stays bf16
    assert sizes["int4"] < 0.8 * sizes["int8"]


def test_tiny_hf_fp32_artifact_is_exact(tiny_src, tiny_artifacts, keys):
    direct = LLM(str(tiny_src), dtype="float32", num_blocks=64, block_size=4)
    art = LLM(str(tiny_artifacts["none"]), trusted_keys=[str(keys[1])], num_blocks=64, block_size=4)
    ids = [1, 5, 9, 33, 200, 7, 3]
    assert torch.equal(full_logits(art.engine, ids), full_logits(direct.engine, ids))
    prompts = [{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:3]}]
    tok = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in art.generate(prompts, tok)] == [
        o.outputs[0].token_ids for o in direct.generate(prompts, tok)
    ]


@pytest.mark.parametrize("quant", ["bf16", "int8", "int4"])
def test_tiny_hf_quantised_artifact_tracks_fp32(tiny_src, tiny_artifacts, keys, quant):
    direct = LLM(str(tiny_src), dtype="float32", num_blocks=64, block_size=4)
    art = LLM(str(tiny_artifacts[quant]), trusted_keys=[str(keys[1])], num_blocks=64, block_size=4)
    ids = [1, 5, 9, 33, 200, 7, 3, 99, 150, 12]
    ref, got = full_logits(direct.engine, ids), full_logits(art.engine, ids).float()
    cos = torch.nn.functional.cosine_similarity(ref, got, dim=-1)
    assert cos.min() > (0.99 if quant == "int4" else 0.999), cos
    out = art.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 5
    assert_pool_clean(art.engine)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_checkpoint_larger_than_memory_compiles_layer_by_layer(tmp_path, monkeypatch, quant):
    """`dsinfer compile --quant int8|int4` quantises each layer as its fp32 weights arrive:
    with less memory available than the fp32 model takes (which a float load refuses), the
    checkpoint still compiles, and its artifact holds exactly what quantising the whole fp32
    model gives."""
    from safetensors.torch import load_file

    from dsinfer.artifact.compiler import CompileOptions, compile_artifact
    from dsinfer.layers.quant import quantize_model
    from dsinfer.models import loader
    from tests.helpers import tiny_llama_dir

    src = tiny_llama_dir(tmp_path / "src", num_layers=3)
    whole = loader.load_model(str(src), dtype="float32").model
    fp32 = sum(p.numel() * p.element_size() for p in whole.parameters())
    monkeypatch.setattr(loader, "available_bytes", lambda: int(0.75 * fp32))
    with pytest.raises(ValueError, match="more than the .* available"):
        loader.load_model(str(src), dtype="float32")
    opts = CompileOptions(quant=quant, sign_key=None)
    compile_artifact(str(src), tmp_path / "art", opts)
    quantize_model(whole, quant, 32, torch.bfloat16)
    want = {
        n: p.to(torch.bfloat16) if p.is_floating_point() else p
        for n, p in whole.state_dict().items()
    }
    got: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "art").rglob("*.safetensors")):
        got.update(load_file(str(f)))
    assert set(got) <= set(want) and len(got) >= len(want) - 1  # a tied tensor is stored once
    for name, tensor in got.items():
        assert torch.equal(tensor, want[name]), name
