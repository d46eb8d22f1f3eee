"""DeepSeek (MLA + MoE) artifacts: experts quantise as int8 stacks, kv_b_proj stays float."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.artifact.compiler import CompileOptions, compile_artifact
from dsinfer.artifact.manifest import read_manifest
from tests.helpers import DEEPSEEK_CASES as CASES
from tests.helpers import DEEPSEEK_COMMON as COMMON
from tests.helpers import assert_pool_clean, full_logits
from tests.helpers import write_tiny_tokenizer as _tokenizer_files


@pytest.fixture(scope="module")
def v3_src(tmp_path_factory):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = tmp_path_factory.mktemp("v3-src")
    torch.manual_seed(7)
    DeepseekV3ForCausalLM(DeepseekV3Config(**COMMON, **CASES["v3"][1])).save_pretrained(path)
    _tokenizer_files(path)
    return path


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_deepseek_artifact_quantises_experts_and_tracks_fp32(v3_src, tmp_path, quant):
    art = tmp_path / quant
    compile_artifact(str(v3_src), art, CompileOptions(quant=quant))
    formats = read_manifest(art).quantization["layer_formats"]
    assert (formats.get("model.layers.1.mlp.experts") == "int8") == (quant == "int4")
    llm = LLM(str(art), num_blocks=64, block_size=4)
    model = llm.engine.executor.runner.model
    experts = model.model.layers[1].mlp.experts
    assert experts.q13.dtype == torch.int8 and "w13" not in dict(experts.named_parameters())
    assert model.model.layers[0].self_attn.kv_b_proj.weight.is_floating_point()
    direct = LLM(str(v3_src), dtype="float32", num_blocks=64, block_size=4)
    ids = [1, 5, 9, 33, 200, 7, 3, 99]
    cos = torch.nn.functional.cosine_similarity(
        full_logits(direct.engine, ids), full_logits(llm.engine, ids).float(), dim=-1
    )
    assert cos.min() > (0.98 if quant == "int4" else 0.995), cos
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 6
    assert_pool_clean(llm.engine)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_random_weights_in_quantised_layouts(v3_src, quant):
    llm = LLM(
        str(v3_src / "config.json"),
        random_weights=True,
        random_quant=quant,
        dtype="bfloat16",
        num_blocks=32,
        block_size=4,
    )
    model = llm.engine.executor.runner.model
    assert model.model.layers[1].mlp.experts.q13.dtype == torch.int8
    shared = model.model.layers[1].mlp.shared_experts.gate_up_proj
    assert shared.qweight.dtype == (torch.int8 if quant == "int8" else torch.uint8)
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4
