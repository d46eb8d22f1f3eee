"""Seeded random workloads on the fused backend against the reference, each prompt alone.

The scenario tests (test_batching.py) pick one pressure at a time. Here a seed draws all of
them at once — block size, token budget (chunk sizes down to 7 tokens), sequence cap, a pool
too small for the load (preemption), prefix caching with prompts that share prefixes,
prompt-lookup drafts (prompts that say a part twice), predicted outputs (the reference's
own answer with one token changed: drafts kept up to the edit, then found again), arrivals
over several steps and aborts — and every request that finishes must give the greedy tokens
of the reference backend running its prompt alone (fp32: up to a near-tie of 1e-3). Then the
pool must be clean. Three models: a tiny Llama (the fused MHA kernels and the captured decode
program), a tiny DeepSeek-V3 (MLA's latent cache and kernels, routed experts) and a tiny
DeepSeek-V3.2 (sparse attention: the indexer's keys cached beside the latent).
`make test` runs 32 and 12 seeds; `-m slow` some hundreds more."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from dsinfer import LLM, SamplingParams
from tests.helpers import (
    DEEPSEEK_CASES,
    DEEPSEEK_COMMON,
    VOCAB,
    assert_pool_clean,
    full_logits,
    tiny_llama_dir,
    write_tiny_tokenizer,
)


def _deepseek_v3_dir(path):  # noqa: ANN001, ANN202
    """A tiny DeepSeek-V3 with a router that matters (the parity tests' recipe)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = {**DEEPSEEK_COMMON, **DEEPSEEK_CASES["v3"][1], "max_position_embeddings": 512}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**config))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=g)
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3, generator=g)
    model.save_pretrained(path)
    write_tiny_tokenizer(path)
    return path


def _deepseek_v32_dir(path):  # noqa: ANN001, ANN202
    """A tiny DeepSeek-V3.2 whose indexer keeps 8 tokens a query (the workloads' prompts run
    to ~100 tokens: sparse attention nearly everywhere), as tests/models/test_deepseek_v32.py
    builds it."""
    from tests.helpers import tiny_deepseek_v32

    tiny_deepseek_v32(max_positions=512).save_pretrained(path)
    write_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(11)
    return tiny_llama_dir(tmp_path_factory.mktemp("random-workloads"), max_positions=512)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    torch.manual_seed(3)
    return _deepseek_v3_dir(tmp_path_factory.mktemp("random-workloads-v3"))


@pytest.fixture(scope="module")
def deepseek_v32(tmp_path_factory):
    return _deepseek_v32_dir(tmp_path_factory.mktemp("random-workloads-v32"))


@pytest.fixture(scope="module", params=["llama", "deepseek", "deepseek_v32"])
def model(request) -> tuple[str, LLM]:
    """(checkpoint, its reference engine)."""
    path = str(request.getfixturevalue(request.param))
    return path, LLM(path, backend="reference", dtype="float32", num_blocks=256, block_size=16)


def _workload(rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """Prompts (half of them extending a shared base, for prefix-cache hits; some saying a
    part twice, for prompt-lookup drafts) and their lengths of output."""
    base = [rng.randrange(3, VOCAB) for _ in range(rng.randint(0, 60))]
    prompts = []
    for _ in range(rng.randint(2, 16)):
        shared = base[: rng.randint(0, len(base))] if rng.random() < 0.5 else []
        own = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 90))]
        prompts.append(shared + (own + own if rng.random() < 0.3 else own))
    return prompts, [rng.randint(1, 24) for _ in prompts]


def _engine_options(rng: random.Random, prompts: list[list[int]], new: list[int]) -> dict:
    bs = rng.choice([4, 8, 16])
    blocks = [-(-(len(p) + n) // bs) for p, n in zip(prompts, new, strict=True)]
    return {
        "block_size": bs,
        # From the largest request's need (one must fit alone) to ample: the small end preempts.
        "num_blocks": max(max(blocks) + 1, int(sum(blocks) * rng.choice([0.3, 0.6, 1.5]))),
        "max_num_batched_tokens": rng.choice([7, 16, 64, 512]),
        "max_num_seqs": rng.choice([2, 5, 16]),
        "enable_prefix_caching": rng.random() < 0.7,
        "ngram_speculation": rng.choice([0, 0, 4]),
    }


def _run(
    llm: LLM,
    rng: random.Random,
    prompts: list[list[int]],
    new: list[int],
    predictions: dict[int, list[int]],
) -> tuple[dict[int, list[int]], int]:
    """Up to three arrivals a step, an abort now and then; the tokens of each request (an
    aborted one: an empty list), and the drafts kept of the requests with a prediction."""
    eng = llm.engine
    pending = list(enumerate(prompts))
    index: dict[str, int] = {}
    done: dict[int, list[int]] = {}
    kept = 0
    while pending or eng.has_unfinished_requests():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, p = pending.pop(0)
                params = SamplingParams(
                    temperature=0, max_tokens=new[i], ignore_eos=True, prediction=predictions.get(i)
                )
                index[eng.add_request(p, params)] = i
        running = [rid for rid, i in index.items() if i not in done]
        if running and rng.random() < 0.04:
            rid = rng.choice(running)
            eng.abort_request(rid)
            done[index[rid]] = []
        for out in eng.step():
            if out.finished and out.request_id in index and index[out.request_id] not in done:
                done[index[out.request_id]] = out.outputs[0].token_ids
                if index[out.request_id] in predictions:
                    kept += out.metrics.num_accepted_draft_tokens
    return done, kept


def _agrees(reference: LLM, prompt: list[int], got: list[int], want: list[int]) -> bool:
    if got == want:
        return True
    k = next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)
    if k is None:
        return False  # lengths differ
    top2 = torch.topk(full_logits(reference.engine, prompt + want[:k])[-1], 2).values
    return float(top2[0] - top2[1]) <= 1e-3


def _alone(reference: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    """The reference's greedy tokens for one prompt, run alone."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return list(reference.generate({"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids)


def _check_seed(seed: int, model: tuple[str, LLM]) -> dict[str, int]:
    """Runs one seed's workload and checks it; what pressure it applied."""
    checkpoint, reference = model
    rng = random.Random(seed)
    prompts, new = _workload(rng)
    options = _engine_options(rng, prompts, new)
    wants: dict[int, list[int]] = {}
    predictions: dict[int, list[int]] = {}
    for i in range(len(prompts)):
        if new[i] >= 4 and rng.random() < 0.3:  # the answer, one token in its middle edited
            wants[i] = _alone(reference, prompts[i], new[i])
            edited = list(wants[i])
            edited[len(edited) // 2] = (edited[len(edited) // 2] + 1) % VOCAB
            predictions[i] = edited
    llm = LLM(checkpoint, backend="fused", dtype="float32", **options)
    assert llm.engine.executor.runner.backend == "fused"
    got, kept_of_predictions = _run(llm, rng, prompts, new, predictions)
    assert_pool_clean(llm.engine)
    assert sorted(got) == list(range(len(prompts))), "a request neither finished nor was aborted"
    finished = {i: tokens for i, tokens in got.items() if tokens}
    for i, tokens in finished.items():
        want = wants[i] if i in wants else _alone(reference, prompts[i], new[i])
        assert _agrees(reference, prompts[i], tokens, want), (seed, options, i, tokens, want)
    eng = llm.engine
    return {
        "preemptions": eng.scheduler.num_preemptions,
        "prefix hits": eng.pool.hits,
        "aborts": len(prompts) - len(finished),
        "chunked prompts": sum(len(p) > options["max_num_batched_tokens"] for p in prompts),
        "drafts kept": eng.scheduler.num_accepted_draft_tokens,
        "predicted drafts kept": kept_of_predictions,
    }


SEEDS = {"llama": 32, "deepseek": 12, "deepseek_v32": 8}  # in `make test`; the soak: the next


def test_random_workloads_give_each_prompts_own_tokens(model, request):
    """Together the seeds must have preempted, hit the prefix cache, aborted, chunked and
    kept prompt-lookup and predicted drafts, or the test would pass without testing what it
    says."""
    seen = Counter()
    for seed in range(SEEDS[request.node.callspec.params["model"]]):
        seen.update(_check_seed(seed, model))
    pressures = (
        "preemptions",
        "prefix hits",
        "aborts",
        "chunked prompts",
        "drafts kept",
        "predicted drafts kept",
    )
    assert all(seen[k] > 0 for k in pressures), seen


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(32, 400))
def test_random_workload_soak(seed: int, model):
    _check_seed(seed, model)
