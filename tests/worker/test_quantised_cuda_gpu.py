"""int4/int8 weights on CUDA (layers/quant_device.py): torch's tensor-core int4 kernel behind
its probe, against the CPU's int4 methods on the same quantised weights.

Marked `gpu`: not part of `make test` (CPU machines); benchmarks/cuda_check.sh runs them on a
lent GPU. Without a CUDA device they are skipped. Their CPU halves (the portable path's
arithmetic, the layouts, the kernel rules) run everywhere: tests/layers/test_quant_device.py."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams
from tests.helpers import (
    agree_or_near_tie,
    assert_pool_clean,
    decode_logits,
    random_prompts,
    tiny_llama_dir,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# Same int4 codes and scales on both sides; bf16 activations through other kernels.
INT4_LOGITS_TOL = 3e-2


def _int4(path, device: str, backend: str) -> LLM:  # noqa: ANN001
    return LLM(
        str(path),
        device=device,
        backend=backend,
        dtype="bfloat16",
        quantization="int4",
        num_blocks=128,
        block_size=16,
    )


def _kernels(llm: LLM) -> set[str]:
    """The int4 kernels the loaded model's layers and experts took."""
    from dsinfer.layers.quant_device import DeviceInt4ExpertsMethod, DeviceInt4LinearMethod

    found: set[str] = set()
    for module in llm.engine.executor.runner.model.modules():
        method = getattr(module, "method", None)
        if isinstance(method, DeviceInt4LinearMethod):
            found.add(method.weight.kernel)
        elif isinstance(method, DeviceInt4ExpertsMethod):
            found.update(w.kernel for w in method.weights.values())
    return found


def test_the_tensor_core_int4_kernel_passes_its_probe_here() -> None:
    """The probe (tinygemm against the portable path on a random weight) accepts the kernel on
    a GPU of compute capability 8.0 or later: our repacking and its arithmetic agree."""
    from dsinfer.layers.quant_device import tinygemm_refused

    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("the kernel needs compute capability 8.0")
    assert tinygemm_refused(torch.device("cuda")) is None


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # noqa: ANN201
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny"), num_layers=3, max_positions=256)


def test_int4_llama_on_cuda_decodes_like_the_cpu_int4(tiny) -> None:  # noqa: ANN001
    """Quantised on the GPU at load (--quantization int4): the int4 layers take tinygemm and
    the decode steps run as graphs; logits along a decode match the CPU's int4 reference, and
    greedy tokens agree up to near-ties."""
    gpu = _int4(tiny, "cuda", "fused")
    runner = gpu.engine.executor.runner
    assert _kernels(gpu) == {"tinygemm"}
    assert runner.graphs is not None
    cpu = _int4(tiny, "cpu", "reference")
    for ids in random_prompts((7, 40)):
        replays = runner.graphs.replays
        got = decode_logits(gpu.engine, ids).float().cpu()
        assert runner.graphs.replays == replays + len(ids)
        err = (got - decode_logits(cpu.engine, ids).float()).abs().max().item()
        assert err <= INT4_LOGITS_TOL, (len(ids), err)
    prompts = random_prompts((3, 17, 33))
    for ids in prompts:
        ours = gpu.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids
        want = cpu.generate([{"prompt_token_ids": ids}], GREEDY)[0].outputs[0].token_ids
        assert agree_or_near_tie(cpu.engine, ids, ours, want)
    assert_pool_clean(gpu.engine)


def test_int4_deepseek_v2_experts_on_cuda_match_the_cpu_int4(tmp_path) -> None:  # noqa: ANN001
    """DeepSeek-V2 with int4 routed experts (each expert through tinygemm, the loop over the
    experts that received tokens) and int4 shared experts: logits match the CPU's int4."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV2ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV2 to save the tiny model with")
    from tests.helpers import DEEPSEEK_CASES, DEEPSEEK_COMMON, write_tiny_tokenizer

    torch.manual_seed(4)
    shape = {**DEEPSEEK_COMMON, **DEEPSEEK_CASES["v2-lite-shape"][1], "moe_intermediate_size": 64}
    transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**shape)).save_pretrained(
        tmp_path
    )
    write_tiny_tokenizer(tmp_path)
    gpu = _int4(tmp_path, "cuda", "fused")
    assert _kernels(gpu) == {"tinygemm"}
    cpu = _int4(tmp_path, "cpu", "reference")
    for ids in random_prompts((9, 30)):
        got = decode_logits(gpu.engine, ids).float().cpu()
        err = (got - decode_logits(cpu.engine, ids).float()).abs().max().item()
        assert err <= INT4_LOGITS_TOL, (len(ids), err)
    assert_pool_clean(gpu.engine)
