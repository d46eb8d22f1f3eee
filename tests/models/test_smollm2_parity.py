"""SmolLM2-135M real weights: our engine against transformers, fp32."""

from __future__ import annotations

import math

import pytest
import torch

from dsinfer import SamplingParams
from tests.conftest import PROMPTS
from tests.helpers import (
    PPL_TEXT,
    assert_pool_clean,
    full_logits,
    hf_greedy,
    tokens_match_up_to_near_tie,
)


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


# Both backends against transformers: the default (fused) and the reference.
BACKENDS = pytest.mark.parametrize("llm_fixture", ["smol_llm", "smol_llm_reference"])
_HF_GREEDY: dict[
    tuple[tuple[int, ...], int], tuple[list[int], torch.Tensor]
] = {}  # both backends share it


@BACKENDS
def test_logits_match_reference_at_every_position(llm_fixture, hf_smol, request):
    smol_llm = request.getfixturevalue(llm_fixture)
    for prompt in PROMPTS[:3]:
        ids = smol_llm.tokenizer.encode(prompt)
        ours = full_logits(smol_llm.engine, ids)
        ref = _hf_logits(hf_smol, ids)
        assert ours.shape == ref.shape
        err = (ours - ref).abs().max().item()
        assert err < 1e-3, f"max |Δlogit| {err} for {prompt!r}"
    assert_pool_clean(smol_llm.engine)


# make test: 2 prompts x 24 tokens; make test-slow: all 8 prompts x 64 tokens.
GREEDY_RUNS = pytest.mark.parametrize(
    ("num_prompts", "num_tokens"),
    [(2, 24), pytest.param(len(PROMPTS), 64, marks=pytest.mark.slow)],
)


@GREEDY_RUNS
@pytest.mark.parametrize(
    "llm_fixture",
    ["smol_llm", pytest.param("smol_llm_reference", marks=pytest.mark.slow)],  # fused: default
)
def test_greedy_tokens_match_reference(llm_fixture, num_prompts, num_tokens, hf_smol, request):
    smol_llm = request.getfixturevalue(llm_fixture)
    params = SamplingParams(temperature=0, max_tokens=num_tokens, ignore_eos=True)
    prompts = PROMPTS[:num_prompts]
    outs = smol_llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = smol_llm.tokenizer.encode(prompt)
        key = (tuple(ids), num_tokens)
        if key not in _HF_GREEDY:
            _HF_GREEDY[key] = hf_greedy(hf_smol, ids, num_tokens)
        ref, ref_logits = _HF_GREEDY[key]
        ours = out.outputs[0].token_ids
        assert len(ours) == num_tokens
        assert tokens_match_up_to_near_tie(ours, ref, ref_logits), (prompt, ours, ref)
    assert_pool_clean(smol_llm.engine)


def test_perplexity_from_prompt_logprobs_matches_reference(smol_llm, hf_smol):
    ids = smol_llm.tokenizer.encode(PPL_TEXT)
    out = smol_llm.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=0)
    )[0]
    assert out.prompt_logprobs[0] is None
    lps = [e.logprob for e in out.prompt_logprobs[1:]]
    assert len(lps) == len(ids) - 1
    ours = math.exp(-sum(lps) / len(lps))
    ref_lp = torch.log_softmax(_hf_logits(hf_smol, ids), dim=-1)
    ref_nll = -ref_lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item()
    ref = math.exp(ref_nll)
    assert abs(ours - ref) / ref < 1e-4, (ours, ref)
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    assert_pool_clean(smol_llm.engine)


def test_chat_answers_paris(smol_llm):
    out = smol_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=40),
    )[0].outputs[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"
