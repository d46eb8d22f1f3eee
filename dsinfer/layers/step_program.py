"""The decode step as one program (the fused CPU backend's compiled step).

A model whose decoder stack the program can express captures it once after loading and binding
the KV pool (`capture_step_program`): weights in their kernel layouts, norms, KV pages and the
rotary tables are bound into a C++ `DecodeProgram` (layers/kernels/step_program.cpp), which
then runs every decoder layer of a decode-only step in one call: no Python, no dispatcher and
no tensor wrappers between kernels. Steps with prefill rows (or drafts) stay on the eager path.

Capture is all or nothing: a layer the program cannot express (a tensor-parallel cut, a weight
format without a program kernel, another attention) leaves the model eager, with the reason
logged once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from dsinfer.device.host_threads import intra_op_threads
from dsinfer.layers.attention import AttentionMetadata
from dsinfer.layers.linear import Linear, ProgramOperand
from dsinfer.layers.moe import DeepseekMoE
from dsinfer.layers.norm import RMSNorm

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ProgramLayer:
    """One pre-norm decoder layer as the program runs it: input norm, qkv, rotary + KV write +
    paged attention, o, post-attention norm, gate|up, SiLU·mul, down."""

    input_norm: RMSNorm
    qkv: Linear
    o: Linear
    post_norm: RMSNorm
    gate_up: Linear
    down: Linear
    kv_cache: tuple[torch.Tensor, torch.Tensor]


# Batch sizes the program is timed at when captured (rows ≤ 4 take the first's choice).
TUNED_BUCKETS = (1, 16)
# How long a tuning whose times say "throttled" waits before it measures once more: another
# process holding a core while this one starts (a compiler, a client starting up) is often
# gone by then, and a tuning that kept every thread for that moment would keep it for the
# server's life.
RETUNE_PAUSE_S = 0.2


def fewest_threads_within(measured: dict[int, float], slack: float = 1.03) -> int:
    """The fewest intra-op threads whose best step time is within `slack` of the fastest: a
    thread that adds nothing to the step is better left to the rest of the process (HTTP,
    detokenising, grammars)."""
    fastest = min(measured.values())
    return min(n for n, t in measured.items() if t <= fastest * slack)


class StepProgram:
    """A captured decode step: `run` takes the embedded decode tokens of a decode-only step."""

    def __init__(self, program: torch.ScriptObject) -> None:
        self._program = program
        # Intra-op threads per tuned bucket (tune_threads); none: the process's setting.
        self.threads: dict[int, int] = {}
        self.measured_ms: dict[int, dict[int, float]] = {}  # rows → threads → best ms

    def threads_for(self, rows: int) -> int:
        """The tuned threads of the rows' bucket, at most the calling thread's intra-op threads
        now: an engine stepping on its share of the cores (device/host_threads.CoreShare)
        keeps to it."""
        bucket = TUNED_BUCKETS[0] if rows <= 4 else TUNED_BUCKETS[-1]
        now = torch.get_num_threads()
        return min(self.threads.get(bucket) or now, now)

    @torch.inference_mode()
    def tune_threads(
        self, hidden: int, dtype: torch.dtype, num_blocks: int, repeats: int = 5
    ) -> dict[int, int]:
        """Time the program per bucket with all intra-op threads and with fewer; keep the
        fewest within 3% of the fastest. Why: a thread the decode step does not need is left
        to the server's event loop (measured with kernels that used one thread: 16 streams'
        ITL p50 48.5 → 42.9 ms); on the 2-vCPU machines here both buckets now take both
        threads (a 16-row step 33 → 19 ms). Decode steps take what was measured and every
        other step keeps every thread. Runs once at capture (SmolLM2 ~0.3 s; a 4-layer cut of
        DeepSeek-V2-Lite 0.6 s, its steps over 50 ms timed once), one token per row in
        blocks 0..rows-1 of the idle pool (any later use writes a slot before reading it)."""
        most = torch.get_num_threads()
        candidates = sorted({most, max(1, most // 2), 1}, reverse=True)
        if len(candidates) == 1:  # one thread: nothing to choose, nothing to time
            self.threads = {rows: most for rows in TUNED_BUCKETS}
            return self.threads
        g = torch.Generator().manual_seed(0)
        chosen: dict[int, int] = {}
        for rows in (r for r in TUNED_BUCKETS if r <= num_blocks):
            x = (torch.randn(rows, hidden, generator=g) * 0.1).to(dtype)
            tables = torch.arange(rows, dtype=torch.long)[:, None]  # a block of its own each
            lens = torch.ones(rows, dtype=torch.long)
            args = (x, tables, lens)
            warm = [self._timed_step(n, *args) for n in candidates]
            # A long step (DeepSeek-V2-Lite's 27 layers: ~0.6 s at 16 rows) is timed once:
            # its noise is small against it, and start-up stays short.
            rounds = 1 if max(warm) > 0.05 else repeats
            measured = dict.fromkeys(candidates, float("inf"))
            # Rounds of every candidate in turn, not each candidate's runs together: a moment
            # when something else holds a core then slows a round of all of them, not every
            # run of one. (What made a server keep 1 thread in session 27 was not noise but a
            # second OpenMP pool in the process, slowing every 2-thread region for good:
            # device/host_threads.py. The log's measured ms show such a case.)
            for _ in range(rounds):
                for n in candidates:
                    measured[n] = min(measured[n], self._timed_step(n, *args))
            chosen[rows] = fewest_threads_within(measured)
            self.measured_ms[rows] = {n: round(t * 1e3, 2) for n, t in measured.items()}
        self.threads = chosen
        return chosen

    def regions_throttled(self) -> str | None:
        """What the measured times say when all threads are at least twice as slow as one at
        some bucket and gain nothing at the bucket of most rows, or None. Healthy, a many-row
        step runs much faster on every thread (16 rows: 7.1 ms on two threads against 11.6 on
        one here), even where a one-row step is slower on all of a large machine's threads
        (their wake-ups cost more than the row's work): then the one-row choice stands. The
        usual cause of both at once: another thread of this process holds an OpenMP pool, and
        libgomp then wakes every region's workers through a futex (device/host_threads.py)."""
        widest = self.measured_ms.get(max(self.measured_ms, default=0), {})
        if 1 not in widest or max(widest) == 1 or widest[max(widest)] < 0.8 * widest[1]:
            return None  # the many-row step gains from its threads: they are not throttled
        for rows, by_threads in self.measured_ms.items():
            most, one = by_threads[max(by_threads)], by_threads.get(1)
            if one is not None and max(by_threads) > 1 and most >= 2 * one:
                return (
                    f"a {rows}-row decode step took {most} ms on {max(by_threads)} threads "
                    f"against {one} ms on one: parallel regions are paying for waking their "
                    "threads; is another thread of this process running torch ops (a second "
                    "OpenMP pool), or another process holding a core while this one started? "
                    "See docs/backends.md, 'One OpenMP pool'"
                )
        return None

    def _timed_step(
        self, threads: int, x: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
    ) -> float:
        """Seconds of one program run on `threads` intra-op threads."""
        with intra_op_threads(threads):
            t0 = time.perf_counter()
            self._program.run(x, tables, lens)
            return time.perf_counter() - t0

    def tuned(self, hidden: int, dtype: torch.dtype, num_blocks: int) -> StepProgram:
        """This program with its threads per bucket measured (tune_threads) and logged; if the
        times say "throttled", measured once more after RETUNE_PAUSE_S."""
        threads = self.tune_threads(hidden, dtype, num_blocks)
        why = self.regions_throttled()
        if why:
            logger.info("step program: %s; measuring again in %.1f s", why, RETUNE_PAUSE_S)
            time.sleep(RETUNE_PAUSE_S)
            threads = self.tune_threads(hidden, dtype, num_blocks)
            why = self.regions_throttled()
        logger.info(
            "step program: intra-op threads by decode rows %s (measured, best ms by threads: %s)",
            threads,
            self.measured_ms,
        )
        if why:
            # The comparison measured the other pool, not the program: fewer threads would
            # stay after that pool is gone (a hot swap's old version unloaded, say), at about
            # half the speed of a many-row step. Every thread is right once it is gone.
            self.threads = {}
            logger.warning("step program: %s; keeping every intra-op thread", why)
        return self

    @staticmethod
    def takes(rows: int, meta: AttentionMetadata) -> bool:
        """Whether the program can run this step: every row a single-token decode."""
        return meta.num_decode == rows and not meta.prefills and meta.decode_seq_lens is not None

    def run(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: [B, hidden] embedded tokens → final-normed hidden states [B, hidden]."""
        # One range around the call (a few µs a step): the profiler shows the program's
        # kernels under the one call Python made.
        with (
            record_function("dsinfer::DecodeProgram.run"),
            intra_op_threads(self.threads_for(x.shape[0])),
        ):
            return self._program.run(x, meta.decode_block_tables, meta.decode_seq_lens)


def capture_step_program(
    layers: list[ProgramLayer],
    final_norm: RMSNorm,
    table_cos: torch.Tensor,
    table_sin: torch.Tensor,
    shape: dict[str, float],
) -> StepProgram | str:
    """Bind the layers into a DecodeProgram; or say why they cannot be (the step stays eager).

    `shape`: num_heads, num_kv_heads (this rank's), scale, eps — shared by every layer."""
    norms = [n for layer in layers for n in (layer.input_norm, layer.post_norm)]
    if why := _unshared(table_cos, final_norm, norms):
        return why
    eps = final_norm.eps
    program = torch.classes.dsinfer.DecodeProgram(
        table_cos,
        table_sin,
        final_norm.weight.data,
        int(shape["num_heads"]),
        int(shape["num_kv_heads"]),
        float(shape["scale"]),
        float(eps),
    )
    for i, layer in enumerate(layers):
        operands = [
            lin.program_operand() for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        for lin, op in zip(("qkv", "o", "gate_up", "down"), operands, strict=True):
            if isinstance(op, str):
                return f"layer {i} {lin}: {op}"
        k_cache, v_cache = layer.kv_cache
        program.add_layer(
            layer.input_norm.weight.data, layer.post_norm.weight.data, k_cache, v_cache
        )
        for lin, op in zip((layer.qkv, layer.o, layer.gate_up, layer.down), operands, strict=True):
            assert isinstance(op, ProgramOperand)
            bias = None if lin.bias is None else lin.bias.data
            program.add_linear(op.kind, op.a.data, _second(op), bias, op.dense_from_rows)
    return StepProgram(program)


def _unshared(table_cos: torch.Tensor, final_norm: RMSNorm, norms: list[RMSNorm]) -> str | None:
    """What a program's one set of rotary tables and one epsilon cannot stand for, or None."""
    if table_cos.dtype != torch.float32:
        return "the rotary tables are not fp32"
    if any(n.eps != final_norm.eps for n in norms):
        return "the norms do not share one epsilon"
    return None


def _second(op: ProgramOperand) -> torch.Tensor:
    # The C++ signature takes a tensor; a dense weight has no second one.
    return op.b.data if op.b is not None else torch.empty(0)


@dataclass(frozen=True, slots=True)
class MlaProgramLayer:
    """One DeepSeek decoder layer as the MLA program runs it (kernels/step_program_mla.cpp):
    input norm; q (q_a → q_a_norm → q_b with a q LoRA), kv_a → kv_a_norm, rotary + latent write
    + absorbed decode through kv_b, o; post-attention norm; a dense MLP (gate|up, down) or
    DeepSeekMoE (router, routed experts, shared experts)."""

    input_norm: RMSNorm
    q: tuple[Linear, ...]  # (q_proj,) or (q_a_proj, q_b_proj)
    q_a_norm: RMSNorm | None
    kv_a: Linear
    kv_a_norm: RMSNorm
    kv_b: torch.Tensor  # kv_b_proj's weight [H·(nope + v), lora], read by the MLA kernels
    o: Linear
    post_norm: RMSNorm
    mlp: tuple[Linear, Linear] | None  # a dense layer's gate|up, down
    moe: DeepseekMoE | None
    cache: torch.Tensor  # the latent pages [blocks, bs, lora + rope]


def capture_mla_step_program(
    layers: list[MlaProgramLayer],
    final_norm: RMSNorm,
    table_cos: torch.Tensor,
    table_sin: torch.Tensor,
    shape: dict[str, float],
) -> StepProgram | str:
    """Bind DeepSeek's layers into an MlaDecodeProgram; or say why they cannot be.

    `shape`: num_heads (this rank's), nope, rope, v_dim, lora, scale — shared by every layer."""
    norms = [n for layer in layers for n in (layer.input_norm, layer.post_norm, layer.kv_a_norm)]
    norms += [layer.q_a_norm for layer in layers if layer.q_a_norm is not None]
    if why := _unshared(table_cos, final_norm, norms):
        return why
    eps = final_norm.eps
    operands = []  # per layer: (part, operand, bias) in the order the program appends them
    for i, layer in enumerate(layers):
        bound = _linear_operands("attn", (*layer.q, layer.kv_a, layer.o), [])
        if not isinstance(bound, str):
            bound = _linear_operands("mlp", layer.mlp or (), bound)
        if layer.moe is not None and not isinstance(bound, str):
            bound = _moe_operands(layer.moe, bound)
        if isinstance(bound, str):
            return f"layer {i}: {bound}"
        operands.append(bound)
    program = torch.classes.dsinfer.MlaDecodeProgram(
        table_cos,
        table_sin,
        final_norm.weight.data,
        int(shape["num_heads"]),
        int(shape["nope"]),
        int(shape["rope"]),
        int(shape["v_dim"]),
        int(shape["lora"]),
        float(shape["scale"]),
        float(eps),
    )
    for layer, bound in zip(layers, operands, strict=True):
        q_a_norm = layer.q_a_norm.weight.data if layer.q_a_norm is not None else None
        program.add_layer(
            layer.input_norm.weight.data,
            layer.post_norm.weight.data,
            layer.kv_a_norm.weight.data,
            q_a_norm,
            layer.cache,
            layer.kv_b,
        )
        if layer.moe is not None:
            _set_router(program, layer.moe)
        for part, op, bias in bound:
            program.add_linear(part, op.kind, op.a.data, _second(op), bias, op.dense_from_rows)
    return StepProgram(program)


# A layer's projections as the MLA program takes them: (part, operand, bias).
_Bound = list[tuple[str, ProgramOperand, "torch.Tensor | None"]]


def _linear_operands(part: str, linears: tuple[Linear, ...], bound: _Bound) -> _Bound | str:
    """`bound` extended by the layers' operands under `part`, or why one has none."""
    for lin in linears:
        op = lin.program_operand()
        if isinstance(op, str):
            return op
        bound.append((part, op, None if lin.bias is None else lin.bias.data))
    return bound


def _moe_operands(moe: DeepseekMoE, bound: _Bound) -> _Bound | str:
    """`bound` extended by every routed expert's w13, then every w2, then the shared
    experts' gate|up and down; or why the program cannot run these experts."""
    experts = moe.experts
    if len(experts.owned) != experts.num_experts or experts.slices != 1:
        return "expert- or tensor-parallel experts reduce across ranks"
    for which in ("13", "2"):
        for e in range(len(experts.owned)):
            op = experts.method.program_operand(experts, which, e)
            if op is None:
                return f"no step-program kernel for {type(experts.method).__name__}"
            bound.append((f"w{which}", op, None))
    shared = moe.shared_experts
    if shared is None:
        return bound
    with_shared = _linear_operands("shared", (shared.gate_up_proj, shared.down_proj), bound)
    return f"shared experts: {with_shared}" if isinstance(with_shared, str) else with_shared


def _set_router(program: torch.ScriptObject, moe: DeepseekMoE) -> None:
    cfg, gate = moe.cfg, moe.gate
    bias = gate.e_score_correction_bias
    program.set_router(
        gate.weight.data,
        None if bias is None else bias.data,
        cfg.top_k,
        cfg.n_group,
        cfg.topk_group,
        cfg.scoring == "softmax",
        cfg.norm_topk_prob,
        float(cfg.routed_scaling_factor),
    )
