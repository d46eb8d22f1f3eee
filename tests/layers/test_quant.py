"""INT8/INT4 linear methods against the float matmul they replace."""

from __future__ import annotations

import pytest
import torch

from dsinfer.layers.linear import Linear
from dsinfer.layers.quant import (
    Int4LinearMethod,
    Int8LinearMethod,
    int4_unsupported_reason,
    quantize_int4,
    quantize_int8,
)
from tests.helpers import fused_cpu_has, skip_without


def _quantised(w: torch.Tensor, scheme: str, group: int = 32) -> Linear:
    lin = Linear(w.shape[1], w.shape[0])
    tensors = (
        quantize_int8(w, torch.bfloat16)
        if scheme == "int8"
        else quantize_int4(w, group, torch.bfloat16)
    )
    lin.set_method(Int8LinearMethod() if scheme == "int8" else Int4LinearMethod(group))
    for k, v in tensors.items():
        getattr(lin, k).data = v
    return lin


@pytest.mark.parametrize(("scheme", "tol"), [("int8", 0.015), ("int4", 0.1)])
@pytest.mark.parametrize("rows", [1, 5, 16, 40])
def test_quantised_linear_close_to_float(scheme, tol, rows):
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.02
    x = torch.randn(rows, 128)
    y = _quantised(w, scheme)(x.bfloat16()).float()
    ref = x @ w.t()
    assert ((y - ref).norm() / ref.norm()).item() < tol


def test_int8_packed_and_dense_paths_agree():
    torch.manual_seed(1)
    lin = _quantised(torch.randn(64, 96), "int8")
    x = torch.randn(20, 96).bfloat16()
    dense = lin(x).float()  # 20 rows: the widened-weight GEMM
    packed = torch.cat([lin(x[i : i + 1]) for i in range(20)]).float()  # one row: packed kernel
    assert torch.allclose(dense, packed, rtol=2e-2, atol=2e-2)


def test_int4_reproduces_weights_already_on_its_grid():
    """A weight already on a 4-bit grid per 32-group (like GGUF Q4_1) survives exactly."""
    torch.manual_seed(2)
    q = torch.randint(0, 16, (32, 64)).float()
    q[:, ::32] = 0  # every group spans the whole grid: min 0 …
    q[:, 1::32] = 15  # … max 15
    scale = torch.rand(32, 2).repeat_interleave(32, dim=1) * 0.01 + 0.001
    w = q * scale - 0.05
    t = quantize_int4(w, 32, torch.float32)  # fp32 scales: only the grid is tested here
    eye = torch.eye(64, dtype=torch.float32)
    weight = torch._weight_int4pack_mm_for_cpu(eye, t["qweight"], 32, t["scales_zeros"]).t()
    assert torch.allclose(weight, w, atol=1e-6)


def test_int8_quantisation_in_chunks_is_each_rows_own(monkeypatch) -> None:
    """quantize_int8 takes rows a cache-sized chunk at a time: chunks that do not divide the
    rows give what each row's own scale = max|w| / 127 gives."""
    import dsinfer.layers.quant as quant

    monkeypatch.setattr(quant, "_CODES_CHUNK", 3 * 64)  # 3 rows a chunk, 10 rows
    w = torch.randn(10, 64, generator=torch.Generator().manual_seed(4))
    got = quant.quantize_int8(w, torch.float32)
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    assert torch.equal(got["scales"], scales)
    assert torch.equal(got["qweight"], torch.round(w / scales[:, None]).to(torch.int8))


def test_int4_shape_limits():
    assert int4_unsupported_reason(64, 96, 64) is not None
    assert int4_unsupported_reason(40, 64, 32) is not None
    assert int4_unsupported_reason(64, 128, 64) is None


@pytest.mark.parametrize("in_features", [24, 40, 48])
@pytest.mark.parametrize("rows", [1, 3])
def test_int8_shapes_the_packed_kernel_gets_wrong_take_the_dense_path(in_features, rows):
    torch.manual_seed(3)
    w = torch.randn(64, in_features) * 0.02
    x = torch.randn(rows, in_features)
    y = _quantised(w, "int8")(x.bfloat16()).float()
    ref = x @ w.t()
    assert ((y - ref).norm() / ref.norm()).item() < 0.015


def test_methods_are_registered_by_scheme_and_device() -> None:
    from dsinfer.layers.quant import (
        Int4ExpertsMethod,
        Int8ExpertsMethod,
        experts_method,
        quant_method,
    )

    assert isinstance(quant_method("int8", 0, "cpu"), Int8LinearMethod)
    int4 = quant_method("int4", 64, "cpu")
    assert isinstance(int4, Int4LinearMethod) and int4.group_size == 64
    assert quant_method("none", 32, "cuda") is None  # float formats need no method
    assert isinstance(experts_method("int8", 0, "cpu"), Int8ExpertsMethod)
    int4_experts = experts_method("int4", 64, "cpu")
    assert isinstance(int4_experts, Int4ExpertsMethod) and int4_experts.group_size == 64
    for scheme in ("int8", "int4"):  # the accelerators' methods: tests/layers/test_quant_device.py
        with pytest.raises(ValueError, match=f"no {scheme} weight method for mps.*cpu"):
            quant_method(scheme, 32, "mps")


def test_a_method_owns_its_tensors_and_their_tensor_parallel_cut() -> None:
    """set_method drops exactly the old method's tensors; the cut dims come from the method."""
    lin = Linear(64, 32)
    assert set(lin._parameters) == {"weight"}
    lin.set_method(Int4LinearMethod(32))
    assert set(lin._parameters) == {"qweight", "scales_zeros"}
    lin.set_method(Int8LinearMethod())
    assert set(lin._parameters) == {"qweight", "scales"}
    assert Int8LinearMethod().tp_dims("scales") == (0, None)  # one per output row: whole
    assert Int4LinearMethod(32).tp_dims("scales_zeros") == (1, 0)  # [groups, out, 2]


def test_int8_experts_on_the_fused_backend_take_the_single_row_kernel() -> None:
    """A routed expert's single row goes through the fused int8 kernel (the same fp32
    arithmetic as torch's packed one, faster at expert shapes); several rows keep torch's
    kernel; the reference backend never takes it. Values agree with the dequantised weight."""
    from dsinfer.layers.backend import resolve_backend
    from dsinfer.layers.kernels import FUSED_CPU, REFERENCE
    from dsinfer.layers.moe import MoEConfig, RoutedExperts
    from dsinfer.layers.quant import Int8ExpertsMethod

    assert resolve_backend("fused", torch.device("cpu")).name == "fused"  # kernels loaded
    torch.manual_seed(4)
    experts = RoutedExperts(MoEConfig(hidden_size=64, intermediate_size=48, num_experts=4, top_k=2))
    experts.w13.data.normal_(0, 0.05)
    experts.w2.data.normal_(0, 0.05)
    Int8ExpertsMethod().quantize(experts, torch.bfloat16)
    q, s = experts.q13[1], experts.s13[1]
    calls: list[int] = []
    real = torch.ops.dsinfer.int8_linear

    def counted(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, w, scales)

    x = torch.randn(3, 64).bfloat16()
    want = (x.float() @ (q.float() * s.float()[:, None]).t()).bfloat16()
    for kernels, rows, kernel_rows in ((FUSED_CPU, 1, [1]), (FUSED_CPU, 3, []), (REFERENCE, 1, [])):
        experts.use_kernels(kernels, "cpu")
        calls.clear()
        torch.ops.dsinfer.int8_linear = counted  # type: ignore[misc]
        try:
            got = experts.method.matmul(experts, x[:rows], "13", 1)
        finally:
            torch.ops.dsinfer.int8_linear = real  # type: ignore[misc]
        assert calls == kernel_rows, (kernels.name, rows)
        torch.testing.assert_close(got.float(), want[:rows].float(), atol=2e-2, rtol=1e-2)


def _experts(intermediate: int, hidden: int = 64, seed: int = 4):  # noqa: ANN202
    from dsinfer.layers.moe import MoEConfig, RoutedExperts

    torch.manual_seed(seed)
    cfg = MoEConfig(hidden_size=hidden, intermediate_size=intermediate, num_experts=4, top_k=2)
    experts = RoutedExperts(cfg)
    experts.w13.data.normal_(0, 0.05)
    experts.w2.data.normal_(0, 0.05)
    return experts


def test_experts_take_int4_where_the_kernel_takes_their_shapes() -> None:
    from dsinfer.layers.quant import experts_format

    assert experts_format("int4", _experts(64), 32) == ("int4", "")
    assert experts_format("int8", _experts(64), 32) == ("int8", "")
    fmt, why = experts_format("int4", _experts(24), 32)  # down's in_features 24
    assert fmt == "int8" and "not a multiple of the group size 32" in why


def test_int4_codes_unpack_and_pack_as_torch_does() -> None:
    from dsinfer.layers.int4_pack import int4pack_codes, int4pack_from_codes

    torch.manual_seed(5)
    codes = torch.randint(0, 16, (3, 128, 96), dtype=torch.uint8)  # [E, O, K]
    packed = int4pack_from_codes(codes)
    assert packed.shape == (3, 128, 48)
    assert torch.equal(packed[1], torch._convert_weight_to_int4pack_for_cpu(codes[1].int(), 1))
    assert torch.equal(int4pack_codes(packed), codes)
    # Fewer rows than a block, and a tail after whole blocks: torch's own layout of the rest.
    for rows in (48, 112):
        part = codes[:, :rows].contiguous()
        assert torch.equal(int4pack_codes(int4pack_from_codes(part)), part), rows
    with pytest.raises(ValueError, match="not a multiple of 16"):
        int4pack_codes(torch.zeros(40, 48, dtype=torch.uint8))
    # A whole stack in one pass (the GGUF expert load) writes torch's own bytes at every row
    # count: whole blocks, a tail after them, fewer rows than a block.
    for o in range(16, 273, 16):
        stack = torch.randint(0, 16, (2, o, 64), dtype=torch.uint8)
        got = int4pack_from_codes(stack)
        assert got.is_contiguous(), o
        for e in range(2):
            want = torch._convert_weight_to_int4pack_for_cpu(stack[e].int(), 1)
            assert torch.equal(got[e], want), o


def test_the_64_row_block_layout_is_what_this_torch_writes() -> None:
    """Our reading of torch's int4 layouts (what artifacts store, what our kernels read) is
    exact: packing and unpacking invert each other, and torch's own packing gives the bytes of
    64-row blocks on AVX-512 builds, of 32-row blocks on AVX2 ones."""
    from dsinfer.layers.int4_pack import (
        BLOCKS32,
        BLOCKS64,
        int4_block_rows,
        int4_pack_layout,
        pack_blocks,
        pack_blocks64,
        unpack_blocks64,
    )

    codes = torch.randint(0, 16, (2, 192, 64), generator=torch.Generator().manual_seed(6))
    packed = pack_blocks64(codes)
    assert torch.equal(unpack_blocks64(packed), codes.to(torch.uint8))
    torch_packed = torch._convert_weight_to_int4pack_for_cpu(codes[0].int(), 1)
    assert torch.equal(torch_packed, packed[0]) == (int4_pack_layout() == BLOCKS64)
    assert torch.equal(torch_packed, pack_blocks(codes[0], 32)) == (int4_pack_layout() == BLOCKS32)
    # AVX-512 (64-row blocks) or AVX2 (32) here and in CI: our repacking reads either, so the
    # fused int4 kernels are what the tests run.
    assert int4_block_rows() == (64 if int4_pack_layout() == BLOCKS64 else 32)


@pytest.mark.parametrize("layout", ["torch-cpu-blocks64", "torch-cpu-avx2"])
def test_an_artifacts_int4_bytes_convert_from_either_layout(layout: str) -> None:
    """An int4 artifact records the layout it was packed in; either known one (compiled on an
    AVX-512 or an AVX2 machine) converts to this process's bytes for the same codes, and an
    unknown one is refused by name."""
    from dsinfer.layers.int4_pack import int4_to_this_layout, int4pack_from_codes, pack_blocks

    codes = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(7))
    stored = pack_blocks(codes, 64 if layout.endswith("blocks64") else 32)
    assert torch.equal(int4_to_this_layout(stored, layout), int4pack_from_codes(codes))
    with pytest.raises(ValueError, match="torch-cpu-default cannot be read"):
        int4_to_this_layout(stored, "torch-cpu-default")


@pytest.mark.parametrize(
    ("kernels_name", "int8"), [("reference", "none"), ("fused", "none"), ("fused", "all")]
)
def test_int4_experts_multiply_as_int4_linears_do(kernels_name: str, int8: str) -> None:
    """Each expert of an int4 stack gives exactly what an int4 Linear with the same weight
    gives, on both backends (the fused one repacks the stacks as it repacks a Linear), with
    int8 activations or not, and at every kernel choice by rows (1, a few, past the dense
    threshold)."""
    from dsinfer.layers.backend import kernels_of
    from dsinfer.layers.kernels.cpu_build import load_cpu_ops
    from dsinfer.layers.quant import Int4ExpertsMethod

    assert load_cpu_ops() is None  # the fused kernels load here (as the other tests assume)
    if int8 != "none":
        skip_without("int4_i8")
    kernels = kernels_of(kernels_name, int8)
    experts = _experts(64)
    w13, w2 = experts.w13.data.clone(), experts.w2.data.clone()
    Int4ExpertsMethod(32).quantize(experts, torch.bfloat16)
    assert experts.q13.dtype == torch.uint8 and "w13" not in experts._parameters
    experts.use_kernels(kernels, "cpu")
    assert experts.method.vnni == (kernels_name == "fused" and fused_cpu_has("int4_vnni"))
    assert experts.method.int8 == (("13", "2") if int8 == "all" else ())
    torch.manual_seed(6)
    for which, w in (("13", w13), ("2", w2)):
        for e in (0, 3):
            lin = _quantised(w[e], "int4")
            lin.use_kernels(kernels, "cpu")
            for rows in (1, 3, 60):
                x = torch.randn(rows, w.shape[2]).bfloat16()
                got = experts.method.matmul(experts, x, which, e)
                assert torch.equal(got, lin(x)), (which, e, rows)


def _as_rank(monkeypatch: pytest.MonkeyPatch, rank: int, tp: int) -> None:
    from dsinfer.distributed.parallel_state import ParallelState

    state = ParallelState(tp_rank=rank, tp_size=tp)
    for module in ("dsinfer.layers.linear", "dsinfer.layers.moe"):
        monkeypatch.setattr(f"{module}.parallel_state", lambda: state)


@pytest.mark.parametrize("parallel", ["column", "row"])
def test_int4_tensor_parallel_cut_is_the_cut_weights_quantisation(monkeypatch, parallel) -> None:
    """A rank's cut of a stored int4 weight is what quantising its cut of the float weight
    gives: torch's packed bytes interleave 64 outputs a block, so the cut is taken on the
    codes (a narrow of the bytes gave another rank's weights)."""
    torch.manual_seed(7)
    w = torch.randn(128, 128) * 0.02
    full = quantize_int4(w, 32, torch.bfloat16)
    for rank in (0, 1):
        _as_rank(monkeypatch, rank, 2)
        lin = Linear(128, 128, parallel=parallel)
        lin.set_method(Int4LinearMethod(32))
        part = w.chunk(2, dim=0 if parallel == "column" else 1)[rank]
        want = quantize_int4(part, 32, torch.bfloat16)
        for name in ("qweight", "scales_zeros"):
            assert torch.equal(lin.local_part(name, full[name]), want[name]), (rank, name)


def test_int4_experts_tensor_parallel_cut_is_the_cut_weights_quantisation(monkeypatch) -> None:
    from dsinfer.layers.quant import Int4ExpertsMethod

    whole = _experts(64)
    w13, w2 = whole.w13.data.clone(), whole.w2.data.clone()
    Int4ExpertsMethod(32).quantize(whole, torch.bfloat16)
    for rank in (0, 1):
        _as_rank(monkeypatch, rank, 2)
        sliced = _experts(64)
        assert sliced.intermediate == 32
        gate, up = w13[:, :64], w13[:, 64:]  # [E, I, H] each; this rank's I slice of both
        own = slice(rank * 32, (rank + 1) * 32)
        sliced.w13.data = torch.cat([gate[:, own], up[:, own]], dim=1)
        sliced.w2.data = w2[:, :, own].contiguous()  # [E, H, I/2]
        Int4ExpertsMethod(32).quantize(sliced, torch.bfloat16)
        for name in ("q13", "sz13", "q2", "sz2"):
            got = sliced.local_part(name, getattr(whole, name).data)
            assert torch.equal(got, getattr(sliced, name).data), (rank, name)


def test_int4_experts_whose_groups_do_not_split_are_refused(monkeypatch) -> None:
    from dsinfer.layers.quant import Int4ExpertsMethod

    whole = _experts(32)
    Int4ExpertsMethod(32).quantize(whole, torch.bfloat16)
    _as_rank(monkeypatch, 1, 2)
    sliced = _experts(32)
    sliced.set_method(Int4ExpertsMethod(32))
    with pytest.raises(ValueError, match="int4 groups of 32 cannot be cut"):
        sliced.local_part("sz2", whole.sz2.data)


def test_int4_row_parallel_cut_through_a_group_is_refused(monkeypatch) -> None:
    full = quantize_int4(torch.randn(64, 32) * 0.02, 32, torch.bfloat16)  # one group a row
    _as_rank(monkeypatch, 0, 2)
    lin = Linear(32, 64, parallel="row")
    lin.set_method(Int4LinearMethod(32))
    with pytest.raises(ValueError, match="int4 groups cannot be cut"):
        lin.local_part("scales_zeros", full["scales_zeros"])


def test_int8_rows_without_native_bf16_gemms_take_the_packed_kernel(monkeypatch) -> None:
    """Many bf16 rows × an int8 weight widen it for one bf16 GEMM where bf16 GEMMs are native;
    where they are emulated (AVX2 CPUs: ~1 GFLOP/s) the packed kernel takes them, or an fp32
    GEMM for shapes it cannot take — the same products either way, within bf16 rounding."""
    from dsinfer.layers import quant

    g = torch.Generator().manual_seed(4)
    for in_f in (64, 40):  # 40: not a multiple of 16, the packed kernel's limit
        w = torch.randint(-127, 128, (96, in_f), generator=g, dtype=torch.int8)
        s = torch.rand(96, generator=g).to(torch.bfloat16)
        x = torch.randn(20, in_f, generator=g).to(torch.bfloat16)
        want = (x.double() @ w.double().t()) * s.double()
        for native in (True, False):
            monkeypatch.setattr(quant, "_native_bf16_cpu", lambda n=native: n)
            got = quant.int8_mm(x, w, s)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=0.5)
            if not native and in_f % 16 == 0:
                assert torch.equal(got, torch._weight_int8pack_mm(x, w, s))
