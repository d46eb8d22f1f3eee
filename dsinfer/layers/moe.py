"""DeepSeekMoE: a router (softmax or sigmoid scoring, group-limited top-k, bias-corrected
selection, routed scaling), routed experts computed per expert over the tokens sent to it, and
always-on shared experts.

The math follows the reference (transformers' DeepseekV2/V3 modules): selection may use
`scores + e_score_correction_bias` (V3), but the weights applied are the unbiased scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsinfer.device import grouped_mm, grouped_mm_in_graphs
from dsinfer.distributed.comm import all_reduce_stage
from dsinfer.distributed.parallel_state import parallel_state
from dsinfer.layers.activation import silu_and_mul
from dsinfer.layers.kernels import Kernels
from dsinfer.layers.linear import Linear, ProgramOperand, parameters_device


class ExpertsMethod:
    """Seam for the stacked experts' weight format (like Linear's LinearMethod): the method
    declares its tensors, says how tensor parallelism cuts each, and multiplies. The float one
    is here; quantised ones are registered by (scheme, device type) in quant.py."""

    tensor_names: tuple[str, ...] = ("w13", "w2")

    def create_weights(self, experts: nn.Module, e: int, two_i: int, h: int) -> None:
        """w13 [E, 2I, H] (gate | up rows), w2 [E, H, I]."""
        experts.w13 = nn.Parameter(torch.empty(e, two_i, h), requires_grad=False)
        experts.w2 = nn.Parameter(torch.empty(e, h, two_i // 2), requires_grad=False)

    def tp_layout(self, name: str) -> tuple[bool, int | None]:
        """(halves, dim) of a stored stack: the intermediate dimension the TP cut falls on
        (halves: it holds gate | up, each cut alike), or None: whole on every rank."""
        return (True, 1) if name == "w13" else (False, 2)

    def tp_unit(self, name: str) -> int:
        """Intermediate positions per index along the cut dimension (int4: a group a scale)."""
        return 1

    def tp_logical(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """A stored stack as `tp_layout` indexes it (int4: its codes); `tp_stored` inverts."""
        return full

    def tp_stored(self, name: str, part: torch.Tensor) -> torch.Tensor:
        return part

    def use_kernels(self, experts: nn.Module, kernels: Kernels, device_type: str) -> None:
        """Pick kernels for the engine's backend after loading; the float format has one."""

    def matmul(self, experts: nn.Module, x: torch.Tensor, which: str, e: int) -> torch.Tensor:
        """x [n, in] through expert e's w13 or w2."""
        return F.linear(x, getattr(experts, f"w{which}")[e])

    def program_operand(self, experts: nn.Module, which: str, e: int) -> ProgramOperand | None:
        """Expert e's w13 or w2 as the decode-step program multiplies it, exactly as `matmul`
        does; None when the program has no kernel for this format (the step stays eager)."""
        return ProgramOperand(ProgramOperand.DENSE, getattr(experts, f"w{which}")[e])

    def stacked(self, experts: nn.Module, which: str) -> torch.Tensor | None:
        """Every local expert's w13 or w2 as one float [E, out, in] stack for a grouped GEMM,
        or None where the format keeps no such stack (the quantised methods, which inherit
        this: their codes are integers and their kernels take one expert at a time)."""
        w = getattr(experts, f"w{which}", None)
        return w if w is not None and w.is_floating_point() and w.dim() == 3 else None


@dataclass(frozen=True, slots=True)
class MoEConfig:
    hidden_size: int
    intermediate_size: int  # per expert
    num_experts: int
    top_k: int
    num_shared_experts: int = 0
    scoring: str = "softmax"  # "softmax" (V2) | "sigmoid" (V3)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False  # V3's e_score_correction_bias

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported scoring_func {self.scoring!r}; use softmax or sigmoid")
        if self.num_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts {self.num_experts} is not divisible by n_group {self.n_group}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {self.num_experts}]")


def route(
    logits: torch.Tensor, cfg: MoEConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: fp32 [T, E] → (weights [T, k] fp32, expert ids [T, k] int64)."""
    scores = logits.softmax(dim=-1) if cfg.scoring == "softmax" else logits.sigmoid()
    choice = scores + bias if bias is not None else scores
    if cfg.n_group > 1 and cfg.topk_group < cfg.n_group:
        t = choice.shape[0]
        grouped = choice.view(t, cfg.n_group, -1)  # [T, G, E/G]
        if bias is not None:  # V3: a group is worth its two best experts
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        else:  # V2: a group is worth its best expert
            group_scores = grouped.max(dim=-1).values
        keep = torch.topk(group_scores, cfg.topk_group, dim=-1).indices  # [T, topk_group]
        mask = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        choice = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).view(t, -1)
    ids = torch.topk(choice, cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, ids


class RoutedExperts(nn.Module):
    """All routed experts' weights stacked: w13 [E, 2I, H] ([gate | up]) and w2 [E, H, I].

    Expert parallel keeps whole experts of this rank's range; tensor parallel without EP keeps
    every expert with its intermediate dimension cut (gate/up rows, down columns), as a
    column → row parallel MLP. Either way the output is a partial sum the stage adds up."""

    # Per expert, tokens are grouped with counts read on the host: no step graph can record
    # that (worker/decode_graphs.py). The grouped GEMM (use_grouped_mm) reads nothing back.
    graph_safe = False

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        state = parallel_state()
        e, h = cfg.num_experts, cfg.hidden_size
        slices = state.expert_slices
        if cfg.intermediate_size % slices:
            raise ValueError(
                f"moe_intermediate_size {cfg.intermediate_size} does not split over {slices} "
                "tensor-parallel ranks; use expert parallel (ep = tp)"
            )
        i = cfg.intermediate_size // slices
        # This rank's slice of each expert's intermediate rows: [slice_start, slice_start + i).
        self.slice_start = (state.tp_rank if slices > 1 else 0) * i
        self.slices = slices
        self.intermediate = i
        self.num_experts = e
        # Expert parallel: this rank holds experts owned = [first, first + local) of the e.
        owned = state.expert_range(e)
        self.owned, self.first = owned, owned.start
        self.hidden = h
        self.method = ExpertsMethod()
        self.method.create_weights(self, len(owned), 2 * i, h)
        self.act = silu_and_mul  # the backend's kernel after use_kernels
        self._grouped = False  # use_grouped_mm
        # Checkpoints store each expert's gate/up/down separately: shard = (kind, expert).
        self.w13.shards = [(k, x) for x in owned for k in ("gate", "up")]  # type: ignore[attr-defined]
        self.w2.shards = [("down", x) for x in owned]  # type: ignore[attr-defined]
        for p in (self.w13, self.w2):
            p.weight_loader = self._load  # type: ignore[attr-defined]

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard: tuple[str, int]) -> None:
        kind, e = shard
        e -= self.first
        i = self.intermediate
        # gate/up: [I, H] → rows [lo, lo + i); down: [H, I] → columns [lo, lo + i).
        if loaded.dim() == 2:
            loaded = self._tp_slice(loaded, 1 if kind == "down" else 0, halves=False)
        dst = {"gate": param.data[e, :i], "up": param.data[e, i:], "down": param.data[e]}[kind]
        if tuple(dst.shape) != tuple(loaded.shape):
            raise ValueError(
                f"shape mismatch for expert {e} {kind}: checkpoint has "
                f"{tuple(loaded.shape)}, model expects {tuple(dst.shape)}"
            )
        dst.copy_(loaded)

    def local_part(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a whole stored stack: its experts, and with TP slicing its
        intermediate slice where the method says the cut falls (gate and up rows, down
        columns)."""
        full = full.narrow(0, self.first, len(self.owned))
        halves, dim = self.method.tp_layout(name)
        if dim is None or self.slices == 1:
            return full
        logical = self.method.tp_logical(name, full)
        cut = self._tp_slice(logical, dim, halves=halves, unit=self.method.tp_unit(name))
        return self.method.tp_stored(name, cut)

    def _tp_slice(self, t: torch.Tensor, dim: int, halves: bool, unit: int = 1) -> torch.Tensor:
        """The one tensor-parallel rule of the experts: this rank's intermediate slice
        [lo, lo + i) along `dim` — of each half (gate | up) when `halves`; `unit` intermediate
        positions per index along `dim` (int4 groups)."""
        i, lo = self.intermediate, self.slice_start
        if i % unit:
            raise ValueError(
                f"the routed experts' int4 groups of {unit} cannot be cut into tensor-parallel "
                f"slices of {i}: serve with expert parallel (ep = tp), or compile int8 or a "
                "smaller --group-size"
            )
        i, lo = i // unit, lo // unit
        if not halves:
            return t.narrow(dim, lo, i)
        whole = t.shape[dim] // 2
        return torch.cat([t.narrow(dim, lo, i), t.narrow(dim, whole + lo, i)], dim=dim)

    def use_kernels(self, kernels: Kernels, device_type: str) -> None:
        self.method.use_kernels(self, kernels, device_type)
        self.act = kernels.silu_and_mul
        w13 = self.method.stacked(self, "13")
        self.use_grouped_mm(
            kernels.name == "fused"
            and w13 is not None
            and grouped_mm_in_graphs(w13.device, w13.dtype)
            and self.grouped_mm_layout_ok()
        )

    def grouped_mm_layout_ok(self) -> bool:
        """What the grouped GEMM kernel takes besides its device and dtype: this rank holds
        every expert (under expert parallel the loop skips the others' tokens), and rows of
        the hidden and intermediate sizes start on 16-byte boundaries (multiples of 8 bf16)."""
        return len(self.owned) == self.num_experts and self.hidden % 8 == 0 == self.intermediate % 8

    def use_grouped_mm(self, on: bool) -> None:
        """Route every step through two grouped GEMMs (all experts in one call each, the
        groups' ends a device tensor) instead of a loop over the experts that received tokens.
        Nothing is read back to the host, so a decode step with routed experts can be
        captured as a graph: `graph_safe` follows."""
        self._grouped = on
        self.graph_safe = on

    def set_method(self, method: ExpertsMethod) -> None:
        """Swap the weight format (artifact load, compile): drops the old tensors."""
        e, two_i, h = len(self.owned), 2 * self.intermediate, self.hidden
        device = parameters_device(self)  # the new stacks where the old ones were
        for name in self.method.tensor_names:
            self._parameters.pop(name, None)
        self.method = method
        with torch.device(device):
            method.create_weights(self, e, two_i, h)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; weights, ids: [T, k] → Σ_k weight · expert(x): [T, H].

        Assignments are sorted by expert so each expert runs one matmul over all its tokens;
        never a loop over tokens."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # [T*k]
        token_of = order // k
        xs = x[token_of]  # [T*k, H], grouped by expert
        experts = self._grouped_experts if self._grouped else self._looped_experts
        out = experts(xs, flat)  # [T*k, H]: each assignment through its expert
        out = out * weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, out)

    def _looped_experts(self, xs: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """xs [T*k, H] sorted by expert (flat: the unsorted expert ids) → [T*k, H]; a loop over
        the experts that received tokens, their counts read on the host."""
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.empty_like(xs)
        start = 0
        if len(self.owned) != self.num_experts:
            out.zero_()  # other EP ranks' experts contribute through the all-reduce
        for e, n in enumerate(counts):
            if n == 0:
                continue
            seg = slice(start, start + n)
            start += n
            if e not in self.owned:
                continue
            h = self.act(self.method.matmul(self, xs[seg], "13", e - self.first))  # [n, I]
            out[seg] = self.method.matmul(self, h, "2", e - self.first)
        return out

    def _grouped_experts(self, xs: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """The loop's arithmetic with fixed shapes and no host read: each expert's count by a
        scatter-add (bincount's size depends on the data), the groups' ends handed to two
        grouped GEMMs as a device tensor."""
        w13, w2 = self.method.stacked(self, "13"), self.method.stacked(self, "2")
        assert w13 is not None and w2 is not None
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=xs.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)  # [E]: group e is rows [ends[e-1], ends[e])
        # w13 [E, 2I, H] → [E, H, 2I] (a transposed view: the kernel's column-major operand).
        assert grouped_mm is not None  # use_grouped_mm is on only where torch has it
        h = self.act(grouped_mm(xs, w13.transpose(1, 2), offs=ends))  # [T*k, I]
        return grouped_mm(h, w2.transpose(1, 2), offs=ends)  # [T*k, H]


class SharedExperts(nn.Module):
    """Under tensor parallel, column → row parallel with the sum left to DeepseekMoE (one
    all-reduce for routed and shared experts together)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(
            hidden, [intermediate, intermediate], shard_names=("gate", "up"), parallel="column"
        )
        self.down_proj = Linear(intermediate, hidden, parallel="row", reduce=False)
        self.act = silu_and_mul

    def use_kernels(self, kernels: Kernels, device_type: str) -> None:  # noqa: ARG002
        self.act = kernels.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class MoEGate(nn.Module):
    """Router weights stay fp32 whatever the model dtype: selection is sensitive to rounding."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(cfg.num_experts, cfg.hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32), requires_grad=False)
            if cfg.score_correction_bias
            else None
        )
        for p in self.parameters():
            p.keep_fp32 = True  # type: ignore[attr-defined]  # casts (compile) leave it alone


class DeepseekMoE(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate = MoEGate(cfg)
        self.experts = RoutedExperts(cfg)
        self.shared_experts = (
            SharedExperts(cfg.hidden_size, cfg.intermediate_size * cfg.num_shared_experts)
            if cfg.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] → [T, H]."""
        logits = F.linear(x.float(), self.gate.weight)  # [T, E] fp32
        weights, ids = route(logits, self.cfg, self.gate.e_score_correction_bias)
        out = self.experts(x, weights, ids)  # partial: this rank's experts (or slices of them)
        state = parallel_state()
        # Shared experts: TP-sliced on every rank, or (EP without TP) whole on local rank 0.
        if self.shared_experts is not None and (state.tp_size > 1 or state.local_rank == 0):
            out = out + self.shared_experts(x)
        return all_reduce_stage(out)
