"""DeepSeek (MLA + MoE) artifacts: experts quantise as int8 stacks (int4 under int4 where the
kernel takes their shapes), kv_b_proj stays float."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.artifact.compiler import CompileOptions, compile_artifact
from dsinfer.artifact.manifest import read_manifest
from tests.helpers import DEEPSEEK_CASES as CASES
from tests.helpers import DEEPSEEK_COMMON as COMMON
from tests.helpers import (
    assert_pool_clean,
    decode_logits,
    full_logits,
    fused_cpu_has,
    tokens_match_up_to_near_tie,
)
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
    assert experts.method.scheme == "int8" and "w13" not in dict(experts.named_parameters())
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
    assert model.model.layers[1].mlp.experts.method.scheme == "int8"
    # The method says the format (the fused backend may have repacked the bytes since).
    assert model.model.layers[1].mlp.shared_experts.gate_up_proj.method.scheme == quant
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.fixture(scope="module")
def v3_int4_experts_src(tmp_path_factory):
    """Expert shapes the int4 kernel takes (moe_intermediate_size 32: groups of 32 fit)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    path = tmp_path_factory.mktemp("v3-int4-src")
    torch.manual_seed(8)
    cfg = {**COMMON, **CASES["v3"][1], "moe_intermediate_size": 32}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg))
    with torch.no_grad():  # make routing matter
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    _tokenizer_files(path)
    return path


def test_int4_artifact_keeps_int4_experts_on_both_backends(v3_int4_experts_src, tmp_path):
    """Routed experts whose shapes fit the kernel are int4 under int4 (half the bytes of int8
    stacks, which a decode step streams); the fused backend's greedy tokens and logits follow
    the reference backend's on the same artifact."""
    art = tmp_path / "int4"
    compile_artifact(str(v3_int4_experts_src), art, CompileOptions(quant="int4"))
    formats = read_manifest(art).quantization["layer_formats"]
    assert "model.layers.1.mlp.experts" not in formats  # the scheme itself: int4
    direct = LLM(str(v3_int4_experts_src), dtype="float32", num_blocks=64, block_size=4)
    ids = [1, 5, 9, 33, 200, 7, 3, 99]
    want = full_logits(direct.engine, ids)
    runs = {}
    for backend in ("reference", "fused"):
        llm = LLM(str(art), backend=backend, num_blocks=64, block_size=4)
        experts = llm.engine.executor.runner.model.model.layers[1].mlp.experts
        assert experts.q13.dtype == torch.uint8 and type(experts.method).__name__ == (
            "Int4ExpertsMethod"
        )
        # The fused int4 layout where the CPU runs the fused int4 kernels (AVX2 or AVX-512).
        assert experts.method.vnni == (backend == "fused" and fused_cpu_has("int4_vnni"))
        got = full_logits(llm.engine, ids).float()
        cos = torch.nn.functional.cosine_similarity(want, got, dim=-1)
        assert cos.min() > 0.98, (backend, cos)
        prompts = [{"prompt_token_ids": ids}, {"prompt_token_ids": ids[:3]}]
        greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        runs[backend] = (got, tokens, llm)
        assert_pool_clean(llm.engine)
    (ref_logits, ref_tokens, ref), (fused_logits, fused_tokens, _) = (
        runs["reference"],
        runs["fused"],
    )
    assert (ref_logits - fused_logits).abs().max() <= 2e-2  # the bf16 gate
    for p, a, b in zip(prompts, fused_tokens, ref_tokens, strict=True):
        ids_p = p["prompt_token_ids"]
        with torch.inference_mode():
            logits = decode_logits(ref.engine, ids_p + b)[len(ids_p) - 1 : -1]
        # Random tiny weights give near-flat logits: a part at top-2 within 1e-2 is a tie.
        assert tokens_match_up_to_near_tie(a, b, logits, tol=1e-2), (a, b)
