"""Decode steps replayed as graphs per (batch, context) bucket (worker/decode_graphs.py).

On the CPU the graphs are eager (device/graphs.EagerGraph), so what is tested here is all that
surrounds a CUDA graph: buckets, static buffers, padding rows and columns, the block reserved
for padding, and the runner choosing the graph for decode-only steps. A padded step must give
the real rows what the unpadded eager step gives and must not touch any block but the real
rows' slots and the reserved one. The same checks with recorded CUDA graphs are in
tests/worker/test_decode_graphs_gpu.py (marked gpu)."""

from __future__ import annotations

import gc
import logging
import weakref
from pathlib import Path
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dsinfer import LLM
from dsinfer.config import CacheConfig
from dsinfer.device.graphs import EagerGraph, graphs_unavailable, new_step_graph
from dsinfer.layers.backend import apply_backend
from dsinfer.models.loader import LoadedModel
from dsinfer.sampling import SamplingParams
from dsinfer.worker.decode_graphs import DecodeGraphs, bucket_for, buckets_up_to, graph_unsafe
from dsinfer.worker.input_batch import build_model_input
from dsinfer.worker.model_runner import ModelRunner
from dsinfer.worker.step_io import NewRequestData, ScheduledSeq, SchedulerOutput
from tests.graph_doubles import AddressGraph, ReplayingGraph, record_graphs
from tests.helpers import DEEPSEEK_CASES, DEEPSEEK_COMMON, save_and_load, tiny_llama_dir

BS = 4  # block size: sequences of 5-17 tokens span 2-5 blocks, so context buckets change
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)


def test_buckets_cover_every_size_once() -> None:
    assert buckets_up_to(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_up_to(5) == (1, 2, 4, 5)
    assert buckets_up_to(1) == (1,)
    buckets = buckets_up_to(48)
    assert [bucket_for(n, buckets) for n in (1, 3, 4, 5, 33, 48)] == [1, 4, 4, 8, 48, 48]


def test_the_cpu_records_no_graphs() -> None:
    cpu = torch.device("cpu")
    assert graphs_unavailable(cpu) == "cpu has no graph capture"
    assert isinstance(new_step_graph(cpu), EagerGraph)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):  # noqa: ANN201
    """A tiny Llama on the reference backend (fp32): the runner the graph tests drive."""
    path = tiny_llama_dir(tmp_path_factory.mktemp("tiny"), max_positions=64)
    return LLM(str(path), backend="reference", dtype="float32", num_blocks=64, block_size=BS)


def _runner(llm, graphs: bool, backend: str = "reference") -> ModelRunner:  # noqa: ANN001
    """A second runner over the same model (and a pool of its own), with or without graphs."""
    base = llm.engine.executor.runner
    loaded = LoadedModel(base.model, base.config, Path(llm.engine.config.model), base.dtype)
    cache = CacheConfig(block_size=BS, num_blocks=32)
    return ModelRunner(
        loaded, cache, base.device, backend=backend, max_num_seqs=8, decode_graphs=graphs
    )


@torch.inference_mode()
def _greedy_steps(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill every prompt in one step, then decode `steps` tokens each, one row a sequence;
    the second sequence stops after half of them (the batch shrinks to another bucket)."""
    tables = [list(range(8 * i, 8 * i + 8)) for i in range(len(prompts))]  # 32 tokens each
    new = [NewRequestData(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    seqs = [
        ScheduledSeq(f"r{i}", p, 0, t, True)
        for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
    ]
    out = runner.execute(SchedulerOutput(seqs, new))
    tokens = [[out.sampled[f"r{i}"]] for i in range(len(prompts))]
    for step in range(steps):
        live = [i for i in range(len(prompts)) if i != 1 or step < steps // 2]
        seqs = [
            ScheduledSeq(f"r{i}", [tokens[i][-1]], len(prompts[i]) + step, tables[i], True)
            for i in live
        ]
        out = runner.execute(SchedulerOutput(seqs))
        for i in live:
            tokens[i].append(out.sampled[f"r{i}"])
    return tokens


def test_runner_replays_graphs_for_decode_steps_and_samples_what_eager_samples(tiny) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 9, 14)]
    eager = _runner(tiny, graphs=False)
    graphed = _runner(tiny, graphs=True)
    assert eager.graphs is None and graphed.graphs is not None and graphed.step_program
    # One block more than the scheduler may hand out: the padding rows' own.
    assert graphed.num_blocks == eager.num_blocks == 32
    assert graphed.kv_caches[0][0].shape[0] == 33 and graphed.graphs.pad_block == 32
    want = _greedy_steps(eager, prompts, 12)
    got = _greedy_steps(graphed, prompts, 12)
    assert got == want
    # Every decode step replayed a graph (the prefill step did not); 3 rows → the batch bucket
    # of 4, then 2 rows → 2; contexts of 6-26 tokens → 2, 4 and 8 blocks of 4.
    assert graphed.graphs.replays == 12
    assert {b for b, _ in graphed.graphs.graphs} == {2, 4}
    assert {nb for _, nb in graphed.graphs.graphs} <= {2, 4, 8}
    # The padding rows wrote into the reserved block only: the blocks nobody was given are
    # still zero, in every layer.
    for k_cache, v_cache in graphed.kv_caches:
        for cache in (k_cache, v_cache):
            assert cache[24:32].abs().sum() == 0
            assert cache[32].abs().sum() > 0


@torch.inference_mode()
def test_padded_step_equals_the_unpadded_step_and_leaves_other_blocks_alone(tiny) -> None:  # noqa: ANN001
    """Hidden states of a 3-row step at the (4 rows, 8 blocks) bucket against the eager step,
    and the whole KV pool after each: equal except in the reserved block."""
    runner = tiny.engine.executor.runner
    model, caches = runner.model, runner.kv_caches
    pad = 63  # a block no sequence below uses
    graphs = DecodeGraphs(
        lambda ids, pos, meta: model(ids, pos, caches, meta), pad, BS, 4, 16, runner.device
    )
    g = torch.Generator().manual_seed(1)
    for c in caches:
        for t in c:
            t.copy_(torch.randn(t.shape, generator=g))  # stale data everywhere, as in a used pool
    before = [tuple(t.clone() for t in c) for c in caches]
    lengths = [6, 13, 22]  # 2, 4 and 6 blocks: the table is 6 wide → context bucket 8
    tables = [list(range(10 * i, 10 * i + 6)) for i in range(3)]
    seqs = [
        ScheduledSeq(f"s{i}", [int(torch.randint(3, 300, (1,), generator=g))], n - 1, t, False)
        for i, (n, t) in enumerate(zip(lengths, tables, strict=True))
    ]
    inp = build_model_input(seqs, BS, runner.device)
    assert graphs.takes(3, inp.meta)
    got = graphs.run(inp.input_ids, inp.positions, inp.meta).clone()
    assert list(graphs.graphs) == [(4, 8)]
    after_graph = [tuple(t.clone() for t in c) for c in caches]
    for c, b in zip(caches, before, strict=True):
        for t, tb in zip(c, b, strict=True):
            t.copy_(tb)
    want = model(inp.input_ids, inp.positions, caches, inp.meta)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # Outside the real rows' slots and the reserved block the pool is as it was, bit for bit;
    # those slots hold what the eager step wrote (to fp32 rounding: the padded batch's matmuls
    # may round differently).
    written = torch.zeros(caches[0][0].shape[0], BS, dtype=torch.bool)
    written[inp.meta.slot_blocks, inp.meta.slot_offsets] = True
    untouched = ~written
    untouched[pad] = False
    for c, ag, b in zip(caches, after_graph, before, strict=True):
        for t, tg, tb in zip(c, ag, b, strict=True):
            by_slot = (0, 2)  # [blocks, KV, BS, D] → the (block, offset) axes first
            tg_s, t_s, tb_s = (x.movedim(by_slot, (0, 1)) for x in (tg, t, tb))
            assert torch.equal(tg_s[untouched], tb_s[untouched])
            torch.testing.assert_close(tg_s[written], t_s[written], atol=1e-5, rtol=1e-5)
            assert not torch.equal(tg[pad], tb[pad])  # the padding rows wrote their own block
    # A step with prefill rows, or wider than the largest buckets, stays eager.
    wide = build_model_input(
        [ScheduledSeq(f"w{i}", [5], 0, [i], False) for i in range(5)], BS, runner.device
    )
    assert not graphs.takes(5, wide.meta)
    prefill = build_model_input([ScheduledSeq("p", [5, 6], 0, [0], False)], BS, runner.device)
    assert not graphs.takes(2, prefill.meta)


def test_models_whose_decode_reads_the_host_are_not_recorded(tiny, caplog) -> None:  # noqa: ANN001
    """The fused CPU attention (C++ ops), the routed experts (counts on the host) and the
    naive MLA decode are refused by name; the reference MHA is recorded."""
    from dsinfer.layers.attention.mla import MLAPagedAttention
    from dsinfer.layers.moe import RoutedExperts

    model = tiny.engine.executor.runner.model
    assert graph_unsafe(model) is None
    attn = model.model.layers[0].self_attn
    saved = attn.attn
    try:
        attn.attn = saved.rebuilt("fused", "cpu")
        assert graph_unsafe(model) == "FusedCpuPagedAttention cannot run inside a captured graph"
    finally:
        attn.attn = saved
    mla = MLAPagedAttention(2, 4, 4, 4, 8, 0.1)
    assert mla.graph_safe_decode
    mla.absorb_decode = False
    assert not mla.graph_safe_decode
    assert RoutedExperts.graph_safe is False
    # Asked for graphs, a runner over a model they cannot record says why and stays eager.
    try:
        with caplog.at_level(logging.INFO):
            runner = _runner(tiny, graphs=True, backend="fused")
        assert runner.graphs is None
        assert "decode steps run uncaptured: FusedCpuPagedAttention" in caplog.text
    finally:
        apply_backend(model, "reference", torch.device("cpu"))


class _OpTrace(TorchDispatchMode):
    """Every aten op a region runs, with the shapes of its tensor arguments, and every
    `Tensor.tolist()` (a read of the data into Python that bypasses the dispatcher)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((func._schema.name, shapes))
        return func(*args, **(kwargs or {}))

    def __enter__(self):  # noqa: ANN204
        tolist = torch.Tensor.tolist

        def traced(t: torch.Tensor):  # noqa: ANN202
            self.ops.append(("Tensor.tolist", (tuple(t.shape),)))
            return tolist(t)

        self._patch = mock.patch.object(torch.Tensor, "tolist", traced)
        self._patch.start()
        return super().__enter__()

    def __exit__(self, *exc):  # noqa: ANN002, ANN204
        self._patch.stop()
        return super().__exit__(*exc)

    @property
    def names(self) -> set[str]:
        return {name for name, _ in self.ops}


# What a CUDA graph cannot record: a device → host read (.item(), .tolist()), or an output
# whose size depends on the data (so on a read).
HOST_READS = {
    "aten::_local_scalar_dense",
    "Tensor.tolist",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique",
    "aten::bincount",
}


@pytest.fixture(scope="module")
def tiny_mla(tmp_path_factory):  # noqa: ANN201
    """A tiny DeepSeek-V2 whose layers are all dense: MLA (absorbed decode) without experts."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    extra = dict(DEEPSEEK_CASES["v2-lite-shape"][1], first_k_dense_replace=3)
    torch.manual_seed(3)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**{**DEEPSEEK_COMMON, **extra}))
    return save_and_load(model, tmp_path_factory.mktemp("mla"), "reference", block_size=BS)


@pytest.fixture(scope="module")
def tiny_moe_grouped(tmp_path_factory):  # noqa: ANN201
    """A tiny DeepSeek-V2 with routed experts (layers 1-2) switched to the grouped GEMM, as
    the fused backend does on a GPU whose grouped GEMM reads nothing back."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    from dsinfer.layers.moe import RoutedExperts

    torch.manual_seed(4)
    cfg = DeepseekV2Config(**{**DEEPSEEK_COMMON, **DEEPSEEK_CASES["v2-lite-shape"][1]})
    llm = save_and_load(
        DeepseekV2ForCausalLM(cfg), tmp_path_factory.mktemp("moe"), "reference", block_size=BS
    )
    model = llm.engine.executor.runner.model
    assert graph_unsafe(model) == "RoutedExperts reads data on the host"
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            module.use_grouped_mm(True)
    return llm


@pytest.mark.parametrize("which", ["tiny", "tiny_mla", "tiny_moe_grouped"])
@torch.inference_mode()
def test_a_bucket_replays_the_same_ops_on_any_batch_and_reads_nothing_back(which, request) -> None:  # noqa: ANN001
    """What makes a recorded graph valid, checked on the CPU (Llama's MHA, DeepSeek's MLA, and
    DeepSeek's routed experts through the grouped GEMM): two steps of one bucket with
    different rows, lengths, blocks (and experts) run the same ops on the same shapes, none of
    which reads data back to the host; the replayed rows equal the eager step's. The routed
    experts' loop does read back (which is why graph_unsafe refuses it): the trace sees it."""
    runner = request.getfixturevalue(which).engine.executor.runner
    model, caches = runner.model, runner.kv_caches
    assert graph_unsafe(model) is None
    graphs = DecodeGraphs(
        lambda ids, pos, meta: model(ids, pos, caches, meta), 63, BS, 4, 16, runner.device
    )
    steps = [
        ([6, 13, 22], [[0, 1], [10, 11, 12, 13], [20, 21, 22, 23, 24, 25]]),
        ([29, 2, 17], [[30, 31, 32, 33, 34, 35, 36, 37], [40], [41, 42, 43, 44, 45]]),
    ]
    traces = []
    for lengths, tables in steps:
        seqs = [
            ScheduledSeq(f"s{i}", [7 + i], n - 1, t, False)
            for i, (n, t) in enumerate(zip(lengths, tables, strict=True))
        ]
        inp = build_model_input(seqs, BS, runner.device)
        got = graphs.run(inp.input_ids, inp.positions, inp.meta).clone()  # captures the first
        with _OpTrace() as trace:  # the replay alone, on the buffers as this step loaded them
            graphs.graphs[(4, 8)].graph.replay()
        traces.append(trace.ops)
        want = model(inp.input_ids, inp.positions, caches, inp.meta)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert list(graphs.graphs) == [(4, 8)]
    # One fixed sequence of ops and shapes, whatever the step.
    assert traces[0] == traces[1]
    assert len(traces[0]) > 50
    names = {name for name, _ in traces[0]}
    assert not names & HOST_READS, names & HOST_READS


def test_the_trace_sees_the_routed_experts_read_back_and_the_grouped_gemm_not() -> None:
    """The loop over experts reads each expert's count on the host; the grouped path runs one
    fixed sequence of ops on fixed shapes whatever the routing, with nothing read back."""
    from dsinfer.layers.moe import MoEConfig, RoutedExperts

    experts = RoutedExperts(MoEConfig(hidden_size=8, intermediate_size=8, num_experts=4, top_k=2))
    for p in experts.parameters():
        p.data.normal_()
    x, weights = torch.randn(3, 8), torch.rand(3, 2)
    with torch.inference_mode(), _OpTrace() as trace:
        experts(x, weights, torch.tensor([[0, 1], [2, 3], [1, 2]]))
    assert {"aten::bincount", "Tensor.tolist"} <= trace.names
    experts.use_grouped_mm(True)
    traces = []
    for ids in ([[0, 1], [2, 3], [1, 2]], [[3, 3], [3, 0], [0, 3]]):
        with torch.inference_mode(), _OpTrace() as trace:
            experts(x, weights, torch.tensor(ids))
        traces.append(trace.ops)
    assert traces[0] == traces[1]
    names = {name for name, _ in traces[0]}
    assert "aten::_grouped_mm" in names and not names & HOST_READS, names & HOST_READS


def _fixture_of(which: str) -> str:
    """The fixture of a case: tiny_sdpa is the tiny Llama with CUDA's attention swapped in."""
    return "tiny" if which == "tiny_sdpa" else which


def _use_cuda_attention(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's MHA rebuilt as the fused CUDA backend's (SDPA, which runs on the CPU too),
    until the test ends."""
    from dsinfer.layers.attention.sdpa_paged import SdpaPagedAttention

    for layer in model.model.layers:
        monkeypatch.setattr(layer.self_attn, "attn", layer.self_attn.attn.rebuilt("fused", "cuda"))
        assert isinstance(layer.self_attn.attn, SdpaPagedAttention)


@pytest.mark.parametrize("which", ["tiny", "tiny_sdpa", "tiny_mla", "tiny_moe_grouped"])
@torch.inference_mode()
def test_what_a_recorded_graph_reads_outlives_its_capture(which, request, monkeypatch) -> None:  # noqa: ANN001
    """A recorded graph reads its inputs by address and holds no reference to them: a tensor
    made before the recording that only the captured function referred to (the mask's span of
    positions, once) is freed when capture returns, and on CUDA every replay then read memory
    the allocator had handed to the next step's tensors. Through device/graphs.py's recording
    code with a stand-in for torch.cuda: every such tensor is still alive after capture. The
    models: Llama with the reference MHA and with CUDA's (SDPA), DeepSeek's MLA, and its
    routed experts through the grouped GEMM."""
    record_graphs(monkeypatch, AddressGraph)
    runner = request.getfixturevalue(_fixture_of(which)).engine.executor.runner
    model, caches = runner.model, runner.kv_caches
    if which == "tiny_sdpa":
        _use_cuda_attention(model, monkeypatch)
    graphs = DecodeGraphs(
        lambda ids, pos, meta: model(ids, pos, caches, meta), 63, BS, 4, 16, runner.device
    )
    seqs = [ScheduledSeq(f"s{i}", [7 + i], n - 1, [i, 10 + i], False) for i, n in enumerate((5, 7))]
    inp = build_model_input(seqs, BS, runner.device)
    graphs.run(inp.input_ids, inp.positions, inp.meta)  # captures the (2 rows, 2 blocks) graph
    gc.collect()
    recorded = graphs.graphs[(2, 2)].graph._graph
    assert len(recorded.reads) > 10  # the static buffers, the weights, the KV pool, ...
    assert recorded.freed() == 0, f"{recorded.freed()} tensors the graph reads were freed"
    # Keeping the captured function makes no reference cycle: the graphs go with their owner
    # (and with them the model and pool they hold), without waiting for a gc pass.
    gone = weakref.ref(graphs)
    gc.disable()
    try:
        del graphs, recorded
        assert gone() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("which", ["tiny", "tiny_sdpa", "tiny_mla", "tiny_moe_grouped"])
def test_frozen_replays_sample_what_eager_steps_sample(which, request, monkeypatch) -> None:  # noqa: ANN001
    """The runner with graphs that replay as a CUDA graph does (recorded kernels on recorded
    tensors, no Python run again: ReplayingGraph) samples, step for step, what the eager
    runner samples, over a batch that shrinks from the 4-row bucket to the 2-row one and
    contexts that cross context buckets. Llama with the reference and the SDPA attention,
    DeepSeek's MLA, and its routed experts through the grouped GEMM."""
    from dsinfer.layers.moe import RoutedExperts

    record_graphs(monkeypatch, ReplayingGraph)
    if which == "tiny_moe_grouped":  # as on a GPU whose grouped GEMM reads nothing back:
        grouped = RoutedExperts.use_grouped_mm  # every runner's backend keeps the grouped path
        monkeypatch.setattr(RoutedExperts, "use_grouped_mm", lambda self, on: grouped(self, True))
    llm = request.getfixturevalue(_fixture_of(which))
    eager, graphed = _runner(llm, graphs=False), _runner(llm, graphs=True)
    if which == "tiny_sdpa":  # after the runners: each applies the reference backend again
        _use_cuda_attention(graphed.model, monkeypatch)  # the model both runners share
    assert graphed.graphs is not None
    g = torch.Generator().manual_seed(0)
    vocab = graphed.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 14)]
    want = _greedy_steps(eager, prompts, 12)
    got = _greedy_steps(graphed, prompts, 12)
    assert graphed.graphs.replays == 12
    assert len(graphed.graphs.graphs) >= 2  # more than one bucket recorded and replayed
    assert got == want
