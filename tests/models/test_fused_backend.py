"""The fused backend against the reference on the same real weights (SmolLM2).

fp32 isolates the kernels: the two backends must agree to ~1e-4. In bf16 the reference is
itself only as exact as bf16 allows: its own decode and prefill paths differ by up to ~0.8 in a
logit of ~30 (measured), so the fused path is held to twice that disagreement — a broken kernel
is off by whole units — and to the greedy text and the perplexity.

int4 on the fused backend multiplies the codes with the activations as they are (bf16, fp32
sums; on AVX2 CPUs, by default, rounded to int8 per group of 32: --int8-activations auto),
without the reference's bf16 rounding of each dequantised weight; its LM head (int8
under int4) quantises the activations to int8 per group of 32. Its logits differ from the
reference's by 0.06-0.08 on average and up to 1.2, once each row's mean is taken out (0.12-0.14
and up to 1.24 with the int8 activations of AVX2 CPUs' default; ~0.6 and up to ~3 with those of
session 15, which were wrong). A row's raw logits also move together, by up to ±0.68 in these
prompts: a one-ulp bf16 change in one of SmolLM2's massive hidden activations, whose column of
the tied embedding is nearly the same for every token, shifts a whole row. No probability sees
such a shift (softmax takes differences), so the test compares centred rows. Before session
30 it compared raw logits, and a build for AVX-512 CPUs without VNNI failed it on such a shift
(mean 0.55, 0.12 centred). The fused path is held to the
issue's quality gate: perplexity within 0.5% of the reference's on a 1,388-token text, as a
prompt (prefill kernels) and fed a token a step (decode kernels; the int8 activations of the
int4 projections until session 15 were +1.0% off there, 28.82 → 29.12, and had passed an
81-token text by chance; these are −0.1%) — greedy text identical up to near-ties, and logits
within mean 0.3 / max 2.0, centred (a wrong code, scale or group is off by far more).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.device import native_bf16_matmul
from tests.conftest import PROMPTS
from tests.helpers import decode_logits, full_logits, skip_without, tokens_match_up_to_near_tie

# ~1,500 tokens of plain English prose written for this test.
LONG_TEXT = Path(__file__).parents[1] / "data" / "long_text.txt"


def test_default_engine_runs_the_fused_backend(smol_llm, smol_llm_reference):
    """The engine tests (batching, chunked prefill, preemption, prefix hits) use smol_llm:
    they are the fused path's tests as long as this holds."""
    assert smol_llm.engine.executor.runner.backend == "fused"
    assert smol_llm_reference.engine.executor.runner.backend == "reference"


def _greedy(llm: LLM, prompts: list[str], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


# make test-slow: in make test both backends meet transformers at every position in fp32
# (test_smollm2_parity.py), which bounds their difference too.
@pytest.mark.slow
def test_fp32_fused_equals_reference(smol_llm, smol_llm_reference):
    for prompt in PROMPTS[:3]:
        ids = smol_llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            err = decode_logits(smol_llm.engine, ids) - decode_logits(
                smol_llm_reference.engine, ids
            )
        assert err.abs().max().item() < 2e-3, prompt
    ours, ref = _greedy(smol_llm, PROMPTS[:2], 16), _greedy(smol_llm_reference, PROMPTS[:2], 16)
    for prompt, a, b in zip(PROMPTS[:2], ours, ref, strict=True):
        ids = smol_llm.tokenizer.encode(prompt)
        with torch.inference_mode():
            logits = decode_logits(smol_llm_reference.engine, ids + b)[len(ids) - 1 : -1]
        assert tokens_match_up_to_near_tie(a, b, logits, tol=1e-2), prompt


def _centred(rows: torch.Tensor) -> torch.Tensor:
    """Each row less its mean over the vocabulary: what softmax sees of a row's logits."""
    return rows - rows.mean(-1, keepdim=True)


def _perplexity(llm: LLM, ids: list[int]) -> float:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=0, prompt_logprobs=0))
    lps = [e.logprob for e in out[0].prompt_logprobs[1:]]
    return math.exp(-sum(lps) / len(lps))


@torch.inference_mode()
def _decode_perplexity(llm: LLM, ids: list[int]) -> float:
    logp = torch.log_softmax(decode_logits(llm.engine, ids)[:-1].double(), dim=-1)
    return math.exp(-logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].mean().item())


# int4 is the default path (make test); bf16 without quantisation and int8 (the narrow layers'
# int16 activations: +0.18% prompt, -0.01% decode measured) run in make test-slow.
@pytest.mark.parametrize(
    "quantization",
    [
        pytest.param("none", marks=pytest.mark.slow),
        "int4",
        pytest.param("int8", marks=pytest.mark.slow),
    ],
)
def test_bf16_fused_within_the_references_own_noise(quantization: str):
    ref = LLM(
        "smollm2",
        dtype="bfloat16",
        quantization=quantization,
        backend="reference",
        kv_cache_memory="64MiB",
    )
    fused = LLM(
        "smollm2",
        dtype="bfloat16",
        quantization=quantization,
        backend="fused",
        kv_cache_memory="64MiB",
    )
    for prompt in PROMPTS[:3]:
        ids = ref.tokenizer.encode(prompt)
        with torch.inference_mode():
            want = decode_logits(ref.engine, ids)
            noise = (want - full_logits(ref.engine, ids)).abs().max().item()
            diff = decode_logits(fused.engine, ids) - want
        if quantization != "none":  # int4's unrounded weights, int8 LM-head activations
            err = _centred(diff).abs()  # a row's common shift changes no probability
            assert err.mean().item() <= 0.3 and err.max().item() <= 2.0, (prompt, err.max())
        else:
            assert diff.abs().max().item() <= 2 * noise + 0.1, (
                prompt,
                diff.abs().max().item(),
                noise,
            )
    # The gate's text is long: on an 81-token one single bf16 roundings move perplexity by
    # ~1% (the reference's own decode against its prompt: unquantised 7.815 against 7.908; a
    # one-ulp change in some attention rows: 0.8%), which hid a real +1.9% once (module
    # docstring). As a prompt (prefill kernels), then fed one token a step (decode kernels:
    # the LM head's int8 × int8 one among them), held to the reference's same path.
    ids = ref.tokenizer.encode(LONG_TEXT.read_text())
    p_ref, p_fused = _perplexity(ref, ids), _perplexity(fused, ids)
    assert abs(p_fused - p_ref) / p_ref < 0.005, (p_fused, p_ref)
    p_ref, p_fused = _decode_perplexity(ref, ids), _decode_perplexity(fused, ids)
    assert abs(p_fused - p_ref) / p_ref < 0.005, (p_fused, p_ref)
    ours, theirs = _greedy(fused, PROMPTS[:3], 24), _greedy(ref, PROMPTS[:3], 24)
    for prompt, a, b in zip(PROMPTS[:3], ours, theirs, strict=True):
        ids = ref.tokenizer.encode(prompt)
        with torch.inference_mode():
            logits = decode_logits(ref.engine, ids + b)[len(ids) - 1 : -1]
        # bf16's near-tie: within the reference's own decode/prefill disagreement.
        assert tokens_match_up_to_near_tie(a, b, logits, tol=1.0), (prompt, a, b)


def test_int8_activations_hold_the_quality_gate():
    """--int8-activations all rounds every int4 layer's activations to int8 (llama.cpp's
    arithmetic; the default wherever the kernel runs, so the test above holds it to the gate
    in both paths too): the long text's prompt perplexity stays within 0.5% of the reference's (+0.27%
    measured; the kernel's zero points met the exact activations' sum until session 22, +0.93%
    here) and differs from the exact kernel's (a kernel that silently fell back to the int16
    one would not). Where bf16 GEMMs are native (AVX512-BF16) prefill chunks of 512 rows or
    more widen the weight for one dense GEMM whatever the policy, so there the same is held
    of the text decoded token by token too. The greedy text of a prompt keeps its first
    tokens."""
    skip_without("int4_i8")
    common = dict(dtype="bfloat16", quantization="int4", kv_cache_memory="64MiB")
    ref = LLM("smollm2", backend="reference", **common)
    exact = LLM("smollm2", backend="fused", int8_activations="none", **common)
    int8 = LLM("smollm2", backend="fused", int8_activations="all", **common)
    ids = ref.tokenizer.encode(LONG_TEXT.read_text())
    p_ref, p_exact, p_int8 = (_perplexity(llm, ids) for llm in (ref, exact, int8))
    assert abs(p_int8 - p_ref) / p_ref < 0.005, (p_int8, p_ref)
    assert abs(p_exact - p_ref) / p_ref < 0.005, (p_exact, p_ref)
    # The text's last prefill chunk is shorter than 512 rows: it takes the policy's kernel on
    # every CPU.
    assert p_int8 != p_exact, (p_int8, p_exact)
    if native_bf16_matmul(torch.device("cpu")):
        # The full chunks took the dense bf16 GEMM whatever the policy: the text decoded token
        # by token holds int8 to the gate in every row (+0.39% measured on the AVX-512 machine;
        # a 160-token stretch alone swings +1.4%).
        d_ref, d_exact, d_int8 = (_decode_perplexity(llm, ids) for llm in (ref, exact, int8))
        assert abs(d_int8 - d_ref) / d_ref < 0.005, (d_int8, d_ref)
        assert d_int8 != d_exact, (d_int8, d_exact)
    ours, theirs = _greedy(int8, PROMPTS[:1], 4), _greedy(ref, PROMPTS[:1], 4)
    assert ours[0][:2] == theirs[0][:2], (ours, theirs)
