"""Compiled artifacts under --parallel: each rank cuts its part out of the artifact's whole,
fused (and quantised) tensors; greedy tokens equal the same artifact in one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsinfer.artifact.compiler import CompileOptions, compile_artifact
from dsinfer.config import CacheConfig, EngineConfig, SchedulerConfig
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.sampling import SamplingParams
from tests.helpers import PARALLEL_PROMPTS, tiny_llama_dir
from tests.helpers import parallel_generate as _generate


def _config(art) -> EngineConfig:  # noqa: ANN001
    return EngineConfig(
        model=str(art),
        allow_unsigned=True,
        cache=CacheConfig(block_size=4, num_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=4),
    )


def _same_as_single(config: EngineConfig, **grid: int) -> LLMEngine:
    ref = _generate(LLMEngine(config), n=10)
    engine = LLMEngine(dataclasses.replace(config, **grid))
    try:
        assert _generate(engine, n=10) == ref
    except BaseException:
        engine.shutdown()
        raise
    return engine


@pytest.mark.slow  # multi-process: make test-slow
@pytest.mark.parametrize(("quant", "tp"), [("none", 2), ("int8", 2), ("int4", 1)])
def test_llama_artifact_under_a_grid_equals_single_process(tmp_path, quant, tp):
    torch.manual_seed(31)
    src = tiny_llama_dir(tmp_path / "src", num_layers=3, tied=True)
    compile_artifact(str(src), tmp_path / "art", CompileOptions(quant=quant))
    engine = _same_as_single(_config(tmp_path / "art"), tensor_parallel=tp, pipeline_parallel=2)
    try:
        qkv = engine.executor.runner.model.model.layers[0].self_attn.qkv_proj
        assert qkv.out_features == (4 + 2 + 2) * 8 // tp  # 1/tp of each of q, k and v
        if quant != "int4":  # int4 is repacked after loading into the fused kernel's layout
            weight = qkv.weight if quant == "none" else qkv.qweight
            # int8 with our kernels: repacked in blocks of 16 output rows ([O/16, K/4, 64]).
            per_row = 16 if getattr(qkv.method, "vnni", False) else 1
            assert weight.shape[0] * per_row == qkv.out_features
    finally:
        engine.shutdown()


def _greedy_with_logprobs(engine: LLMEngine, n: int = 10) -> list[list]:
    """PARALLEL_PROMPTS' greedy tokens with their logprobs (top 2) from `engine`."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2)
    ids = [engine.add_request(p, params) for p in PARALLEL_PROMPTS]
    done: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].logprobs
    return [done[i] for i in ids]


def _v3_artifact(tmp_path, seed: int, quant: str, **sizes: int):  # noqa: ANN001, ANN202
    """A tiny DeepSeek-V3 checkpoint (routing made to matter) compiled to `quant`."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from tests.helpers import DEEPSEEK_CASES as CASES
    from tests.helpers import DEEPSEEK_COMMON as COMMON
    from tests.helpers import write_tiny_tokenizer as _tokenizer_files

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**COMMON, **CASES["v3"][1], **sizes}))
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5)
    model.save_pretrained(tmp_path / "src")
    _tokenizer_files(tmp_path / "src")
    compile_artifact(str(tmp_path / "src"), tmp_path / "art", CompileOptions(quant=quant))
    return tmp_path / "art"


@pytest.mark.slow  # multi-process: make test-slow
def test_deepseek_v3_int8_artifact_under_tp2_equals_single_process(tmp_path):
    art = _v3_artifact(tmp_path, 32, "int8")
    engine = _same_as_single(_config(art), tensor_parallel=2)
    try:
        experts = engine.executor.runner.model.model.layers[1].mlp.experts
        assert experts.q13.shape[:2] == (8, 24)  # every expert, half its intermediate rows
    finally:
        engine.shutdown()


@pytest.mark.slow  # multi-process: make test-slow
def test_deepseek_v3_int4_artifact_under_tp2_equals_single_process(tmp_path):
    """Int4 tensors cut for tensor parallel (rows of the column-parallel layers, groups of the
    row-parallel ones, the routed experts' intermediate slices) give each rank the weights
    quantising its own cut would: greedy tokens equal one process's."""
    # Sizes whose int4 groups of 32 split over two ranks (the dense MLP, the experts).
    art = _v3_artifact(tmp_path, 34, "int4", intermediate_size=128, moe_intermediate_size=64)
    ref = _greedy_with_logprobs(LLMEngine(_config(art)))
    engine = LLMEngine(dataclasses.replace(_config(art), tensor_parallel=2))
    try:
        # Each rank rounds its partial sums to bf16 before they are added, so a near-tie may
        # part (tiny random weights give near-flat logits); up to that point every token's
        # log-probability is one process's. A wrong cut moves them by tenths.
        for ours, theirs in zip(_greedy_with_logprobs(engine), ref, strict=True):
            for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
                if a.token_id != b.token_id:
                    assert b.top[0][1] - b.top[1][1] <= 2e-2, (i, a, b)  # a near-tie
                    break
                assert abs(a.logprob - b.logprob) <= 2e-2, (i, a, b)
        layers = engine.executor.runner.model.model.layers
        assert layers[1].mlp.experts.q13.dtype == torch.uint8  # int4 experts, half of each
        assert layers[1].mlp.experts.intermediate == 32
        assert type(layers[0].mlp.down_proj.method).__name__ == "Int4LinearMethod"
    finally:
        engine.shutdown()


@pytest.mark.slow  # spawns a grid to see it refused: make test-slow
def test_int4_artifact_that_cannot_be_cut_is_refused(tmp_path):
    torch.manual_seed(33)
    src = tiny_llama_dir(tmp_path / "src")
    compile_artifact(str(src), tmp_path / "art", CompileOptions(quant="int4"))
    # o_proj: 32 output rows, under the 64 of torch's packed blocks (and one group of 32).
    with pytest.raises(Exception, match="int4 .*cannot be cut"):
        LLMEngine(dataclasses.replace(_config(tmp_path / "art"), tensor_parallel=2))
    from dsinfer.distributed.parallel_state import destroy_parallel

    destroy_parallel()
