"""int8/int4 weights on accelerators (layers/quant_device.py), on this machine's CPU: the
portable path's arithmetic against the CPU methods on the same stored tensors, the layouts'
round trips, and the rules that pick a kernel. The CUDA kernel itself (tinygemm) is checked
by the gpu-marked tests (tests/worker/test_decode_graphs_gpu.py) on a CUDA machine.

The device methods run here on CPU tensors: their arithmetic is plain torch, the same on
every device, and a CPU tensor gets the portable kernel (no tensor-core kernel here)."""

from __future__ import annotations

import pytest
import torch

from dsinfer.layers.int4_pack import int4pack_codes
from dsinfer.layers.kernels import REFERENCE
from dsinfer.layers.linear import Linear
from dsinfer.layers.moe import MoEConfig, RoutedExperts
from dsinfer.layers.quant import (
    Int4ExpertsMethod,
    Int4LinearMethod,
    Int8ExpertsMethod,
    Int8LinearMethod,
    experts_method,
    quant_method,
    quantize_int4,
    quantize_int8,
)
from dsinfer.layers.quant_device import (
    DeviceInt4ExpertsMethod,
    DeviceInt4LinearMethod,
    DeviceInt8ExpertsMethod,
    DeviceInt8LinearMethod,
    codes_of_nibbles,
    nibbles,
    tinygemm_inner_k_tiles,
    tinygemm_refused,
    tinygemm_shape_unsupported,
    widen_int4,
)

CPU = torch.device("cpu")


def _linear(w: torch.Tensor, method, scheme: str) -> Linear:  # noqa: ANN001
    """A Linear holding w's stored int8/int4 tensors under `method`, prepared for its kernel."""
    lin = Linear(w.shape[1], w.shape[0])
    tensors = (
        quantize_int8(w, torch.bfloat16)
        if scheme == "int8"
        else quantize_int4(w, 32, torch.bfloat16)
    )
    lin.set_method(method)
    for k, v in tensors.items():
        getattr(lin, k).data = v
    lin.use_kernels(REFERENCE, "cpu")
    return lin


def test_the_accelerators_have_int8_and_int4_methods_and_other_devices_are_told_where() -> None:
    for device in ("cuda", "npu"):
        assert isinstance(quant_method("int4", 64, device), DeviceInt4LinearMethod)
        assert quant_method("int4", 64, device).group_size == 64
        assert isinstance(quant_method("int8", 0, device), DeviceInt8LinearMethod)
        assert isinstance(experts_method("int4", 32, device), DeviceInt4ExpertsMethod)
        assert isinstance(experts_method("int8", 0, device), DeviceInt8ExpertsMethod)
    with pytest.raises(ValueError, match="no int4 weight method for mps .*cpu, cuda, npu"):
        quant_method("int4", 32, "mps")


def test_nibbles_round_trip_and_the_stored_codes_reach_the_portable_layout() -> None:
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (64, 96), generator=g, dtype=torch.uint8)
    packed = nibbles(codes)
    assert packed.shape == (64, 48) and packed.dtype == torch.uint8
    assert int(packed[0, 0]) == int(codes[0, 0]) | (int(codes[0, 1]) << 4)
    assert torch.equal(codes_of_nibbles(packed), codes)
    # From an artifact's bytes (torch's CPU int4pack) to the portable bytes: the same codes.
    stored = torch._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
    assert torch.equal(codes_of_nibbles(nibbles(int4pack_codes(stored))), codes)


def test_widened_int4_is_the_cpu_kernels_weight() -> None:
    """widen_int4 gives the weight torch's CPU int4 kernel multiplies by: the identity through
    that kernel reads it back."""
    torch.manual_seed(1)
    w = torch.randn(64, 128) * 0.05
    t = quantize_int4(w, 32, torch.bfloat16)
    eye = torch.eye(128, dtype=torch.bfloat16)
    cpu_weight = torch._weight_int4pack_mm_for_cpu(eye, t["qweight"], 32, t["scales_zeros"]).t()
    ours = widen_int4(nibbles(int4pack_codes(t["qweight"])), t["scales_zeros"], 32, torch.bfloat16)
    torch.testing.assert_close(ours.float(), cpu_weight.float(), atol=1e-3, rtol=1e-2)
    assert (ours.float() - w).abs().max() < 0.05  # and it is w, to int4's precision


@pytest.mark.parametrize("rows", [1, 6, 70])
@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_a_device_linear_multiplies_as_the_cpu_method_does(scheme: str, rows: int) -> None:
    """The same stored tensors through the device method and the CPU one (reference
    kernels): the same products to bf16 rounding, with a bias."""
    torch.manual_seed(2)
    w = torch.randn(96, 128) * 0.05
    if scheme == "int4":
        ours, theirs = (
            _linear(w, DeviceInt4LinearMethod(32), scheme),
            _linear(w, Int4LinearMethod(32), scheme),
        )
        assert ours.method.weight.kernel == "portable"
        assert ours.qweight.shape == (96, 64)  # two codes a byte, scales/zeros as stored
        assert ours.scales_zeros.shape == (4, 96, 2)
    else:
        ours, theirs = (
            _linear(w, DeviceInt8LinearMethod(), scheme),
            _linear(w, Int8LinearMethod(), scheme),
        )
    bias = torch.randn(96).bfloat16()
    ours.bias = theirs.bias = torch.nn.Parameter(bias, requires_grad=False)
    x = torch.randn(rows, 128).bfloat16()
    got, want = ours(x), theirs(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    logits = ours.method.apply_fp32(ours, x, None)
    assert logits.dtype == torch.float32


def test_preparing_twice_keeps_the_prepared_weight() -> None:
    """use_kernels runs once per backend switch; the stored bytes are gone after the first."""
    torch.manual_seed(3)
    lin = _linear(torch.randn(64, 64) * 0.05, DeviceInt4LinearMethod(32), "int4")
    before = lin.qweight.data.clone()
    lin.use_kernels(REFERENCE, "cpu")
    assert torch.equal(lin.qweight.data, before)


def _experts() -> RoutedExperts:
    torch.manual_seed(4)
    cfg = MoEConfig(hidden_size=64, intermediate_size=64, num_experts=4, top_k=2)
    experts = RoutedExperts(cfg)
    experts.w13.data.normal_(0, 0.05)
    experts.w2.data.normal_(0, 0.05)
    return experts


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_device_experts_multiply_as_the_cpu_experts_do(scheme: str) -> None:
    ours, theirs = _experts(), _experts()
    if scheme == "int4":
        cpu_method, device_method = Int4ExpertsMethod(32), DeviceInt4ExpertsMethod(32)
    else:
        cpu_method, device_method = Int8ExpertsMethod(), DeviceInt8ExpertsMethod()
    cpu_method.quantize(theirs, torch.bfloat16)
    device_method.quantize(ours, torch.bfloat16)  # the stored layout is the same
    for name in cpu_method.tensor_names:
        assert torch.equal(getattr(ours, name), getattr(theirs, name))
    theirs.use_kernels(REFERENCE, "cpu")
    ours.use_kernels(REFERENCE, "cpu")
    if scheme == "int4":
        assert {w.kernel for w in device_method.weights.values()} == {"portable"}
        assert ours.q13.shape == (4, 128, 32) and ours.q2.shape == (4, 64, 32)
    torch.manual_seed(5)
    for which, width in (("13", 64), ("2", 64)):
        for e in (0, 3):
            x = torch.randn(5, width).bfloat16()
            got = ours.method.matmul(ours, x, which, e)
            want = theirs.method.matmul(theirs, x, which, e)
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # The whole routed forward, tokens sorted to their experts.
    x = torch.randn(7, 64).bfloat16()
    ids = torch.randint(0, 4, (7, 2))
    weights = torch.rand(7, 2)
    torch.testing.assert_close(
        ours(x, weights, ids).float(), theirs(x, weights, ids).float(), atol=3e-2, rtol=3e-2
    )


def test_the_tensor_core_kernel_is_refused_off_cuda_and_for_shapes_it_does_not_take() -> None:
    assert "no int4 tensor-core kernel for cpu" in tinygemm_refused(CPU)
    assert tinygemm_inner_k_tiles(4096) == 8
    assert tinygemm_inner_k_tiles(576) == 4  # 576 = 36 · 16: 4 tiles of 16, not 8
    assert tinygemm_inner_k_tiles(1568) == 2
    assert tinygemm_inner_k_tiles(40) is None
    assert tinygemm_shape_unsupported(4096, 4096, 128) is None
    assert "group size 16" in tinygemm_shape_unsupported(4096, 4096, 16)
    assert "out_features 4100" in tinygemm_shape_unsupported(4100, 4096, 32)
    assert "in_features 40" in tinygemm_shape_unsupported(64, 40, 32)


def _with_device_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register the accelerators' methods for the CPU, for the engine test below."""
    import dsinfer.layers.quant as quant

    linear = {**quant._LINEAR_METHODS}
    experts = {**quant._EXPERTS_METHODS}
    linear[("int4", "cpu")], linear[("int8", "cpu")] = (
        DeviceInt4LinearMethod,
        DeviceInt8LinearMethod,
    )
    experts[("int4", "cpu")], experts[("int8", "cpu")] = (
        DeviceInt4ExpertsMethod,
        DeviceInt8ExpertsMethod,
    )
    monkeypatch.setattr(quant, "_LINEAR_METHODS", linear)
    monkeypatch.setattr(quant, "_EXPERTS_METHODS", experts)


@pytest.mark.parametrize("model", ["llama", "deepseek-v2"])
def test_an_engine_on_the_device_methods_decodes_as_on_the_cpu_methods(
    model: str, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """The whole engine (load with --quantization int4, quantise, prepare, decode, the int8 LM
    head, int4 routed and shared experts) with the device methods on the portable path gives
    the CPU methods' logits along a decode and their greedy tokens up to near-ties."""
    from dsinfer import LLM, SamplingParams
    from tests.helpers import agree_or_near_tie, decode_logits, random_prompts, tiny_llama_dir

    if model == "llama":
        path = tiny_llama_dir(tmp_path / "m", num_layers=2, max_positions=128)
    else:
        transformers = pytest.importorskip("transformers")
        from tests.helpers import DEEPSEEK_CASES, DEEPSEEK_COMMON, write_tiny_tokenizer

        torch.manual_seed(4)
        # Experts of 64 intermediate rows: int4 (the CPU kernel's shapes), not int8.
        shape = {
            **DEEPSEEK_COMMON,
            **DEEPSEEK_CASES["v2-lite-shape"][1],
            "moe_intermediate_size": 64,
        }
        path = tmp_path / "m"
        transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**shape)).save_pretrained(
            path
        )
        write_tiny_tokenizer(path)
    options = dict(
        dtype="bfloat16", quantization="int4", backend="reference", num_blocks=64, block_size=16
    )
    cpu = LLM(str(path), **options)
    _with_device_methods(monkeypatch)
    device = LLM(str(path), **options)
    methods = {
        type(m.method)
        for m in device.engine.executor.runner.model.modules()
        if hasattr(m, "method")
    }
    assert DeviceInt4LinearMethod in methods and DeviceInt8LinearMethod in methods  # the LM head
    if model == "deepseek-v2":
        assert DeviceInt4ExpertsMethod in methods
    for ids in random_prompts((5, 30)):
        got, want = decode_logits(device.engine, ids), decode_logits(cpu.engine, ids)
        assert (got.float() - want.float()).abs().max().item() <= 3e-2, len(ids)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for ids in random_prompts((4, 19)):
        ours = device.generate([{"prompt_token_ids": ids}], greedy)[0].outputs[0].token_ids
        want = cpu.generate([{"prompt_token_ids": ids}], greedy)[0].outputs[0].token_ids
        assert agree_or_near_tie(cpu.engine, ids, ours, want)


def test_a_new_weight_format_is_declared_where_the_layer_lives() -> None:
    """Quantising at load on a GPU (or assigning an artifact's layout) swaps a layer's method:
    its new tensors are declared on the layer's device, not the CPU (the meta device stands in
    for a GPU here: the same rule, no memory)."""
    from dsinfer.layers.quant import prepare_quantized

    with torch.device("meta"):
        lin = Linear(64, 128)
        experts = RoutedExperts(
            MoEConfig(hidden_size=64, intermediate_size=64, num_experts=4, top_k=2)
        )
    lin.set_method(DeviceInt8LinearMethod())
    assert lin.qweight.device.type == "meta" and lin.scales.device.type == "meta"
    experts.set_method(DeviceInt4ExpertsMethod(32))
    assert {p.device.type for p in experts.parameters()} == {"meta"}
    model = torch.nn.Sequential(Linear(64, 64))
    model.to("meta")
    prepare_quantized(model, "int4", 32, {}, "cuda")
    assert model[0].qweight.device.type == "meta"


def test_random_int4_layouts_on_the_device_methods_decode(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """`random_quant="int4"` (benchmarks/cuda_decode.py --int4 on a GPU): the layouts declared
    by the device methods, filled with random codes, prepared for the portable kernel, decode."""
    from dsinfer import LLM, SamplingParams
    from tests.helpers import tiny_llama_dir

    path = tiny_llama_dir(tmp_path / "m", num_layers=2)
    _with_device_methods(monkeypatch)
    llm = LLM(
        str(path / "config.json"),
        random_weights=True,
        random_quant="int4",
        dtype="bfloat16",
        num_blocks=32,
        block_size=16,
        tokenizer=str(path),
    )
    layer = llm.engine.executor.runner.model.model.layers[0].mlp.gate_up_proj
    assert (
        isinstance(layer.method, DeviceInt4LinearMethod)
        and layer.method.weight.kernel == "portable"
    )
    out = llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=5, ignore_eos=True)
    )
    assert len(out[0].outputs[0].token_ids) == 5
