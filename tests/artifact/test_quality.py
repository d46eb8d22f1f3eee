"""Perplexity gates on SmolLM2 over a fixed text: int8 within +1%, int4 within +8% of fp32."""

from __future__ import annotations

import math

import pytest

from dsinfer import LLM, SamplingParams

TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in "
    "Europe experimented with two-wheeled machines that riders pushed along with their feet. "
    "Pedals attached to the front wheel arrived in the 1860s, and within two decades the safety "
    "bicycle, with a chain driving the rear wheel and two wheels of equal size, had replaced the "
    "tall and dangerous penny-farthing. Pneumatic tyres made riding comfortable, and the bicycle "
    "became cheap enough for workers to use every day. Cities grew around the new mobility: "
    "people could live farther from factories, and women in particular gained a freedom of "
    "movement that changed social life. Today, engineers design frames from steel, aluminium "
    "and carbon fibre, and electric motors help riders climb hills. Many cities build protected "
    "lanes because cycling reduces traffic, noise and pollution, and because regular exercise "
    "improves health. A well-maintained bicycle can last for decades: the chain should be "
    "cleaned and oiled, the tyres kept at the right pressure, and the brakes checked often."
)


def perplexity(llm: LLM) -> float:
    ids = llm.tokenizer.encode(TEXT)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=0))
    lps = [e.logprob for e in out[0].prompt_logprobs[1:]]
    assert len(lps) == len(ids) - 1 > 200
    return math.exp(-sum(lps) / len(lps))


@pytest.fixture(scope="module")
def fp32_ppl(smol_llm) -> float:
    return perplexity(smol_llm)


@pytest.mark.parametrize(("quant", "limit"), [("int8", 0.01), ("int4", 0.08)])
def test_quantised_perplexity_gate(smol_artifacts, keys, fp32_ppl, quant, limit):
    llm = LLM(str(smol_artifacts[quant]), trusted_keys=[str(keys[1])], kv_cache_memory="64MiB")
    ppl = perplexity(llm)
    rise = ppl / fp32_ppl - 1
    print(f"perplexity fp32 {fp32_ppl:.4f}, {quant} {ppl:.4f} ({rise:+.2%})")
    assert rise < limit, (fp32_ppl, ppl)
