"""The TP × PP × EP grid (gloo on CPU): DeepSeek-V3 with MLA heads split, experts sliced or
placed, pipeline stages; Llama with tensor and pipeline parallel together and a split (tied)
vocabulary; two "nodes" on one machine joined by the rendezvous flags. Greedy tokens must equal
the single process, with a pool small enough to force preemption."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from dsinfer.config import CacheConfig, EngineConfig, SchedulerConfig
from dsinfer.distributed.parallel_state import ParallelState, check_grid
from dsinfer.engine.llm_engine import LLMEngine
from dsinfer.sampling import SamplingParams
from tests.helpers import generate_argv, tiny_llama_dir
from tests.helpers import parallel_generate as _generate


@pytest.fixture(scope="module")
def v3_reference(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint (MLA with q_lora, 8 experts in groups, a shared expert,
    one dense layer) and the single process's greedy tokens."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from tests.helpers import DEEPSEEK_CASES as CASES
    from tests.helpers import DEEPSEEK_COMMON as COMMON
    from tests.helpers import write_tiny_tokenizer as _tokenizer_files

    path = tmp_path_factory.mktemp("v3")
    torch.manual_seed(21)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**COMMON, **CASES["v3"][1]))
    g = torch.Generator().manual_seed(22)
    with torch.no_grad():  # a router that spreads tokens over every rank's experts
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=g)
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3, generator=g)
    model.save_pretrained(path)
    _tokenizer_files(path)
    config = EngineConfig(
        model=str(path),
        dtype="float32",
        cache=CacheConfig(block_size=4, num_blocks=14),  # ~100 tokens in 56 slots: preempts
        scheduler=SchedulerConfig(max_num_seqs=4),
    )
    single = LLMEngine(config)
    ref = _generate(single)
    single.shutdown()
    return config, ref


@pytest.mark.slow  # multi-process: make test-slow
@pytest.mark.parametrize(
    ("tp", "pp", "ep"),
    [(2, 1, 1), (1, 2, 1), (2, 1, 2)],
    ids=["tp2-mla-heads-experts-sliced", "pp2", "tp2-ep2"],
)
def test_deepseek_v3_parallel_greedy_equals_single_process(v3_reference, tp, pp, ep):
    config, ref = v3_reference
    engine = LLMEngine(
        dataclasses.replace(config, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
    )
    try:
        assert _generate(engine) == ref
        assert engine.scheduler.num_preemptions > 0
        model = engine.executor.runner.model
        layers = model.model.layers
        if tp == 2:
            attn = layers[0].self_attn
            assert attn.h == 2  # 2 of the 4 MLA heads on rank 0, their rows of kv_b only
            assert attn.kv_b_proj.weight.shape[0] == 2 * (attn.nope + attn.v)
            assert model.model.embed_tokens.weight.shape[0] == 320 // 2  # vocabulary split
            experts = layers[1].mlp.experts
            if ep == 2:  # 4 whole experts of 8
                assert experts.w13.shape[:2] == (4, 2 * 24)
            else:  # all 8 experts, half of each one's intermediate rows
                assert experts.w13.shape[:2] == (8, 24)
        if pp == 2:  # stage 0 owns layers 0-1: layer 2's weights and latent cache are elsewhere
            assert type(layers[2]).__name__ == "Identity"
            assert engine.executor.runner.kv_caches[2][0].numel() == 0
    finally:
        engine.shutdown()


def _tiny_config(src, num_blocks: int) -> EngineConfig:  # noqa: ANN001
    return EngineConfig(
        model=str(src),
        dtype="float32",
        cache=CacheConfig(block_size=4, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=4),
    )


@pytest.mark.slow  # multi-process: make test-slow
def test_llama_tp2_pp2_with_tied_split_vocabulary_equals_single_process(tmp_path):
    torch.manual_seed(23)
    config = _tiny_config(tiny_llama_dir(tmp_path / "tiny", num_layers=3, tied=True), 14)
    ref = _generate(LLMEngine(config), n=12)
    engine = LLMEngine(dataclasses.replace(config, tensor_parallel=2, pipeline_parallel=2))
    try:
        assert _generate(engine, n=12) == ref
        model = engine.executor.runner.model
        # Rank 0 = stage 0, TP rank 0: half the vocabulary, tied head = the same tensor.
        assert model.model.embed_tokens.weight.shape == (160, 32)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert len(engine.executor.procs) == 3
    finally:
        engine.shutdown()


def test_grid_layout_and_refusals():
    # rank = stage · width + local; TP and EP span a stage's ranks.
    s = ParallelState.of_rank(3, tp=2, pp=2, ep=2)
    assert (s.pp_rank, s.tp_rank, s.ep_rank, s.world) == (1, 1, 1, 4)
    assert s.global_rank(0) == 1 and s.expert_slices == 1
    assert ParallelState.of_rank(1, tp=2, pp=1, ep=1).expert_slices == 2
    assert check_grid(1, 3, 4) == 12
    with pytest.raises(ValueError, match="ep=1, ep=2"):
        check_grid(2, 1, 4)


def test_cli_refuses_unsplittable_grids_and_uneven_nodes(tmp_path, capsys):
    from dsinfer.cli import main

    src = str(tiny_llama_dir(tmp_path / "tiny"))
    argv = ["generate", "--model", src, "--prompt", "w5", "--max-tokens", "2"]
    assert main([*argv, "--parallel", "tp=2,ep=4"]) == 2
    assert "expert parallel spans" in capsys.readouterr().err
    assert main([*argv, "--parallel", "tp=2", "--nnodes", "3", "--node-rank", "1"]) == 2
    assert "spread evenly" in capsys.readouterr().err
    assert main([*argv, "--parallel", "tp=2", "--nnodes", "2", "--node-rank", "1"]) == 2
    assert "--master-port" in capsys.readouterr().err
    assert main([*argv, "--parallel", "auto", "--nnodes", "2", "--master-port", "1"]) == 2
    assert "same grid" in capsys.readouterr().err


@pytest.mark.slow  # multi-process: make test-slow
def test_two_nodes_over_the_rendezvous_flags_match_one_process(tmp_path, capsys):
    """Node 1 is a second `dsinfer generate` process started with --node-rank 1; node 0 serves
    the request. Both on 127.0.0.1: the same code path as two machines."""
    from dsinfer.cli import main
    from dsinfer.distributed.parallel_state import free_local_port

    torch.manual_seed(24)
    argv = generate_argv(str(tiny_llama_dir(tmp_path / "tiny")))
    assert main(argv) == 0
    single = capsys.readouterr().out
    port = str(free_local_port())
    nodes = ["--parallel", "tp=2,pp=2", "--nnodes", "2", "--master-port", port]
    node1 = subprocess.Popen(
        [sys.executable, "-c", "import sys; from dsinfer.cli import main; sys.exit(main())"]
        + [*argv, *nodes, "--node-rank", "1", "--master-addr", "127.0.0.1"],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert main([*argv, *nodes, "--node-rank", "0"]) == 0
        assert capsys.readouterr().out == single
        assert node1.wait(timeout=60) == 0  # node 1's ranks left cleanly on shutdown
    finally:
        node1.kill()


@pytest.mark.slow  # multi-process: make test-slow
def test_llama_pp3_middle_stage_equals_single_process(tmp_path):
    """Three stages: the middle one receives, runs its layer and passes on (no reply)."""
    torch.manual_seed(25)
    config = _tiny_config(tiny_llama_dir(tmp_path / "tiny", num_layers=3), 32)
    ref = _generate(LLMEngine(config), n=8)
    engine = LLMEngine(dataclasses.replace(config, pipeline_parallel=3))
    try:
        assert _generate(engine, n=8) == ref
        assert engine.executor.runner.model.lm_head is not None  # the head lives on stage 0
    finally:
        engine.shutdown()


@pytest.mark.slow  # multi-process: make test-slow
@pytest.mark.parametrize(("tp", "pp", "ep"), [(2, 1, 1), (1, 2, 1), (2, 1, 2)])
def test_mtp_speculation_under_a_grid_drafts_and_accepts_like_one_process(mtp_dir, tp, pp, ep):
    """V3's MTP layer split like the model (first stage): same tokens, and the same drafts
    accepted, as one process with MTP."""
    from dsinfer import LLM
    from tests.helpers import MTP_GREEDY as GREEDY
    from tests.helpers import MTP_PROMPTS as PROMPTS

    path = str(mtp_dir[0])
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    single = LLM(path, dtype="float32", num_blocks=96, block_size=4)
    ref_drafts = _record_drafts(single)
    ref = single.generate(prompts, GREEDY)
    grid = LLM(
        path,
        dtype="float32",
        num_blocks=96,
        block_size=4,
        tensor_parallel=tp,
        pipeline_parallel=pp,
        expert_parallel=ep,
    )
    try:
        drafts = _record_drafts(grid)
        got = grid.generate(prompts, GREEDY)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
        # Every step's drafts, proposed by the split MTP layer, equal the one-process ones.
        assert len(drafts) > 20 and drafts == ref_drafts
        counts = [(o.metrics.num_draft_tokens, o.metrics.num_accepted_draft_tokens) for o in got]
        assert counts == [
            (o.metrics.num_draft_tokens, o.metrics.num_accepted_draft_tokens) for o in ref
        ]
    finally:
        grid.engine.shutdown()


def _record_drafts(llm) -> list[dict]:  # noqa: ANN001
    """The drafts rank 0's MTP drafter proposes, step by step (request ids made positional)."""
    drafter = llm.engine.executor.runner.drafter
    assert drafter is not None
    steps: list[dict] = []
    propose = drafter.propose

    def recording(inp, hidden, result, wants, driver=True):  # noqa: ANN001, ANN202
        propose(inp, hidden, result, wants, driver)
        order = {s.req_id: i for i, s in enumerate(inp.seqs)}
        steps.append({order[r]: d for r, d in result.drafts.items()})

    drafter.propose = recording
    return steps


@pytest.mark.slow  # multi-process: make test-slow
def test_a_second_parallel_engine_in_one_process_is_refused(tmp_path):
    config = _tiny_config(tiny_llama_dir(tmp_path / "tiny"), 16)
    first = LLMEngine(dataclasses.replace(config, tensor_parallel=2))
    try:
        with pytest.raises(ValueError, match="one parallel model"):
            LLMEngine(dataclasses.replace(config, pipeline_parallel=2))
        first.add_request([1, 5, 9], SamplingParams(max_tokens=3))
        while first.has_unfinished_requests():  # the first engine is untouched
            first.step()
    finally:
        first.shutdown()
