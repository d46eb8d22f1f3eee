"""Tensor, pipeline and expert parallel over two processes (gloo): greedy tokens equal the single
process, for a batch of different-length prompts, with a pool small enough to force preemption."""

from __future__ import annotations

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.config import CacheConfig, EngineConfig, SchedulerConfig
from dsinfer.engine.llm_engine import LLMEngine
from tests.helpers import generate_argv, tiny_llama_dir
from tests.helpers import parallel_generate as _generate


def test_tp2_greedy_equals_single_process_with_preemption(tmp_path):
    torch.manual_seed(11)
    src = tiny_llama_dir(tmp_path / "tiny")
    cache = CacheConfig(block_size=4, num_blocks=14)  # 56 slots for ~100 tokens: preempts
    config = EngineConfig(
        model=str(src), dtype="float32", cache=cache, scheduler=SchedulerConfig(max_num_seqs=4)
    )
    single = LLMEngine(config)
    ref = _generate(single)
    tp = LLMEngine(_with_tp(config, 2))
    try:
        got = _generate(tp)
        assert got == ref
        assert tp.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
        runner = tp.executor.runner
        # Rank 0 holds half of the heads and half of the MLP: its own shard only.
        attn = runner.model.model.layers[0].self_attn
        assert (attn.h, attn.kv) == (2, 1)
        assert runner.kv_caches[0][0].shape[1] == 1  # one of the two KV heads per rank
    finally:
        tp.shutdown()


def _small_pool(path) -> EngineConfig:  # noqa: ANN001
    """fp32, 14 blocks of 4 tokens for ~100 tokens of 4 sequences: preempts."""
    cache = CacheConfig(block_size=4, num_blocks=14)
    return EngineConfig(
        model=str(path), dtype="float32", cache=cache, scheduler=SchedulerConfig(max_num_seqs=4)
    )


def _with_tp(config: EngineConfig, n: int) -> EngineConfig:
    import dataclasses

    return dataclasses.replace(config, tensor_parallel=n)


@pytest.mark.slow  # spawns a grid to see it refused: make test-slow
def test_tp_refuses_shapes_that_do_not_split(tmp_path):
    src = tiny_llama_dir(tmp_path / "tiny")
    with pytest.raises(Exception, match="split"):
        LLM(str(src), num_blocks=8, block_size=4, tensor_parallel=3)


@pytest.mark.slow  # multi-process: make test-slow
def test_cli_generate_with_tp2_matches_single(tmp_path, capsys):
    from dsinfer.cli import main

    torch.manual_seed(12)
    argv = generate_argv(str(tiny_llama_dir(tmp_path / "tiny")))
    assert main(argv) == 0
    single = capsys.readouterr().out
    assert main([*argv, "--parallel", "tp=2"]) == 0
    assert capsys.readouterr().out == single
    assert main([*argv, "--parallel", "pp=2"]) == 0
    assert capsys.readouterr().out == single
    assert main([*argv, "--parallel", "ep=2"]) == 2  # a dense model has no experts to place
    assert "mixture-of-experts" in capsys.readouterr().err


def test_dead_worker_fails_the_step_instead_of_hanging(tmp_path):
    torch.manual_seed(13)
    src = tiny_llama_dir(tmp_path / "tiny")
    config = EngineConfig(
        model=str(src),
        dtype="float32",
        cache=CacheConfig(block_size=4, num_blocks=16),
        tensor_parallel=2,
    )
    engine = LLMEngine(config)
    try:
        engine.executor.procs[0].kill()
        engine.executor.procs[0].join()
        engine.add_request([1, 5, 9], SamplingParams(max_tokens=4))
        with pytest.raises(RuntimeError, match="died"):
            engine.step()
    finally:
        from dsinfer.distributed.parallel_state import destroy_parallel

        destroy_parallel()


@pytest.mark.slow  # multi-process: make test-slow
def test_a_dead_tp_worker_fails_in_flight_requests_then_the_engine_restarts(tmp_path):
    """A killed rank: the stream in flight ends with a 503 event (engine_restarted), the engine
    rebuilds its workers, and the same server answers again — no process restart."""
    import json
    import time

    import httpx

    from dsinfer.server.api import ServerSettings, build_app
    from dsinfer.server.async_engine import AsyncEngine
    from dsinfer.server.serving import ServedModel
    from tests.server.conftest import running_server, wait_healthy

    src = tiny_llama_dir(tmp_path / "tiny", num_layers=1)
    config = EngineConfig(
        model=str(src), cache=CacheConfig(block_size=4, num_blocks=32), tensor_parallel=2
    )
    builds: list[LLMEngine] = []

    def factory() -> LLMEngine:
        engine = LLMEngine(config)
        if not builds:  # slow steps, so the kill lands while the stream is running
            step = engine.step
            engine.step = lambda: (time.sleep(0.05), step())[1]  # type: ignore[method-assign]
        builds.append(engine)
        return engine

    runner = AsyncEngine(factory)
    served = ServedModel("tiny", runner, runner.engine.tokenizer, runner.engine.max_model_len)
    try:
        with running_server(build_app({"tiny": served}, ServerSettings())) as url:
            body = {"prompt": "w5 w6", "max_tokens": 40, "ignore_eos": True, "stream": True}
            events = []
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    events.append(json.loads(line[6:]))
                    if len(events) == 2:
                        worker = builds[0].executor.procs[0]
                        worker.kill()
                        worker.join()
            errors = [e["error"] for e in events if "error" in e]
            assert errors and errors[0]["code"] == "engine_restarted", events[-2:]
            assert "died" in errors[0]["message"]
            wait_healthy(url, [], seconds=60)  # the engine came back
            assert httpx.get(f"{url}/health").json()["engines"]["tiny"]["restarts"] == 1
            r = httpx.post(
                f"{url}/v1/completions", json={"prompt": "w5", "max_tokens": 4}, timeout=60
            )
            assert r.status_code == 200 and len(r.json()["choices"][0]["text"].split()) == 4
            assert len(builds) == 2 and builds[1].executor.procs[0].is_alive()
    finally:
        runner.shutdown()
        from dsinfer.distributed.parallel_state import destroy_parallel

        destroy_parallel()


@pytest.mark.slow  # multi-process: make test-slow
def test_pp2_greedy_equals_single_process_with_preemption(tmp_path):
    import dataclasses

    torch.manual_seed(14)
    src = tiny_llama_dir(tmp_path / "tiny", num_layers=3)  # uneven: stages own 2 and 1 layers
    cache = CacheConfig(block_size=4, num_blocks=14)
    config = EngineConfig(
        model=str(src), dtype="float32", cache=cache, scheduler=SchedulerConfig(max_num_seqs=4)
    )
    ref = _generate(LLMEngine(config))
    pp = LLMEngine(dataclasses.replace(config, pipeline_parallel=2))
    try:
        assert _generate(pp) == ref
        assert pp.scheduler.num_preemptions > 0
        layers = pp.executor.runner.model.model.layers
        assert [type(m).__name__ for m in layers] == ["LlamaDecoderLayer"] * 2 + ["Identity"]
        caches = pp.executor.runner.kv_caches
        assert caches[2][0].numel() == 0 and caches[0][0].numel() > 0  # no KV for stage 1's layer
    finally:
        pp.shutdown()


def test_ep2_deepseek_v3_greedy_equals_single_process_with_preemption(tmp_path):
    import dataclasses

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from tests.helpers import DEEPSEEK_CASES as CASES
    from tests.helpers import DEEPSEEK_COMMON as COMMON
    from tests.helpers import write_tiny_tokenizer as _tokenizer_files

    torch.manual_seed(15)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**COMMON, **CASES["v3"][1]))
    g = torch.Generator().manual_seed(16)
    with torch.no_grad():  # a router that spreads tokens over both ranks' experts
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5, generator=g)
    model.save_pretrained(tmp_path / "v3")
    _tokenizer_files(tmp_path / "v3")
    config = _small_pool(tmp_path / "v3")
    ref = _generate(LLMEngine(config))
    ep = LLMEngine(dataclasses.replace(config, expert_parallel=2))
    try:
        assert _generate(ep) == ref
        assert ep.scheduler.num_preemptions > 0
        experts = ep.executor.runner.model.model.layers[1].mlp.experts
        assert experts.w13.shape[0] == 4 and experts.first == 0  # 4 of the 8 experts on rank 0
    finally:
        ep.shutdown()


@pytest.mark.slow  # multi-process: make test-slow
def test_parallel_auto_plans_for_this_machine_and_runs(tmp_path, capsys, caplog):
    import logging

    from dsinfer.cli import main
    from dsinfer.models.loader import read_model_config
    from dsinfer.planner.auto import runnable_plans
    from dsinfer.planner.cost_model import Plan
    from dsinfer.planner.model_shape import model_shape

    torch.manual_seed(17)
    src = tiny_llama_dir(tmp_path / "tiny")
    shape = model_shape(read_model_config(src))
    assert set(runnable_plans(shape, 2)) == {Plan(1, 1, 1), Plan(2, 1, 1), Plan(1, 2, 1)}
    argv = ["generate", "--model", str(src), "--prompt", "w5 w9", "--max-tokens", "4"]
    argv += ["--dtype", "float32", "--num-kv-blocks", "16", "--block-size", "4"]
    assert main(argv) == 0
    single = capsys.readouterr().out
    with caplog.at_level(logging.INFO, logger="dsinfer.planner.auto"):
        assert main([*argv, "--parallel", "auto"]) == 0
    assert "--parallel auto:" in caplog.text  # the chosen plan and every prediction, logged
    assert capsys.readouterr().out == single


@pytest.mark.slow  # multi-process: make test-slow
def test_tp2_deepseek_v32_greedy_equals_single_process_with_preemption(tmp_path):
    """DeepSeek-V3.2 under tensor parallel: each rank attends with half the heads, and every
    rank's replicated indexer selects the same tokens (its keys cached whole on each rank)."""
    from tests.helpers import tiny_deepseek_v32, write_tiny_tokenizer

    tiny_deepseek_v32().save_pretrained(tmp_path / "v32")
    write_tiny_tokenizer(tmp_path / "v32")
    config = _small_pool(tmp_path / "v32")
    ref = _generate(LLMEngine(config))
    tp = LLMEngine(_with_tp(config, 2))
    try:
        assert _generate(tp) == ref
        assert tp.scheduler.num_preemptions > 0
        attn = tp.executor.runner.model.model.layers[1].self_attn
        assert attn.h == 2 and attn.indexer.heads == 16  # heads split, the indexer whole
        assert len(tp.executor.runner.kv_caches[1]) == 2  # (latent, index keys)
    finally:
        tp.shutdown()
