"""Tiny random Llama and Qwen2 checkpoints written by transformers: logits and greedy parity."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    VOCAB,
    assert_batched_greedy_matches,
    assert_logits_match,
    save_and_load,
)

CASES = {
    "llama-gqa-untied": ("llama", dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3-rope": (
        "llama",
        dict(
            num_key_value_heads=2,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "qwen2-tied": ("qwen2", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-untied": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=False)),
}


# Every case on both backends: the reference stays the oracle, the fused path must match it.
PARAMS = [(case, backend) for case in sorted(CASES) for backend in ("reference", "fused")]


@pytest.fixture(scope="module", params=PARAMS, ids=[f"{c}-{b}" for c, b in PARAMS])
def tiny(request, tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    case, backend = request.param
    family, extra = CASES[case]
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(sum(map(ord, case)))
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, **extra))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**common, **extra))
        with torch.no_grad():  # random init leaves biases at zero: make them count
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    llm = save_and_load(model, tmp_path_factory.mktemp(case), backend)
    assert llm.engine.executor.runner.backend == backend
    return llm, model


def test_logits_match(tiny):
    llm, ref = tiny
    assert_logits_match(llm, ref, (1, 7, 33), VOCAB, 1e-4)


def test_greedy_matches_batched(tiny):
    llm, ref = tiny
    assert_batched_greedy_matches(llm, ref, (3, 9, 17, 30), VOCAB, 20)


def test_bos_rule_from_tokenizer_config(tiny):
    llm, _ = tiny
    assert llm.tokenizer.encode("w5 w6") == [1, 5, 6]
