"""Two engines of one process stepping at once (two models, a canary's two versions) share the
cores: each steps on half of them while both are busy, alone on all of them, and each samples
what it samples alone (device/host_threads.CoreShare; measured in benchmarks/two_engines.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from dsinfer import LLM, SamplingParams
from dsinfer.device import host_threads
from dsinfer.device.host_threads import CoreShare
from tests.helpers import assert_pool_clean, random_prompts, tiny_llama_dir


@pytest.fixture
def share(monkeypatch: pytest.MonkeyPatch) -> CoreShare:
    """A share of 6 cores for the engines built in the test (whatever this machine has: the
    counts are what is checked, not speed; none of them this machine's own); a long linger, so that the two engines' steps count
    as overlapping however the threads are scheduled."""
    s = CoreShare(6, linger_s=30)
    monkeypatch.setattr(host_threads, "_SHARE", s)
    return s


def _spy_threads(llm: LLM) -> list[int]:
    """The intra-op threads of each step that ran rows, in order."""
    seen: list[int] = []
    runner = llm.engine.executor.runner
    execute = runner.execute

    def spy(out):  # noqa: ANN001, ANN202
        if out.seqs:
            seen.append(torch.get_num_threads())
        return execute(out)

    runner.execute = spy
    return seen


def test_two_busy_engines_step_on_half_the_cores_each(tmp_path, share: CoreShare) -> None:
    path = tiny_llama_dir(tmp_path)
    a, b = (
        LLM(str(path), backend="fused", dtype="float32", num_blocks=64, block_size=4)
        for _ in range(2)
    )
    prompts = [{"prompt_token_ids": p} for p in random_prompts((5, 9, 3, 12))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone_a = _spy_threads(a)
    want = [o.outputs[0].token_ids for o in a.generate(prompts, params)]
    assert alone_a and set(alone_a) == {6}  # alone: every core
    alone_a.clear()
    b_steps = _spy_threads(b)
    got: dict[str, list] = {}
    started = threading.Barrier(2)

    def generate(name: str, llm: LLM) -> None:
        started.wait()
        got[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]

    threads = [threading.Thread(target=generate, args=x) for x in (("a", a), ("b", b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {"a": want, "b": want}
    # The first step of whichever started first may have seen it alone; every later step of
    # both saw the other busy.
    assert set(alone_a[1:]) == {3} and set(b_steps[1:]) == {3}, (alone_a, b_steps)
    share.linger_s = 0  # b idle from now: a alone gets every core back
    alone_a.clear()
    a.generate(prompts[:1], params)
    assert set(alone_a) == {6}
    for llm in (a, b):
        assert_pool_clean(llm.engine)


def test_an_engine_loads_on_every_core_whatever_its_thread_started_with(
    tmp_path, share: CoreShare, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new thread starts with the intra-op count last set anywhere, which may be a busy
    engine's share: loading (and the step program's thread tuning, which times every count up
    to the thread's) runs on every core all the same."""
    from dsinfer.worker import executor

    path = tiny_llama_dir(tmp_path)
    seen: list[int] = []
    for_engine = executor.ModelRunner.for_engine

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(torch.get_num_threads())
        return for_engine(*args, **kwargs)

    monkeypatch.setattr(executor.ModelRunner, "for_engine", spy)

    def build() -> None:
        torch.set_num_threads(1)  # as if started during another engine's shared step
        LLM(str(path), backend="fused", dtype="float32", num_blocks=16, block_size=4)
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    t = threading.Thread(target=build)
    t.start()
    t.join()
    torch.set_num_threads(before)
    assert seen == [6, 1]  # every core while loading; the thread's own count after
