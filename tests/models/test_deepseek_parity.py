"""Tiny random DeepSeek-V2 and V3 checkpoints written by transformers: MLA over a latent KV
cache, DeepSeekMoE, YaRN — logits and greedy tokens against the reference."""

from __future__ import annotations

import pytest
import torch

from dsinfer import SamplingParams
from tests.helpers import DEEPSEEK_CASES as CASES
from tests.helpers import DEEPSEEK_COMMON as COMMON
from tests.helpers import (
    VOCAB,
    assert_batched_greedy_matches,
    assert_logits_match,
    assert_preempted_chunked_and_cached_runs_match,
    save_and_load,
)

PARAMS = [(case, backend) for case in sorted(CASES) for backend in ("reference", "fused")]


@pytest.fixture(scope="module", params=PARAMS, ids=[f"{c}-{b}" for c, b in PARAMS])
def tiny(request, tmp_path_factory):
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    case, backend = request.param
    version, extra = CASES[case]
    torch.manual_seed(3)
    if version == "v2":
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**COMMON, **extra))
    else:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**COMMON, **extra))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # make routing matter: random router, and a real V3 bias
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=g)
            if version == "v3":
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3, generator=g)
    llm = save_and_load(model, tmp_path_factory.mktemp(case), backend)
    return llm, model


def test_logits_match(tiny):
    llm, ref = tiny
    assert_logits_match(llm, ref, (1, 9, 40), VOCAB, 1e-4)


def test_greedy_matches_batched_with_chunks(tiny):
    llm, ref = tiny
    assert_batched_greedy_matches(llm, ref, (3, 11, 26), VOCAB, 32)


def test_absorbed_decode_equals_naive(tiny):
    llm, _ = tiny
    prompt = {"prompt_token_ids": list(range(5, 30))}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    absorbed = llm.generate(prompt, params)[0].outputs[0]
    layers = llm.engine.executor.runner.model.model.layers
    # The fused backend's absorbed decode is its C++ latent-space kernel; naive stays torch.
    backend = llm.engine.config.backend
    want = "FusedCpuMLAAttention" if backend == "fused" else "MLAPagedAttention"
    assert {type(layer.self_attn.attn).__name__ for layer in layers} == {want}
    for layer in layers:
        layer.self_attn.attn.absorb_decode = False
    try:
        naive = llm.generate(prompt, params)[0].outputs[0]
    finally:
        for layer in layers:
            layer.self_attn.attn.absorb_decode = True
    assert absorbed.token_ids == naive.token_ids
    diffs = [
        abs(a.logprob - b.logprob) for a, b in zip(absorbed.logprobs, naive.logprobs, strict=True)
    ]
    assert max(diffs) < 1e-4


def test_kv_cache_keeps_only_the_latent(tiny):
    llm, _ = tiny
    cfg = llm.engine.model_config
    assert llm.engine.kv_bytes_per_token == cfg.num_layers * (16 + 8) * 4
    cache = llm.engine.executor.runner.kv_caches[0]
    assert len(cache) == 1 and cache[0].shape[1:] == (4, 24)


def test_preemption_and_prefix_cache_hits_keep_the_reference_tokens(tiny, tmp_path):
    """A pool so small that requests are preempted and recomputed, prefill in chunks of 8, and
    prompts sharing a prefix run twice (cache hits): greedy tokens stay the reference's, on
    both backends (the fused one writes decode latents with its own kernel, which a prefix hit
    or a recomputation then reads)."""
    llm, ref = tiny
    small = save_and_load(
        ref, tmp_path, llm.engine.config.backend, num_blocks=14, max_num_batched_tokens=8
    )
    assert_preempted_chunked_and_cached_runs_match(small, ref)
