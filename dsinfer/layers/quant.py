"""Weight-only quantised linear methods (INT8 per output channel, INT4 group-wise) for CPU.

The offline half (`quantize_*`) turns a float weight into the tensors an artifact stores; the
runtime half (`*LinearMethod`) declares those tensors on a `Linear` and multiplies with them.
Activations stay in the model's float dtype (bf16 here: torch's packed CPU kernels are
vectorised for bf16 and an order of magnitude slower in fp32).

Kernel choice follows what was measured on this CPU (576×1536, bf16, see docs/artifacts.md):
`_weight_int8pack_mm` costs ~11 µs per activation row, so beyond a few rows it is cheaper to
widen the int8 weight to bf16 once and run one dense GEMM (prefill); decode stays on the packed
kernel, where it reads a quarter of the fp32 bytes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch import nn

from dsinfer.config import QUANTISED_SCHEMES
from dsinfer.device import native_bf16_matmul
from dsinfer.layers.int4_pack import (
    BLOCKS64,
    int4_block_rows,
    int4_pack_layout,
    int4pack_codes,
    int4pack_from_codes,
)
from dsinfer.layers.kernels import Kernels
from dsinfer.layers.linear import Linear, LinearMethod, ProgramOperand
from dsinfer.layers.moe import ExpertsMethod, RoutedExperts

logger = logging.getLogger(__name__)
SCHEMES = ("none", "bf16", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128, 256)
# Rows at which widening the int8 weight beats the packed kernel (measured crossover ~12).
_INT8_DENSE_FROM_ROWS = 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., in] → contiguous [M, in]; the engine's activations already are (no extra ops)."""
    if x.dim() != 2:
        x = x.reshape(-1, x.shape[-1])
    return x if x.is_contiguous() else x.contiguous()


def _finish(y: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        y = y + bias
    return y if x.dim() == 2 else y.view(*x.shape[:-1], -1)


# The fused backend's int8 kernel beats torch's packed one on wide layers (the LM head: 1.8 vs
# 2.8 ms for 576 → 49152 at one row; at 16 rows it also spares widening the weight each step)
# and loses on narrow ones (call overhead dominates).
_FUSED_INT8_MIN_OUT = 8192
_FUSED_INT8_MAX_ROWS = 64
# Rows from which a repacked narrow int8 layer is widened to bf16 for one dense GEMM instead of
# int8_vnni_i16_linear (SmolLM2's shapes, bf16: the kernel 2x faster at 16 rows, even at ~128,
# 25-35% slower at 512; docs/benchmarks.md, session 35).
_INT8_VNNI_DENSE_FROM_ROWS = 128
# Rows from which widening an int4 weight to bf16 for one dense GEMM beats the few-rows kernel;
# only where bf16 GEMMs are native (AVX-512 BF16). Our layout's kernel (int4_bf16_linear): hot
# in cache the widening wins from ~256 rows, but in a model's prefill it also widens cold
# weights into a fresh buffer, and the kernel is as fast up to 512 rows (SmolLM2, one 128-token
# prompt 57 → 42 ms, DeepSeek-V2-Lite one 64-token prompt 732 → 493 ms against 48; the same
# from 512 rows: docs/benchmarks.md, session 26). 512: a full default prefill chunk.
_INT4_DENSE_FROM_ROWS = 512
# torch's packed layout (group sizes our kernels do not take): its kernel's time grows
# linearly past ~4 rows (576 → 3072: 4.1 ms packed vs 1.8 ms dense at 160 rows).
_INT4_PACKED_DENSE_FROM_ROWS = 48


def _fused_cpu(kernels: Kernels, device_type: str) -> bool:
    """The fused backend on CPU: where this file's fused kernels run."""
    return kernels.name == "fused" and device_type == "cpu"


def _int4_kernels(
    kernels: Kernels, device_type: str, out_rows: list[int], group_size: int
) -> tuple[int, bool]:
    """The fused backend's choice for int4 weights of these output row counts (a Linear, or
    both stacks of the routed experts): (rows from which to widen for a dense GEMM, 0: never;
    whether to repack for the fused int4 kernels, int4_bf16_linear and the widening)."""
    fused = _fused_cpu(kernels, device_type) and all(o % 64 == 0 for o in out_rows)
    # Repacking reads torch's 64- or 32-row blocks; our int4 kernels exist for AVX-512 (VNNI,
    # BF16) and for AVX2 + FMA.
    repack = (
        fused
        and group_size == 32
        and int4_block_rows() is not None
        and torch.ops.dsinfer.int4_vnni_supported()
    )
    # Widening for a dense bf16 GEMM: only where bf16 GEMMs are fast (AVX-512 BF16; on an
    # AVX2 CPU torch's bf16 GEMM runs at ~1 GFLOP/s, and the int4 kernel takes every row).
    dense = (
        fused
        and torch.ops.dsinfer.int4_dense_supported()
        and (torch.ops.dsinfer.int8_vnni_supported() if repack else int4_pack_layout() == BLOCKS64)
    )
    if not dense:
        return 0, repack
    return (_INT4_DENSE_FROM_ROWS if repack else _INT4_PACKED_DENSE_FROM_ROWS), repack


def int8_mm(
    flat: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, fused: bool = False
) -> torch.Tensor:
    """[M, in] activations × int8 [out, in] with per-row scales → [M, out] (kernel by rows).

    The packed kernel gives wrong results (one row) or crashes (several) when `in` is not a
    multiple of 16 (torch 2.13: in = 24, 40), so such shapes always take the widened GEMM."""
    rows = flat.shape[0]
    if (
        fused
        and (
            rows == 1 or (rows <= _FUSED_INT8_MAX_ROWS and qweight.shape[0] >= _FUSED_INT8_MIN_OUT)
        )
        and flat.dtype in (torch.float32, torch.bfloat16)
    ):
        # One row (a decode token; a routed expert's usual share): the same fp32 arithmetic as
        # torch's packed kernel, streaming the weight faster at five of six shapes measured
        # (2816×2048: 183 → 143 µs, 576×1536: 31 → 20 µs; 1024×1024 a tie; docs/backends.md).
        return torch.ops.dsinfer.int8_linear(flat, qweight, scales)
    # No native bf16 GEMM here (AVX2): the widened weight would meet torch's emulated one (64
    # rows × 1536 × 576 on a Zen 2: 21.7 ms, the packed kernel 3.5, fp32 2.3).
    emulated_bf16 = flat.dtype == torch.bfloat16 and not _native_bf16_cpu()
    if flat.shape[1] % 16 == 0 and (rows < _INT8_DENSE_FROM_ROWS or emulated_bf16):
        # torch's packed kernel takes scales in the activations' dtype only.
        return torch._weight_int8pack_mm(flat, qweight, scales.to(flat.dtype))
    if emulated_bf16:
        return ((flat.float() @ qweight.float().t()) * scales.float()).to(flat.dtype)
    return (flat @ qweight.to(flat.dtype).t()) * scales


def int8_vnni_mm(
    flat: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, dense_from_rows: int
) -> torch.Tensor:
    """[M, in] activations × an int8 weight repacked by int8_vnni_pack → [M, out]: the int8 ×
    int16 kernel below `dense_from_rows` rows (0: every row count), else the weight widened to
    bf16 (exactly) for one GEMM, scaled after it (the step program's INT8_VNNI_I16 rules,
    kernels/step_program.cpp)."""
    if dense_from_rows == 0 or flat.shape[0] < dense_from_rows:
        return torch.ops.dsinfer.int8_vnni_i16_linear(flat, packed, scales)
    return int8_vnni_dense(flat, packed, scales)


def int8_vnni_dense(flat: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The repacked int8 weight widened to bf16 (exactly) for one GEMM, scaled after it."""
    wt = torch.ops.dsinfer.int8_vnni_dequantize_t(packed).to(flat.dtype)  # [in, out]
    return (flat @ wt) * scales


def _int8_vnni_dense_from() -> int:
    """Rows from which a repacked narrow int8 layer is widened for a dense GEMM: where bf16
    GEMMs are native (AVX-512 BF16); 0 (never) on AVX2, where torch's bf16 GEMM is emulated
    (~1 GFLOP/s) and the int16 kernel takes every row count, as the AVX2 int4 kernel does."""
    return _INT8_VNNI_DENSE_FROM_ROWS if torch.ops.dsinfer.int8_vnni_supported() else 0


def _int8_repacks(kernels: Kernels, device_type: str, out_f: int, in_f: int, wide: bool) -> bool:
    """Whether the fused backend repacks an int8 weight [out_f, in_f] for int8_vnni_pack's
    kernels: a wide one (the LM head) for the int8 × int8 kernel (AVX-512), the others for the
    int8 × int16 one (AVX-512 or AVX2; AVX2 keeps a wide layer in torch's layout for
    int8_i16_linear)."""
    if not _fused_cpu(kernels, device_type) or out_f % 16 or in_f % 32:
        return False
    if wide:
        return torch.ops.dsinfer.int8_vnni_supported()
    return torch.ops.dsinfer.int8_vnni_i16_supported()


@functools.cache
def _native_bf16_cpu() -> bool:
    return native_bf16_matmul(torch.device("cpu"))


def int4_mm(
    flat: torch.Tensor,
    qweight: torch.Tensor,
    scales_zeros: torch.Tensor,
    group_size: int,
    vnni: bool,
    dense_rows: int,
    int8: bool = False,
) -> torch.Tensor:
    """[M, in] activations × an int4 weight in torch's packed layout (or, `vnni`, repacked for
    our kernels) → [M, out], kernel by rows (dense_rows 0: never widen). int8 (`vnni` only):
    the few-rows kernel rounds the activations to int8 per group of 32, llama.cpp's way."""
    many = dense_rows and flat.shape[0] >= dense_rows and flat.dtype == torch.bfloat16
    if vnni and int8 and not many:
        # --int8-activations (all by default on CPUs with the kernel): twice the products an
        # instruction of the exact kernel's, the activations ~258x coarser than int16 (every
        # int4 layer: +0.27% prompt perplexity, -0.09% decode on SmolLM2: docs/backends.md).
        return torch.ops.dsinfer.int4_i8_linear(flat, qweight, scales_zeros)
    if vnni:
        # Few rows: the codes widened in registers and multiplied with the activations' own
        # bf16 values (int4_bf16_linear; llama.cpp's int8 activations cost +1.9% perplexity on
        # a 2,000-token text: docs/backends.md); many rows: the weight widened to bf16 for one
        # dense GEMM.
        if many:
            return flat @ torch.ops.dsinfer.int4_vnni_dequantize_t(qweight, scales_zeros)
        return torch.ops.dsinfer.int4_bf16_linear(flat, qweight, scales_zeros)
    if many:
        # Many rows (a prefill chunk): the packed kernel's time grows with every row, a dense
        # GEMM's barely; the widened weight [in, out] lives for this call only.
        return flat @ torch.ops.dsinfer.int4_dequantize_t(qweight, group_size, scales_zeros)
    return torch._weight_int4pack_mm_for_cpu(flat, qweight, group_size, scales_zeros)


# -- the registry: (scheme, device type) → method ------------------------------------------------
_LINEAR_METHODS: dict[tuple[str, str], type[LinearMethod]] = {}
_EXPERTS_METHODS: dict[tuple[str, str], type[ExpertsMethod]] = {}


def register_method(scheme: str, device_type: str):  # noqa: ANN201
    """Class decorator: a LinearMethod or ExpertsMethod for `scheme` on `device_type`."""

    def register(cls: type) -> type:
        table = _EXPERTS_METHODS if issubclass(cls, ExpertsMethod) else _LINEAR_METHODS
        table[(scheme, device_type)] = cls
        cls.scheme = scheme  # type: ignore[attr-defined]  # what `layer_formats` reads back
        return cls

    return register


def _lookup(table: dict[tuple[str, str], type], scheme: str, device_type: str) -> type:
    cls = table.get((scheme, device_type))
    if cls is None:
        have = sorted(d for s, d in table if s == scheme)
        raise ValueError(
            f"no {scheme} weight method for {device_type} (there is one for "
            f"{', '.join(have) or 'no device'}): these weights are laid out for "
            f"{'/'.join(have) or 'another device'}'s kernels; serve them there (--device "
            f"{have[0] if have else 'cpu'}) or load a float checkpoint for {device_type}"
        )
    return cls


def has_method(scheme: str, device_type: str) -> bool:
    """Whether `scheme`'s weights have kernels on `device_type` (float formats always do)."""
    return scheme not in QUANTISED_SCHEMES or (scheme, device_type) in _LINEAR_METHODS


def quant_method(scheme: str, group_size: int, device_type: str = "cpu") -> LinearMethod | None:
    """The registered method of a quantised scheme on a device; None for float formats."""
    if scheme not in QUANTISED_SCHEMES:
        return None
    cls = _lookup(_LINEAR_METHODS, scheme, device_type)
    return cls(group_size) if scheme == "int4" else cls()  # type: ignore[call-arg]


def experts_method(fmt: str, group_size: int, device_type: str = "cpu") -> ExpertsMethod:
    """The registered method of stacked routed experts in format `fmt` (int8 | int4)."""
    cls = _lookup(_EXPERTS_METHODS, fmt, device_type)
    return cls(group_size) if fmt == "int4" else cls()  # type: ignore[call-arg]


def experts_format(scheme: str, experts: RoutedExperts, group_size: int) -> tuple[str, str]:
    """(format, why) of a stack of routed experts under `scheme`: int8 under int8; under int4
    the int4 layout where the kernel takes both projections' shapes, else int8."""
    if scheme != "int4":
        return "int8", ""
    two_i, h = 2 * experts.intermediate, experts.hidden
    for out_f, in_f in ((two_i, h), (h, two_i // 2)):
        reason = int4_unsupported_reason(out_f, in_f, group_size)
        if reason is not None:
            return "int8", reason
    return "int4", ""


@register_method("int8", "cpu")
class Int8LinearMethod(LinearMethod):
    """W ≈ qweight · scales[:, None]; qweight int8 [out, in], scales [out] in the compute dtype.
    torch's packed CPU kernels (and ours) take this layout: CPU only. The fused backend repacks
    the layers its kernels take once after loading (int8_vnni_pack): with AVX-512 a wide layer
    (the LM head) then meets int8 activations (int8_vnni_linear), the others int16 activations
    (int8_vnni_i16_linear; int8 ones under --int8-activations), each kernel reading the weight
    once for every row of a call; with AVX2 the narrow layers take int8_vnni_i16_linear at
    every row count and a wide one keeps torch's layout for int8_i16_linear."""

    scheme = "int8"
    tensor_names = ("qweight", "scales")

    def tp_dims(self, name: str) -> tuple[int, int | None]:
        return (0, 1) if name == "qweight" else (0, None)  # scales: one per output row

    def __init__(self) -> None:
        self.fused = False  # the fused backend's kernels (use_kernels)
        self.wide = False  # fused backend: a wide layer (the LM head), _wide_kernel's
        self.vnni = False  # fused backend: repacked (int8_vnni_pack) for our int8 kernels
        self.i16 = False  # fused backend, AVX2: a wide layer multiplied by int8_i16_linear
        self.dense_from = 0  # repacked narrow layer: widen from this many rows (0: never)
        self.int8 = False  # repacked narrow layer meeting int8 activations (--int8-activations)

    def use_kernels(self, layer: nn.Module, kernels: Kernels, device_type: str) -> None:
        self.fused = _fused_cpu(kernels, device_type)
        self.wide = self.fused and layer.out_features >= _FUSED_INT8_MIN_OUT
        if _int8_repacks(kernels, device_type, layer.out_features, layer.in_features, self.wide):
            self._repack_for_vnni(layer)
            self.dense_from = _int8_vnni_dense_from()
        # --int8-activations all / out_proj: a narrow layer takes the head's int8 × int8 kernel
        # (AVX-512 only: 1.7-1.9x the int16 kernel's rate at 16 rows of SmolLM2's shapes).
        self.int8 = (
            self.vnni
            and not self.wide
            and torch.ops.dsinfer.int8_vnni_supported()
            and kernels.int8_for(layer.output_projection)
        )
        # AVX2: torch's layout as it is, int16 activations (cpu_ops.cpp: 16 rows of SmolLM2's
        # head 7.6 → 6.5 ms, DeepSeek-V2's 57 → 43 ms, on a Zen 2).
        self.i16 = self.wide and not self.vnni and torch.ops.dsinfer.int8_i16_supported()

    def _repack_for_vnni(self, layer: nn.Module) -> None:
        """Post-load preparation for our int8 kernels: the same bytes in their layout (offset
        by 128), once; torch's layout is dropped."""
        if self.vnni:
            return
        packed = torch.ops.dsinfer.int8_vnni_pack(layer.qweight.data)  # [O/16, K/4, 64]
        layer.qweight = nn.Parameter(packed, requires_grad=False)
        self.vnni = True

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        layer.qweight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False
        )
        layer.scales = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def _wide_kernel(self) -> Callable[..., torch.Tensor] | None:
        """The fused kernel of a wide layer, for up to _FUSED_INT8_MAX_ROWS rows, or None:
        int8 × int8 over the repacked weight (AVX-512: activations quantised per group of 32,
        4x the rate of widening to fp32 at 16 rows), int8 × int16 over torch's (AVX2)."""
        if self.vnni and (self.wide or self.int8):
            return torch.ops.dsinfer.int8_vnni_linear
        if self.i16:
            return torch.ops.dsinfer.int8_i16_linear
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = _rows(x)
        kernel = self._wide_kernel()
        if kernel is not None and flat.shape[0] <= _FUSED_INT8_MAX_ROWS:
            return _finish(kernel(flat, layer.qweight, layer.scales), x, bias)
        if not self.vnni:
            return _finish(int8_mm(flat, layer.qweight, layer.scales, self.fused), x, bias)
        # The head's many rows (prompt logprobs, a measurement) are widened for one exact GEMM.
        # The int8 × int8 kernel would be faster there (56 vs 141 ms at 512 rows) but moves
        # SmolLM2's prompt perplexity of the 81-token gate text by −0.7% (7.932 → 7.879; +0.06%
        # on 213 tokens): rounding noise, yet past the 0.5% gate.
        if self.wide or self.int8:
            return _finish(int8_vnni_dense(flat, layer.qweight, layer.scales), x, bias)
        return _finish(int8_vnni_mm(flat, layer.qweight, layer.scales, self.dense_from), x, bias)

    def apply_fp32(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        flat = _rows(x)
        kernel = self._wide_kernel()
        if kernel is not None and bias is None and flat.shape[0] <= _FUSED_INT8_MAX_ROWS:
            # The kernel rounds each value to x's dtype and stores it widened: apply's result
            # `.float()`ed, without writing and re-reading a second [rows, vocab] tensor.
            return _finish(kernel(flat, layer.qweight, layer.scales, True), x, None)
        return self.apply(layer, x, bias).float()

    @property
    def reads_rows(self) -> bool:
        """Whether `rows` serves a tied embedding: once the fused backend took the layer (the
        repacked layout, or torch's under the AVX2 kernel)."""
        return self.vnni or self.i16

    def rows(self, layer: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of the dequantised weight, W[ids] [T, in] in `dtype`: w · s in fp32, rounded
        once (a tied embedding's lookup: LMHead.use_kernels asks only when `reads_rows`)."""
        assert self.reads_rows, "rows are read once the fused backend took the layer"
        if self.vnni:
            return torch.ops.dsinfer.int8_vnni_rows(layer.qweight, layer.scales, ids, dtype)
        w = (
            layer.qweight.index_select(0, ids).float()
            * layer.scales.index_select(0, ids).float()[:, None]
        )
        return w.to(dtype)

    def program_operand(self, layer: nn.Module) -> ProgramOperand | None:
        # The program applies the same rules with the fused kernels (the fused backend only).
        if not self.fused:
            return None
        if self.vnni and not (self.wide or self.int8):
            return ProgramOperand(
                ProgramOperand.INT8_VNNI_I16, layer.qweight, layer.scales, self.dense_from
            )
        kind = (
            ProgramOperand.INT8_VNNI
            if self.vnni
            else ProgramOperand.INT8_I16
            if self.i16
            else ProgramOperand.INT8
        )
        return ProgramOperand(kind, layer.qweight, layer.scales)


@register_method("int4", "cpu")
class Int4LinearMethod(LinearMethod):
    """Asymmetric 4-bit groups along `in`: W[o, g·G + j] ≈ (q − 8) · scale[g, o] + zero[g, o].

    qweight is torch's CPU int4pack layout [out, in / 2] (uint8), scales_zeros [in / G, out, 2];
    the layout is the kernel's, so an artifact is loaded by mmap without repacking. The fused
    backend repacks it once after loading for its own int4 kernels (`_repack_for_vnni`)."""

    scheme = "int4"
    tensor_names = ("qweight", "scales_zeros")
    uncuttable_hint = (
        " (int4 groups cannot be cut): serve an int8 or float artifact with this --parallel, "
        "or compile int4 with a smaller --group-size"
    )

    def tp_dims(self, name: str) -> tuple[int, int | None]:
        # qweight as codes [out, in]; scales_zeros [groups, out, 2]: a row cut takes whole
        # groups.
        return (0, 1) if name == "qweight" else (1, 0)

    def tp_logical(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return int4pack_codes(full) if name == "qweight" else full

    def tp_stored(self, name: str, part: torch.Tensor) -> torch.Tensor:
        return int4pack_from_codes(part) if name == "qweight" else part

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.dense_rows = 0  # fused backend: widen to bf16 from this many rows (0: never)
        self.vnni = False  # fused backend: the weight is repacked for int4_bf16_linear
        self.int8 = False  # ... and meets int8 activations (int4_i8_linear)

    def use_kernels(self, layer: nn.Module, kernels: Kernels, device_type: str) -> None:
        self.dense_rows, repack = _int4_kernels(
            kernels, device_type, [layer.out_features], self.group_size
        )
        if repack:
            self._repack_for_vnni(layer)
        self.int8 = self.vnni and kernels.int8_for(layer.output_projection)

    def _repack_for_vnni(self, layer: nn.Module) -> None:
        """Post-load preparation for the fused backend: torch's packed layout → the int8-dot
        layout (same bytes), once; the torch-layout tensors are dropped, not kept beside it."""
        if self.vnni:
            return
        codes, sz = torch.ops.dsinfer.int4_vnni_pack(
            layer.qweight.data, self.group_size, layer.scales_zeros.data, int4_block_rows()
        )
        layer.qweight = nn.Parameter(codes, requires_grad=False)  # [O/16, K/8, 64]
        layer.scales_zeros = nn.Parameter(sz, requires_grad=False)  # [O/16, G, 2, 16] bf16
        self.vnni = True

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        layer.qweight = nn.Parameter(
            torch.empty(out_features, in_features // 2, dtype=torch.uint8), requires_grad=False
        )
        layer.scales_zeros = nn.Parameter(
            torch.empty(in_features // self.group_size, out_features, 2), requires_grad=False
        )

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = int4_mm(
            _rows(x),
            layer.qweight,
            layer.scales_zeros,
            self.group_size,
            self.vnni,
            self.dense_rows,
            self.int8,
        )
        return _finish(y, x, bias)

    def program_operand(self, layer: nn.Module) -> ProgramOperand | None:
        # The program's int4 kernels are the VNNI layout's (groups of 32, repacked at load).
        if not self.vnni:
            return None
        kind = ProgramOperand.INT4_I8 if self.int8 else ProgramOperand.INT4_VNNI
        return ProgramOperand(kind, layer.qweight, layer.scales_zeros, self.dense_rows)


def int4_unsupported_reason(out_features: int, in_features: int, group_size: int) -> str | None:
    """Why the CPU int4 kernel cannot take this shape, or None."""
    if in_features % group_size:
        return f"in_features {in_features} is not a multiple of the group size {group_size}"
    if out_features % 16:
        return f"out_features {out_features} is not a multiple of 16"
    return None


# Elements per pass of int4_codes and quantize_int8: ~4 MB of fp32, so the passes over each
# chunk run in cache, not memory (a DeepSeek-V2-Lite expert stack, 184M weights: 1.08 s whole,
# 0.24 s in such chunks, measured; the same arithmetic, so the same codes).
_CODES_CHUNK = 1 << 20


@torch.no_grad()
def quantize_int8(weight: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Symmetric per-output-channel int8: scale = max|w_row| / 127.

    Rows a chunk at a time (_CODES_CHUNK weights): an fp32 copy of a whole LM head (113 MB
    for SmolLM2's) and its temporaries would set the process's peak memory at load, and chunks
    that fit in cache run the five passes over them ~3× faster (DeepSeek-V2-Lite's head,
    210M weights: ~1.1 s in chunks of 4,096 rows, ~0.35 s in chunks of 512, session 37)."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], device=weight.device)
    step = max(1, _CODES_CHUNK // weight.shape[1])
    for start in range(0, weight.shape[0], step):
        w = weight[start : start + step].float()
        s = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [rows]
        q[start : start + step] = torch.round(w / s[:, None]).clamp(-127, 127)
        scales[start : start + step] = s
    return {"qweight": q, "scales": scales.to(dtype)}


@torch.no_grad()
def int4_codes(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, ...]:
    """Asymmetric min/max int4 per group of `group_size` input columns: codes [out, in]
    (uint8, 0..15), scale and zero [out, in / group_size] fp32 such that the kernel's
    (q − 8)·scale + zero gives the weight back."""
    out_f, in_f = weight.shape
    groups = in_f // group_size
    codes = torch.empty(out_f, in_f, dtype=torch.uint8, device=weight.device)
    scale = torch.empty(out_f, groups, device=weight.device)
    zero = torch.empty(out_f, groups, device=weight.device)
    step = max(1, _CODES_CHUNK // in_f)
    for start in range(0, out_f, step):
        rows = slice(start, start + step)
        w = weight[rows].float().reshape(-1, groups, group_size)  # [rows, groups, G]
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # [rows, groups]
        s = ((hi - lo) / 15.0).clamp(min=1e-12)
        q = torch.round((w - lo[..., None]) / s[..., None]).clamp(0, 15)
        codes[rows] = q.reshape(-1, in_f).to(torch.uint8)
        scale[rows] = s
        # The kernel computes (q − 8) · scale + zero, so zero sits at the group's midpoint.
        zero[rows] = lo + 8.0 * s
    return codes, scale, zero


@torch.no_grad()
def quantize_int4(
    weight: torch.Tensor, group_size: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """`int4_codes` in the stored layout: torch's CPU int4pack wherever the weight is
    quantised (an accelerator's method repacks it for its kernel after loading:
    quant_device.py) and scale | zero pairs [groups, out, 2]."""
    q, scale, zero = int4_codes(weight, group_size)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.cpu().to(torch.int32), 1)
    return {"qweight": packed.to(weight.device), "scales_zeros": int4_pairs(scale, zero, dtype)}


def fused_int4_stacks(
    n: int, out_f: int, in_f: int, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty stacks of n experts' [out_f, in_f] weights in the fused int4 kernels' layout (the
    repack's, int4_vnni_pack's): codes [n, out/16, in/8, 64] uint8 and scale | zero
    [n, out/16, in/group, 2, 16] bf16."""
    codes = torch.empty(n, out_f // 16, in_f // 8, 64, dtype=torch.uint8)
    pairs = torch.empty(n, out_f // 16, in_f // group_size, 2, 16, dtype=torch.bfloat16)
    return codes, pairs


def int4_pairs(scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """scale and zero [..., out, G] → the stored scale | zero pairs [..., G, out, 2] in `dtype`
    (an int4 Linear's `scales_zeros`; an expert stack's `sz`, one such per expert)."""
    pairs = torch.stack([scale.transpose(-1, -2), zero.transpose(-1, -2)], dim=-1)
    return pairs.to(dtype).contiguous()


@register_method("int8", "cpu")
class Int8ExpertsMethod(ExpertsMethod):
    """Every expert's w13 / w2 as int8 [E, out, in] with per-row scales [E, out]."""

    tensor_names = ("q13", "s13", "q2", "s2")

    def __init__(self) -> None:
        self.fused = False  # the fused backend's int8 kernel for single rows (use_kernels)
        self.vnni = False  # fused backend: each expert repacked for int8_vnni_i16_linear
        self.dense_from = 0  # ... widened from this many rows (0: never)

    def create_weights(self, experts: nn.Module, e: int, two_i: int, h: int) -> None:
        for which, shape in (("13", (e, two_i, h)), ("2", (e, h, two_i // 2))):
            q = torch.empty(shape, dtype=torch.int8)
            setattr(experts, f"q{which}", nn.Parameter(q, requires_grad=False))
            scales = nn.Parameter(torch.empty(shape[:2]), requires_grad=False)
            setattr(experts, f"s{which}", scales)

    def tp_layout(self, name: str) -> tuple[bool, int | None]:
        if name == "s2":
            return False, None  # per output row of down: whole
        return (True, 1) if name.endswith("13") else (False, 2)

    def use_kernels(self, experts: nn.Module, kernels: Kernels, device_type: str) -> None:
        self.fused = _fused_cpu(kernels, device_type)
        h, two_i = experts.hidden, 2 * experts.intermediate
        # Both stacks: w13 [2I, H] and w2 [H, I].
        if all(
            _int8_repacks(kernels, device_type, o, k, False)
            for o, k in ((two_i, h), (h, two_i // 2))
        ):
            self._repack_for_vnni(experts)
            self.dense_from = _int8_vnni_dense_from()

    def _repack_for_vnni(self, experts: nn.Module) -> None:
        """Each expert's weight → int8_vnni_pack's layout (as a narrow int8 Linear's), stacked
        again: [E, out / 16, in / 4, 64]; torch's layout is dropped."""
        if self.vnni:
            return
        for which in ("13", "2"):
            q = getattr(experts, f"q{which}").data
            packed = torch.stack([torch.ops.dsinfer.int8_vnni_pack(q[e]) for e in range(len(q))])
            setattr(experts, f"q{which}", nn.Parameter(packed, requires_grad=False))
        self.vnni = True

    def matmul(self, experts: nn.Module, x: torch.Tensor, which: str, e: int) -> torch.Tensor:
        q, scales = getattr(experts, f"q{which}")[e], getattr(experts, f"s{which}")[e]
        if not self.vnni:
            return int8_mm(x.contiguous(), q, scales, self.fused)
        return int8_vnni_mm(x.contiguous(), q, scales, self.dense_from)

    def program_operand(self, experts: nn.Module, which: str, e: int) -> ProgramOperand | None:
        # `matmul`'s rules with the fused kernels (fused backend only).
        if not self.fused:
            return None
        q, scales = getattr(experts, f"q{which}")[e], getattr(experts, f"s{which}")[e]
        if self.vnni:
            return ProgramOperand(ProgramOperand.INT8_VNNI_I16, q, scales, self.dense_from)
        return ProgramOperand(ProgramOperand.INT8, q, scales)

    @torch.no_grad()
    def quantize(self, experts: RoutedExperts, dtype: torch.dtype) -> None:
        """Float experts → this layout, in place."""
        tensors = {}
        for which in ("13", "2"):
            w = getattr(experts, f"w{which}")
            parts = [quantize_int8(w[e], dtype) for e in range(w.shape[0])]
            tensors[which] = (
                torch.stack([p["qweight"] for p in parts]),
                torch.stack([p["scales"] for p in parts]),
            )
        experts.set_method(self)
        for which, (q, scales) in tensors.items():
            getattr(experts, f"q{which}").data = q
            getattr(experts, f"s{which}").data = scales


@register_method("int4", "cpu")
class Int4ExpertsMethod(ExpertsMethod):
    """Every expert's w13 / w2 in Int4LinearMethod's layout, stacked: q [E, out, in / 2]
    (torch's int4pack, uint8) and sz [E, in / G, out, 2] (scale, zero); half the bytes of the
    int8 stacks, which a decode step reads once per routed expert. The fused backend repacks
    each expert once after loading, as it does an int4 Linear."""

    tensor_names = ("q13", "sz13", "q2", "sz2")

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size
        self.dense_rows = 0  # fused backend: widen to bf16 from this many rows (0: never)
        self.vnni = False  # fused backend: the stacks are repacked for int4_bf16_linear
        self.int8: tuple[str, ...] = ()  # ... the stacks ("13", "2") meeting int8 activations

    def create_weights(self, experts: nn.Module, e: int, two_i: int, h: int) -> None:
        for which, (out_f, in_f) in (("13", (two_i, h)), ("2", (h, two_i // 2))):
            q = torch.empty(e, out_f, in_f // 2, dtype=torch.uint8)
            setattr(experts, f"q{which}", nn.Parameter(q, requires_grad=False))
            sz = torch.empty(e, in_f // self.group_size, out_f, 2)
            setattr(experts, f"sz{which}", nn.Parameter(sz, requires_grad=False))

    def tp_layout(self, name: str) -> tuple[bool, int | None]:
        # As codes: q13 [E, 2I, H] and sz13 [E, H/G, 2I, 2] cut their gate | up rows; q2
        # [E, H, I] its columns, sz2 [E, I/G, H, 2] its groups (tp_unit).
        return {"q13": (True, 1), "sz13": (True, 2), "q2": (False, 2), "sz2": (False, 1)}[name]

    def tp_unit(self, name: str) -> int:
        return self.group_size if name == "sz2" else 1

    def tp_logical(self, name: str, full: torch.Tensor) -> torch.Tensor:
        return int4pack_codes(full) if name.startswith("q") else full

    def tp_stored(self, name: str, part: torch.Tensor) -> torch.Tensor:
        return int4pack_from_codes(part) if name.startswith("q") else part

    def _kernels(self, experts: nn.Module, kernels: Kernels, device_type: str) -> tuple[int, bool]:
        out_rows = [2 * experts.intermediate, experts.hidden]  # both stacks' output rows
        return _int4_kernels(kernels, device_type, out_rows, self.group_size)

    def repacks(self, experts: nn.Module, kernels: Kernels, device_type: str) -> bool:
        """Whether `use_kernels` with these kernels puts the stacks in the fused layout: a
        direct GGUF load then writes that layout at once (models/gguf_int4.py) and sets
        `vnni`, and the repack has nothing left to do."""
        return self._kernels(experts, kernels, device_type)[1]

    def use_kernels(self, experts: nn.Module, kernels: Kernels, device_type: str) -> None:
        self.dense_rows, repack = self._kernels(experts, kernels, device_type)
        if repack:
            self._repack_for_vnni(experts)
        elif self.vnni:
            raise ValueError(
                f"routed experts loaded in the fused backend's int4 layout cannot run on the "
                f"{kernels.name} kernels ({device_type}): load the model for the backend that "
                "runs it (load_model's backend)"
            )
        # w2 is the experts' output projection (its input: silu(gate) · up, not a norm's).
        stacks = (("13", False), ("2", True))
        self.int8 = tuple(w for w, out in stacks if self.vnni and kernels.int8_for(out))

    def _repack_for_vnni(self, experts: nn.Module) -> None:
        """Each expert's tensors → the int8-dot layout (same values), stacked again; torch's
        layout is dropped, not kept beside it."""
        if self.vnni:
            return
        rows = int4_block_rows()
        for which in ("13", "2"):
            q, sz = getattr(experts, f"q{which}").data, getattr(experts, f"sz{which}").data
            n, out_f, in_f = q.shape[0], q.shape[1], q.shape[2] * 2  # q [E, out, in / 2]
            # Each expert packed straight into its slice of the stacks: no per-expert results
            # stacked afterwards (a second copy of every stack, session 37).
            codes, pairs = fused_int4_stacks(n, out_f, in_f, self.group_size)
            for e in range(n):
                torch.ops.dsinfer.int4_vnni_pack_into(
                    q[e], self.group_size, sz[e], rows, codes[e], pairs[e]
                )
            setattr(experts, f"q{which}", nn.Parameter(codes, requires_grad=False))
            setattr(experts, f"sz{which}", nn.Parameter(pairs, requires_grad=False))
            del q, sz  # the torch layout goes as each stack is done, not at the end
        self.vnni = True

    def matmul(self, experts: nn.Module, x: torch.Tensor, which: str, e: int) -> torch.Tensor:
        q, sz = getattr(experts, f"q{which}")[e], getattr(experts, f"sz{which}")[e]
        return int4_mm(
            x.contiguous(),
            q,
            sz,
            self.group_size,
            self.vnni,
            self.dense_rows,
            which in self.int8,
        )

    def program_operand(self, experts: nn.Module, which: str, e: int) -> ProgramOperand | None:
        # As Int4LinearMethod's: the VNNI layout only, int8 activations where `matmul` takes them.
        if not self.vnni:
            return None
        q, sz = getattr(experts, f"q{which}")[e], getattr(experts, f"sz{which}")[e]
        kind = ProgramOperand.INT4_I8 if which in self.int8 else ProgramOperand.INT4_VNNI
        return ProgramOperand(kind, q, sz, self.dense_rows)

    @torch.no_grad()
    def quantize(self, experts: RoutedExperts, dtype: torch.dtype) -> None:
        """Float experts → this layout, in place (each expert as an int4 Linear would be: its
        groups lie within rows, so the stack's rows are quantised as one matrix); the codes of
        a whole stack packed in one pass."""
        tensors = {}
        for which in ("13", "2"):
            w = getattr(experts, f"w{which}")
            e, out_f, in_f = w.shape
            q, scale, zero = int4_codes(w.reshape(e * out_f, in_f), self.group_size)
            tensors[f"q{which}"] = int4pack_from_codes(q.view(e, out_f, in_f))
            tensors[f"sz{which}"] = int4_pairs(
                scale.view(e, out_f, -1), zero.view(e, out_f, -1), dtype
            )
        experts.set_method(self)
        for name, value in tensors.items():
            getattr(experts, name).data = value


def quantizable_linears(model: nn.Module) -> list[tuple[str, Linear]]:
    """Linear layers whose weight only the layer itself reads (MLA reads kv_b_proj directly)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Linear) and m.quantizable]


def layer_format(scheme: str, layer: Linear, group_size: int) -> tuple[str, str]:
    """(format, why) for one layer under `scheme`: the scheme itself, int8, or float.

    The LM head takes int8 under int4: measured on SmolLM2, an int4 head raises perplexity
    by 10.9% against 0.0% with an int8 head, for 14 MiB."""
    if scheme == "int4" and layer.quant_sensitive:
        return "int8", "quantisation-sensitive layer keeps 8 bits"
    if scheme == "int4":
        reason = int4_unsupported_reason(layer.out_features, layer.in_features, group_size)
        if reason is not None:
            return "float", reason
    return scheme, ""


def apply_format(
    layer: Linear, fmt: str, group_size: int, dtype: torch.dtype, device_type: str = "cpu"
) -> None:
    """Quantise one float layer in place to `fmt` (int8 | int4)."""
    method = quant_method(fmt, group_size, device_type)
    if fmt == "int8":
        tensors = quantize_int8(layer.weight, dtype)
    else:
        tensors = quantize_int4(layer.weight, group_size, dtype)
    layer.set_method(method)  # type: ignore[arg-type]
    for key, value in tensors.items():
        getattr(layer, key).data = value


def plan_formats(model: nn.Module, scheme: str, group_size: int) -> dict[str, str]:
    """{module: format} for every module whose format under `scheme` is not `scheme` itself.

    Stacked MoE experts under int4 are int4 where the kernel takes their shapes, else int8
    (artifacts compiled before int4 experts existed list their experts as int8: they load
    so)."""
    exceptions: dict[str, str] = {}
    for name, layer in quantizable_linears(model):
        fmt, why = layer_format(scheme, layer, group_size)
        if fmt != scheme:
            exceptions[name] = fmt
            logger.info("%s: %s (%s)", name, fmt, why)
    for name, experts in routed_experts(model):
        fmt, why = experts_format(scheme, experts, group_size)
        if fmt != scheme:
            exceptions[name] = fmt
            logger.info("%s: %s (%s)", name, fmt, why)
    return exceptions


def layer_formats(model: nn.Module, scheme: str) -> dict[str, str]:
    """{module: format} of a quantised model's layers and expert stacks whose format is not
    `scheme` (plan_formats' dict, read back from the methods the model holds)."""
    modules = [*quantizable_linears(model), *routed_experts(model)]
    found = {name: getattr(m.method, "scheme", "float") for name, m in modules}
    return {name: fmt for name, fmt in found.items() if fmt != scheme}


@torch.no_grad()
def quantize_model(
    model: nn.Module, scheme: str, group_size: int, dtype: torch.dtype, device_type: str = "cpu"
) -> dict[str, str]:
    """Quantise every eligible Linear and expert stack in place; returns plan_formats' dict
    (the artifact records it so the runtime rebuilds the same layout)."""
    exceptions = plan_formats(model, scheme, group_size)
    QuantiseOnLoad(model, scheme, group_size, dtype, exceptions, device_type).finish()
    return exceptions


class QuantiseOnLoad:
    """Quantises each layer as soon as the loader has filled its float weight (called with
    each parameter name the loader completes), so a float checkpoint becomes int4/int8 one
    layer at a time: the process holds the quantised model plus one layer's floats, never the
    whole float model (parameters are allocated untouched, so those not yet loaded cost no
    memory). `finish` quantises what is still float at the end (a head tied to the embedding,
    or a whole model loaded before)."""

    def __init__(
        self,
        model: nn.Module,
        scheme: str,
        group_size: int,
        dtype: torch.dtype,
        formats: dict[str, str],
        device_type: str = "cpu",
    ) -> None:
        self._scheme, self._group, self._dtype = scheme, group_size, dtype
        self._formats, self._device = formats, device_type
        self._linears = quantizable_linears(model)
        self._experts = routed_experts(model)
        self._by_param: dict[str, tuple[str, nn.Module]] = {
            f"{n}.weight": (n, m) for n, m in self._linears
        }
        for n, m in self._experts:
            self._by_param.update({f"{n}.w13": (n, m), f"{n}.w2": (n, m)})
        self._filled: dict[str, set[str]] = {}

    def __call__(self, param: str) -> None:
        found = self._by_param.get(param)
        if found is None:
            return
        name, module = found
        if isinstance(module, RoutedExperts):
            filled = self._filled.setdefault(name, set())
            filled.add(param)
            if len(filled) == 2:  # w13 and w2
                self._experts_done(name, module)
        else:
            self._linear_done(name, module)  # type: ignore[arg-type]

    def finish(self) -> None:
        for name, layer in self._linears:
            self._linear_done(name, layer)
        for name, experts in self._experts:
            self._experts_done(name, experts)

    def _linear_done(self, name: str, layer: Linear) -> None:
        fmt = self._formats.get(name, self._scheme)
        if fmt != "float" and "weight" in layer.method.tensor_names:  # still the float weight
            apply_format(layer, fmt, self._group, self._dtype, self._device)

    def _experts_done(self, name: str, experts: RoutedExperts) -> None:
        if "w13" in experts.method.tensor_names:  # still the float stacks
            fmt = self._formats.get(name, self._scheme)
            method = experts_method(fmt, self._group, self._device)
            method.quantize(experts, self._dtype)  # type: ignore[attr-defined]


# Bytes a weight takes stored in a format: int4 codes two to a byte and a bf16 scale and zero
# per group of 32; int8 one byte (its per-row scale is negligible).
_STORED_BYTES = {"int4": 0.5 + 4 / 32, "int8": 1.0}


def planned_bytes(model: nn.Module, scheme: str, formats: dict[str, str]) -> tuple[int, int]:
    """(bytes of `model`'s parameters once loaded under `scheme` with `formats`, bytes of its
    largest float layer or expert stack that is quantised: QuantiseOnLoad holds one at a
    time beside the rest). Parameters in the model's dtype as built (unquantised)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = 0
    if scheme not in QUANTISED_SCHEMES:
        return total, 0
    modules = [*quantizable_linears(model), *routed_experts(model)]
    for name, module in modules:
        fmt = formats.get(name, scheme)
        if fmt not in _STORED_BYTES:
            continue
        weights = [getattr(module, n) for n in module.method.tensor_names if n.startswith("w")]
        floats = sum(w.numel() * w.element_size() for w in weights)
        total += int(sum(w.numel() for w in weights) * _STORED_BYTES[fmt]) - floats
        largest = max(largest, floats)
    return total, largest


def prepare_quantized(
    model: nn.Module,
    scheme: str,
    group_size: int,
    exceptions: dict[str, str],
    device_type: str = "cpu",
) -> None:
    """Give the model an artifact's parameter layout before its tensors are assigned;
    ValueError when no method of the scheme is registered for the device."""
    if scheme not in QUANTISED_SCHEMES:
        return
    for name, layer in quantizable_linears(model):
        method = quant_method(exceptions.get(name, scheme), group_size, device_type)
        if method is not None:
            layer.set_method(method)
    for name, experts in routed_experts(model):
        experts.set_method(experts_method(exceptions.get(name, scheme), group_size, device_type))


def routed_experts(model: nn.Module) -> list[tuple[str, RoutedExperts]]:
    """Stacked MoE experts (they quantise as a whole, one format for every expert)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]
