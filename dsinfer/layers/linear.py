"""Linear layers with a quantisation seam and shard-aware weight loading.

A `LinearMethod` owns how weights are stored and multiplied (plain, int8, int4); the
layer only knows its shape. Fused layers (qkv, gate|up) accept checkpoint shards by name, so
models carry no loading code: the loader calls `param.weight_loader(param, tensor, shard)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.distributed.comm import all_reduce
from dsinfer.distributed.parallel_state import parallel_state
from dsinfer.layers.kernels import Kernels


@dataclass(frozen=True, slots=True)
class ProgramOperand:
    """A projection as the decode-step program multiplies it (kernels/step_program.cpp):
    `kind` names the kernel family, `a`/`b` its tensors in the kernel's layout."""

    DENSE = 0  # a: weight [out, in] (F.linear)
    INT4_VNNI = 1  # a: codes, b: scales|zeros (int4_bf16_linear)
    INT8 = 2  # a: weight int8 [out, in], b: scales [out] (int8_mm's rules)
    INT8_VNNI = 3  # a: packed int8 [out/16, in/4, 64], b: scales [out] (int8_vnni_linear)
    INT8_I16 = 4  # a: weight int8 [out, in], b: scales [out] (int8_i16_linear, AVX2)
    INT4_I8 = 5  # INT4_VNNI's tensors, int8 activations (int4_i8_linear, --int8-activations)
    INT8_VNNI_I16 = 6  # INT8_VNNI's tensors, int16 activations (int8_vnni_i16_linear)

    kind: int
    a: torch.Tensor
    b: torch.Tensor | None = None
    dense_from_rows: int = 0  # int4, INT8_VNNI_I16: widen to bf16 for one GEMM from this many rows


def parameters_device(module: nn.Module) -> torch.device:
    """The device of a module's own parameters (the CPU for one that has none yet)."""
    own = next(iter(module.parameters(recurse=False)), None)
    return own.device if own is not None else torch.device("cpu")


class LinearMethod:
    """Seam for weight formats. A method owns its tensors end to end: it declares them
    (`tensor_names`, `create_weights`), prepares them for the backend's kernels after loading
    (`use_kernels`), multiplies with them (`apply`) and says how tensor parallelism cuts each
    (`tp_dims`). Quantised methods are registered by (scheme, device type) in quant.py; the
    layer never names a scheme's tensors."""

    tensor_names: tuple[str, ...] = ("weight",)
    # Said when a row-parallel cut would split what must stay whole (int4 groups).
    uncuttable_hint = ""

    def tp_dims(self, name: str) -> tuple[int, int | None]:
        """(output dimension, input dimension or None) of one of this method's tensors: where
        a column-parallel and a row-parallel cut fall. None: the tensor is per output row and
        stays whole under a row-parallel cut."""
        return 0, 1

    def tp_logical(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """A stored tensor as `tp_dims` indexes it (int4: its codes, one per weight, where the
        stored bytes interleave outputs in blocks); `tp_stored` turns a cut back."""
        return full

    def tp_stored(self, name: str, part: torch.Tensor) -> torch.Tensor:
        return part

    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        raise NotImplementedError

    def use_kernels(self, layer: nn.Module, kernels: Kernels, device_type: str) -> None:
        """Pick kernels for the engine's backend after loading (and prepare the layer's
        tensors for them); the default has one kernel."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def apply_fp32(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """`apply(...).float()`, value for value (the LM head's logits are sampled in fp32); a
        method whose kernel can write those values directly overrides it."""
        return self.apply(layer, x, bias).float()

    def program_operand(self, layer: nn.Module) -> ProgramOperand | None:
        """This layer's weights for the decode-step program, multiplied exactly as `apply`
        does; None when the program has no kernel for this method (the step stays eager)."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, out_features: int, in_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)

    def program_operand(self, layer: nn.Module) -> ProgramOperand | None:
        return ProgramOperand(ProgramOperand.DENSE, layer.weight)


def fused_target(name: str, packed: dict[str, tuple[str, str]]) -> tuple[str, str | None]:
    """Checkpoint parameter name → (our parameter name, shard) under a model's
    `packed_modules` rule: "….q_proj.weight" → ("….qkv_proj.weight", "q")."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in packed:
        module, shard = packed[parts[-2]]
        return ".".join([*parts[:-2], module, parts[-1]]), shard
    return name, None


def default_weight_loader(
    param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None
) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"shape mismatch: checkpoint has {tuple(loaded.shape)}, "
            f"model expects {tuple(param.shape)}"
        )
    param.data.copy_(loaded)


class Linear(nn.Module):
    """y = x Wᵀ + b over one weight, or over several row shards fused into one matmul."""

    # Layers whose error reaches the output undamped (the LM head) get more bits.
    quant_sensitive = False

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[int],
        bias: bool = False,
        shard_names: Sequence[str] | None = None,
        method: LinearMethod | None = None,
        quantizable: bool = True,
        parallel: str | None = None,
        reduce: bool = True,
    ) -> None:
        """`parallel`: None (replicated), "column" (each TP rank keeps its slice of every
        shard's output rows) or "row" (its slice of the input columns; outputs all-reduced,
        unless `reduce` is False: the caller sums partial outputs of several layers at once)."""
        super().__init__()
        self.reduce = reduce
        # A block's output projection (attention's o_proj, the MLP's down_proj): its input is
        # not an RMSNorm's output, whose outlier channels cost int8 activations their precision
        # (the `out_proj` policy of --int8-activations takes these layers only).
        self.output_projection = parallel == "row"
        # False when another module reads `weight` directly (MLA's kv_b_proj), so the
        # weight must stay a plain float matrix.
        self.quantizable = quantizable
        sizes = [out_features] if isinstance(out_features, int) else list(out_features)
        tp = parallel_state()
        self.parallel = parallel if tp.tp_size > 1 else None
        self.tp_rank, self.tp_size = tp.tp_rank, tp.tp_size
        split = {"column": (tp.tp_size, 1), "row": (1, tp.tp_size)}.get(self.parallel, (1, 1))
        split_dims = {"column": sizes, "row": [in_features]}.get(self.parallel, [])
        for n in split_dims:
            if n % tp.tp_size:
                raise ValueError(f"{n} does not split over {tp.tp_size} tensor-parallel ranks")
        sizes = [s // split[0] for s in sizes]
        in_features //= split[1]
        self.in_features = in_features
        self.out_features = sum(sizes)
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, self.out_features, in_features)
        self.bias = (
            nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        )
        # shard name → (row offset, rows): where each checkpoint tensor lands in the fused weight.
        self.shards: dict[str, tuple[int, int]] = {}
        if shard_names is not None:
            assert len(shard_names) == len(sizes)
            off = 0
            for name, size in zip(shard_names, sizes, strict=True):
                self.shards[name] = (off, size)
                off += size
        for p in self.parameters(recurse=False):
            p.weight_loader = self._load  # type: ignore[attr-defined]
            p.shards = list(self.shards)  # type: ignore[attr-defined]  # what the loader expects

    def use_kernels(self, kernels: Kernels, device_type: str) -> None:
        self.method.use_kernels(self, kernels, device_type)

    def set_method(self, method: LinearMethod) -> None:
        """Swap the weight format (artifact load, compile): drops the old weight tensors; the
        new ones are declared on the device the old ones were on (a model built on a GPU
        quantised at load keeps its layers there)."""
        device = parameters_device(self)
        for name in self.method.tensor_names:
            self._parameters.pop(name, None)
        self.method = method
        with torch.device(device):
            method.create_weights(self, self.out_features, self.in_features)

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole stored tensor of this layer (a compiled artifact holds
        fused, possibly quantised tensors; the method says where each is cut)."""
        return self._tp_cut(name, full, list(self.shards.values()) or [(0, self.out_features)])

    def _tp_cut(self, name: str, full: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
        """The one tensor-parallel rule, for checkpoint shards and stored fused tensors alike.

        Column parallel: each span (offset, rows per rank) of the output dimension is cut
        separately — [q | k | v] → [q_r | k_r | v_r]. Row parallel: the input dimension is cut;
        per-output-row tensors (the bias, per-row scales) stay whole."""
        if self.parallel is None:
            return full
        if name == "bias":
            return self._tp_cut_logical(name, full, spans, (0, None))
        cut = self._tp_cut_logical(
            name, self.method.tp_logical(name, full), spans, self.method.tp_dims(name)
        )
        return self.method.tp_stored(name, cut)

    def _tp_cut_logical(
        self,
        name: str,
        full: torch.Tensor,
        spans: list[tuple[int, int]],
        dims: tuple[int, int | None],
    ) -> torch.Tensor:
        out_dim, in_dim = dims
        if self.parallel == "column":
            parts = [
                full.narrow(out_dim, off * self.tp_size + self.tp_rank * rows, rows)
                for off, rows in spans
            ]
            return parts[0] if len(parts) == 1 else torch.cat(parts, dim=out_dim)
        if in_dim is None or full.dim() < 2:  # per output row: whole on every rank
            return full
        if full.shape[in_dim] % self.tp_size:
            raise ValueError(
                f"{name} {tuple(full.shape)} does not split over {self.tp_size} "
                f"tensor-parallel ranks{self.method.uncuttable_hint}"
            )
        width = full.shape[in_dim] // self.tp_size  # columns (int4 scales: groups) per rank
        return full.narrow(in_dim, self.tp_rank * width, width)

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        """A checkpoint tensor (one shard of a fused weight, or the whole) into `param`."""
        rows = self.shards[shard][1] if shard is not None else param.shape[0]
        name = "bias" if param is self.bias else "weight"
        loaded = self._tp_cut(name, loaded, [(0, rows)])
        if shard is None:
            default_weight_loader(param, loaded)
            return
        off, rows = self.shards[shard]
        dst = param.data.narrow(0, off, rows)
        if tuple(dst.shape) != tuple(loaded.shape):
            raise ValueError(
                f"shape mismatch for shard {shard!r}: checkpoint has "
                f"{tuple(loaded.shape)}, model expects {tuple(dst.shape)}"
            )
        dst.copy_(loaded)

    def program_operand(self) -> ProgramOperand | str:
        """The operand a decode-step program multiplies with, or why there is none."""
        if self.parallel is not None:
            return "tensor-parallel layers reduce across ranks between kernels"
        operand = self.method.program_operand(self)
        if operand is None:
            return f"no step-program kernel for {type(self.method).__name__} in this layout"
        return operand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel != "row":
            return self.method.apply(self, x, self.bias)
        y = self.method.apply(self, x, None)  # partial sums of this rank's columns
        if not self.reduce:
            assert self.bias is None, "a partial output cannot carry the bias"
            return y
        y = all_reduce(y)
        return y if self.bias is None else y + self.bias
