"""The captured decode step (layers/step_program.py) against the eager fused path.

The program replays the same kernels in the same order from C++, so its hidden states must
equal the eager path's bit for bit, for every weight format it takes (int4 VNNI, int8, dense
with a bias), at batch sizes 1 and 3 with sequences of different lengths. Whether it ran is
checked too: a program that silently fell back would pass an equality test."""

from __future__ import annotations

import logging

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.device.host_threads import core_share
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.worker.input_batch import build_model_input
from dsinfer.worker.step_io import ScheduledSeq
from tests.helpers import (
    DEEPSEEK_CASES,
    DEEPSEEK_COMMON,
    VOCAB,
    assert_pool_clean,
    fused_cpu_has,
    save_and_load,
    skip_without,
)


@torch.inference_mode()
def _decode_hidden(engine: LLMEngine, prompts: list[list[int]], captured: bool) -> torch.Tensor:
    """Feed every prompt one token per step, all sequences in one batch (decode rows only);
    the hidden states of every step, concatenated. `captured`: through the program or eager."""
    runner, bs = engine.executor.runner, engine.block_size
    model = runner.model
    program, model.step_program = model.step_program, (model.step_program if captured else None)
    tables = [engine.pool.allocate(-(-len(p) // bs)) for p in prompts]
    out = []
    try:
        for pos in range(max(map(len, prompts))):
            seqs = [
                ScheduledSeq(f"s{i}", [p[pos]], pos, table, do_sample=False)
                for i, (p, table) in enumerate(zip(prompts, tables, strict=True))
                if pos < len(p)
            ]
            inp = build_model_input(seqs, bs, runner.device)
            assert model.step_program is None or model.step_program.takes(len(seqs), inp.meta)
            out.append(model(inp.input_ids, inp.positions, runner.kv_caches, inp.meta))
        return torch.cat(out)
    finally:
        model.step_program = program
        for table in tables:
            engine.pool.free(table)


def _assert_program_equals_eager(
    llm: LLM, batches: tuple[tuple[int, ...], ...] = ((7,), (5, 9, 17))
) -> None:
    runner = llm.engine.executor.runner
    assert runner.step_program and runner.model.step_program is not None
    g = torch.Generator().manual_seed(0)
    vocab = llm.engine.model_config.vocab_size
    for lengths in batches:
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
        captured = _decode_hidden(llm.engine, prompts, captured=True)
        eager = _decode_hidden(llm.engine, prompts, captured=False)
        assert captured.dtype == eager.dtype and captured.shape == eager.shape
        assert torch.equal(captured, eager), (lengths, (captured - eager).abs().max().item())


def test_smollm2_int4_program_equals_eager():
    """The default configuration: int4 weights (VNNI layout), bf16 activations, int8 head."""
    skip_without("int4_vnni")  # else torch's int4 layout, which the program has no kernel for
    llm = LLM("smollm2", kv_cache_memory="32MiB")
    assert llm.engine.dtype == torch.bfloat16
    threads = torch.get_num_threads()
    program = llm.engine.executor.runner.model.step_program
    # Intra-op threads were measured per bucket at capture, on the cores the process's engines
    # share (the first engine's count: device/host_threads.core_share): the fewest within 3%
    # of the best. Where something else held a core while capture timed the program (another
    # process on a busy 2-core CI machine: every step slower on two threads), the times say
    # "throttled" and the program keeps every thread, as logged (that the process itself has
    # one OpenMP pool, the usual cause: tests/device/test_host_threads.py).
    if program.regions_throttled():
        assert program.threads == {}, program.measured_ms
    else:
        assert set(program.threads) == {1, 16}, program.measured_ms
    assert set(program.measured_ms) == {1, 16}
    assert all(1 <= program.threads_for(rows) <= core_share().cores for rows in (1, 16))
    _assert_program_equals_eager(llm)
    assert torch.get_num_threads() == threads  # a step's thread count does not leak
    # Generation goes through it and releases its blocks.
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 8
    assert_pool_clean(llm.engine)


def _tiny(
    family: str,
    path,  # noqa: ANN001
    quantization: str,
    dtype: str,
    hidden: int = 64,
    intermediate: int = 128,
    **kwargs,  # noqa: ANN003
) -> LLM:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    torch.manual_seed(7)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
        with torch.no_grad():  # random init leaves biases at zero: make them count
            for layer in model.model.layers:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    return save_and_load(model, path, "fused", dtype=dtype, quantization=quantization, **kwargs)


@pytest.mark.parametrize(
    ("family", "quantization", "dtype"),
    [("qwen2", "none", "bfloat16"), ("llama", "int8", "bfloat16"), ("llama", "none", "float32")],
)
def test_tiny_program_equals_eager(tmp_path, family: str, quantization: str, dtype: str):
    """Dense weights with a qkv bias, int8 weights, fp32 activations."""
    llm = _tiny(family, tmp_path, quantization, dtype)
    if quantization == "int8" and torch.ops.dsinfer.int8_vnni_i16_supported():
        # Narrow int8 layers repacked for int8_vnni_i16_linear (the program's INT8_VNNI_I16).
        method = llm.engine.executor.runner.model.model.layers[0].mlp.down_proj.method
        assert method.vnni and not method.wide
    _assert_program_equals_eager(llm)


def test_int8_activations_on_int8_layers_program_equals_eager(tmp_path):
    """--int8-activations all on int8 weights: with AVX-512 the narrow int8 layers take the
    int8 × int8 kernel (the program's INT8_VNNI), in the program as in the eager path."""
    skip_without("int4_i8")  # the policy needs the int8-activation kernels' build
    llm = _tiny("llama", tmp_path, "int8", "bfloat16", int8_activations="all")
    method = llm.engine.executor.runner.model.model.layers[0].mlp.down_proj.method
    assert method.int8 == bool(torch.ops.dsinfer.int8_vnni_supported())
    _assert_program_equals_eager(llm, ((7,), tuple(range(3, 21))))


def test_wide_int8_program_equals_eager(tmp_path):
    """int8 weights with a wide layer (gate|up: 8192 outputs, the kernels' "wide" rule: the
    int8 × int8 kernel with AVX-512, the int16 one with AVX2) and a batch of 18 rows (past
    the packed kernel's 16: on a CPU without native bf16 GEMMs, int8_mm's packed path)."""
    llm = _tiny("llama", tmp_path, "int8", "bfloat16", intermediate=4096)
    method = llm.engine.executor.runner.model.model.layers[0].mlp.gate_up_proj.method
    assert method.vnni or method.i16 or not torch.ops.dsinfer.int8_i16_supported()
    _assert_program_equals_eager(llm, ((7,), tuple(range(3, 21))))


def test_program_off_and_reference_backend_stay_eager(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        off = _tiny("llama", tmp_path, "none", "float32")
    assert "decode steps run as one captured program" in caplog.text
    assert off.engine.executor.runner.step_program
    for kwargs in ({"step_program": False}, {"backend": "reference"}):
        llm = LLM(str(tmp_path), dtype="float32", num_blocks=64, block_size=4, **kwargs)
        assert not llm.engine.executor.runner.step_program
        assert llm.engine.executor.runner.model.step_program is None


def test_a_layer_without_a_program_kernel_leaves_the_step_eager(tmp_path, caplog):
    """The VNNI int4 layout takes 64 outputs at a time: with hidden size 96 the o projection
    keeps torch's int4 layout, which the program has no kernel for. Capture refuses, naming
    the layer, and the engine decodes layer by layer."""
    _tiny("llama", tmp_path, "none", "float32", hidden=96)  # writes the checkpoint
    with caplog.at_level(logging.INFO):
        llm = LLM(
            str(tmp_path),
            dtype="bfloat16",
            quantization="int4",
            num_blocks=64,
            block_size=4,
            backend="fused",
        )
    runner = llm.engine.executor.runner
    assert not runner.model.model.layers[0].self_attn.o_proj.method.vnni
    assert not runner.step_program
    # Without the fused int4 kernels (no AVX2) every int4 layer keeps torch's layout: the
    # first layer capture meets is qkv.
    first = "o" if fused_cpu_has("int4_vnni") else "qkv"
    assert f"decode steps run layer by layer: layer 0 {first}: no step-program kernel" in (
        caplog.text
    )
    out = llm.generate(["hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_smollm2_int8_activations_program_equals_eager():
    """--int8-activations out_proj: the program multiplies o_proj and down_proj with the int8
    kernel (int4_i8_linear) and the other int4 layers as before, as the eager path does."""
    skip_without("int4_i8")
    llm = LLM("smollm2", kv_cache_memory="32MiB", int8_activations="out_proj")
    layer = llm.engine.executor.runner.model.model.layers[0]
    assert layer.self_attn.o_proj.method.int8 and layer.mlp.down_proj.method.int8
    assert not layer.self_attn.qkv_proj.method.int8 and not layer.mlp.gate_up_proj.method.int8
    _assert_program_equals_eager(llm, ((7,), (5, 9, 17)))
    with torch.profiler.profile() as prof:
        llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0))
    names = {e.key for e in prof.key_averages()}
    assert {"dsinfer::int4_i8_linear", "dsinfer::int4_bf16_linear"} <= names, names
    assert_pool_clean(llm.engine)


TINY_INT4_KV_LORA = 48  # _tiny_deepseek's latent width under int4 (DEEPSEEK_COMMON's: 16)


def _kv_lora(quantization: str) -> int:
    """_tiny_deepseek's kv_lora_rank for this quantisation."""
    return TINY_INT4_KV_LORA if quantization != "none" else DEEPSEEK_COMMON["kv_lora_rank"]


def _tiny_deepseek(path, case: str, quantization: str, dtype: str, **kwargs) -> LLM:  # noqa: ANN001
    """A tiny DeepSeek checkpoint written by transformers (tests/helpers: MLA, a dense first
    layer, then DeepSeekMoE with shared experts), its router made to matter."""
    from transformers import (
        DeepseekV2Config,
        DeepseekV2ForCausalLM,
        DeepseekV3Config,
        DeepseekV3ForCausalLM,
    )

    version, extra = DEEPSEEK_CASES[case]
    config = {**DEEPSEEK_COMMON, **extra}
    if quantization != "none":
        # The int4 kernels' layout takes 64 outputs at a time and inputs in groups of 32; the
        # int8 ones' 16 outputs and 32 inputs at a time.
        config.update(
            hidden_size=128,
            intermediate_size=128,
            moe_intermediate_size=64,
            kv_lora_rank=TINY_INT4_KV_LORA,
            qk_nope_head_dim=16,
            qk_rope_head_dim=16,
            v_head_dim=32,
            q_lora_rank=64 if extra.get("q_lora_rank") else None,
        )
    torch.manual_seed(3)
    cls, cfg = (
        (DeepseekV2ForCausalLM, DeepseekV2Config)
        if version == "v2"
        else (DeepseekV3ForCausalLM, DeepseekV3Config)
    )
    model = cls(cfg(**config))
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=g)
            if version == "v3":
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3, generator=g)
    return save_and_load(model, path, "fused", dtype=dtype, quantization=quantization, **kwargs)


@pytest.mark.parametrize(
    ("case", "quantization", "dtype"),
    [
        ("v2-lite-shape", "none", "float32"),
        ("v2-grouped", "int8", "bfloat16"),
        ("v3", "int4", "bfloat16"),
        ("v2-lite-shape", "int4", "bfloat16"),
    ],
)
def test_deepseek_program_equals_eager(tmp_path, case: str, quantization: str, dtype: str):
    """MLA (with and without a q LoRA), a dense first layer, then DeepSeekMoE (softmax and
    greedy, group-limited, V3's sigmoid with its selection bias and renormalised weights),
    in dense fp32, int8 and int4 weights: the program's hidden states are the eager path's."""
    skip_without("mla_projections", _kv_lora(quantization))  # the program's MLA kernels
    if quantization == "int4":
        skip_without("int4_vnni")
    llm = _tiny_deepseek(tmp_path, case, quantization, dtype)
    model = llm.engine.executor.runner.model
    # Both paths on every intra-op thread: a dense fp32 GEMM's sums depend on the thread
    # count, which capture measures per bucket (a tiny model may take one thread for 16 rows).
    model.step_program.threads = {}
    if quantization == "int4" or torch.ops.dsinfer.int8_vnni_i16_supported():
        # The routed experts (and the narrow int8 layers) took the kernels' layout.
        assert quantization == "none" or model.model.layers[1].mlp.experts.method.vnni
    _assert_program_equals_eager(llm, ((7,), (5, 9, 17), tuple(range(3, 15))))
    out = llm.generate(
        {"prompt_token_ids": [5, 9, 33]},
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
    )
    assert len(out[0].outputs[0].token_ids) == 6
    assert_pool_clean(llm.engine)


def test_deepseek_int8_activations_program_equals_eager(tmp_path):
    """--int8-activations all: the routed experts' stacks, the shared experts and MLA's
    projections meet the int8 kernel in the program as in the eager path."""
    skip_without("int4_i8")
    llm = _tiny_deepseek(tmp_path, "v3", "int4", "bfloat16", int8_activations="all")
    assert llm.engine.executor.runner.model.model.layers[1].mlp.experts.method.int8 == ("13", "2")
    _assert_program_equals_eager(llm, ((7,), (5, 9, 17)))


def test_deepseek_step_counts_one_program_call(tmp_path):
    """What the compile report counts: a DeepSeek decode step is a few operator calls from
    Python (embedding, the program), its kernels visible to the profiler under it."""
    skip_without("mla_projections", _kv_lora("none"))
    from dsinfer.artifact.report import decode_ops
    from dsinfer.models.loader import load_model

    _tiny_deepseek(tmp_path, "v2-lite-shape", "none", "bfloat16")  # writes the checkpoint
    eager = decode_ops(load_model(str(tmp_path), torch.bfloat16), "fused")
    program = decode_ops(load_model(str(tmp_path), torch.bfloat16), "fused", program=True)
    assert program.from_python <= 4 < eager.from_python, (program, eager)
    assert 0 < program.per_layer, program


class _SimulatedProgram:
    """A decode program whose step takes 2 ms on two intra-op threads and 4 ms on one, and
    whose first `busy_calls` steps take 20 ms more whatever their threads: something else
    holding a core for a moment while the server starts."""

    def __init__(self, busy_calls: int) -> None:
        self.calls, self.busy_calls = 0, busy_calls

    def run(self, x: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        import time

        self.calls += 1
        base = 0.002 if torch.get_num_threads() >= 2 else 0.004
        time.sleep(base + (0.02 if self.calls <= self.busy_calls else 0.0))
        return x


def test_thread_tuning_outlasts_a_moment_of_contention() -> None:
    """Candidates are timed in rounds, each round every thread count in turn, best of the
    rounds: a slow moment at start-up costs one round of each, so the faster count wins.
    Timed one count after the other (the first version), the moment fell on every run of two
    threads and one thread was kept."""
    from dsinfer.layers.step_program import StepProgram, fewest_threads_within

    assert fewest_threads_within({2: 0.0100, 1: 0.0102}) == 1  # within 3%: the fewer
    assert fewest_threads_within({2: 0.0100, 1: 0.0110}) == 2
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        program = StepProgram(_SimulatedProgram(busy_calls=4))  # type: ignore[arg-type]
        assert program.tune_threads(hidden=8, dtype=torch.float32, num_blocks=16) == {1: 2, 16: 2}
        assert program.measured_ms[1][2] < program.measured_ms[1][1]
    finally:
        torch.set_num_threads(before)


def test_tuning_says_when_every_thread_is_twice_as_slow_as_one() -> None:
    """A 2-thread step at least twice one thread's time is no property of the program: the
    tuning names the likely cause (a second OpenMP pool) instead of silently keeping one."""
    from dsinfer.layers.step_program import StepProgram

    program = StepProgram(_SimulatedProgram(busy_calls=0))  # type: ignore[arg-type]
    program.measured_ms = {1: {2: 1.33, 1: 1.57}, 16: {2: 7.13, 1: 11.62}}
    assert program.regions_throttled() is None
    program.measured_ms = {1: {2: 6.25, 1: 1.51}, 16: {2: 11.79, 1: 11.61}}
    why = program.regions_throttled()
    assert why is not None and "6.25 ms on 2 threads against 1.51 ms on one" in why
    assert "OpenMP pool" in why
    # A large machine: one row is slower on all 32 threads than on one (waking them costs more
    # than the row's work), but 16 rows gain from them: nothing is throttled, and the one-row
    # bucket keeps the few threads the tuning chose.
    program.measured_ms = {1: {32: 3.4, 8: 1.6, 1: 1.5}, 16: {32: 2.1, 8: 3.0, 1: 20.0}}
    assert program.regions_throttled() is None


def test_a_throttled_tuning_keeps_every_thread(caplog: pytest.LogCaptureFixture) -> None:
    """Timed while another pool made every 2-thread region slow (a hot swap's old version
    still stepping, say), the tuning does not keep 1 thread for good: it keeps every thread and
    says why."""
    from dsinfer.layers.step_program import StepProgram

    class Throttled(_SimulatedProgram):
        def run(self, x: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
            import time

            time.sleep(0.008 if torch.get_num_threads() >= 2 else 0.002)
            return x

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        program = StepProgram(Throttled(busy_calls=0))  # type: ignore[arg-type]
        with caplog.at_level(logging.WARNING):
            program.tuned(hidden=8, dtype=torch.float32, num_blocks=16)
        assert program.threads == {} and program.threads_for(1) == 2
        assert "keeping every intra-op thread" in caplog.text
    finally:
        torch.set_num_threads(before)


def test_a_tuning_throttled_for_a_moment_measures_again(caplog: pytest.LogCaptureFixture) -> None:
    """Something that held a core only while the first tuning ran (another process starting
    beside this one) does not decide the threads for the server's life: the tuning measures
    once more after a pause and keeps what that measurement says."""
    from dsinfer.layers.step_program import StepProgram

    class ThrottledAtFirst(_SimulatedProgram):
        def run(self, x: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
            import time

            self.calls += 1
            two = torch.get_num_threads() >= 2
            if self.calls <= self.busy_calls:  # the first tuning: two threads throttled
                time.sleep(0.008 if two else 0.002)
            else:  # after: two threads twice as fast as one
                time.sleep(0.002 if two else 0.004)
            return x

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        program = StepProgram(ThrottledAtFirst(busy_calls=24))  # type: ignore[arg-type]
        program.tune_threads(hidden=8, dtype=torch.float32, num_blocks=16)
        assert program._program.calls == 24  # one tuning's calls: 2 buckets x (2 + 5 x 2)
        program._program.calls = 0
        with caplog.at_level(logging.INFO):
            program.tuned(hidden=8, dtype=torch.float32, num_blocks=16)
        assert "measuring again" in caplog.text and "keeping every" not in caplog.text
        assert program.threads == {1: 2, 16: 2}
        assert program._program.calls == 48
    finally:
        torch.set_num_threads(before)


def test_the_program_keeps_to_its_engines_share_of_the_cores() -> None:
    """Tuned to two threads, a step whose engine runs on one (two busy engines share the
    cores: device/host_threads.CoreShare) runs on one; on more, it keeps its tuned two."""
    from dsinfer.device.host_threads import intra_op_threads
    from dsinfer.layers.step_program import StepProgram

    program = StepProgram(_SimulatedProgram(busy_calls=0))  # type: ignore[arg-type]
    program.threads = {1: 2, 16: 2}
    with intra_op_threads(1):
        assert program.threads_for(1) == 1 and program.threads_for(16) == 1
    with intra_op_threads(4):
        assert program.threads_for(1) == 2
