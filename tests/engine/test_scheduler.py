"""Scheduler on CPU with fake runner outputs: budgets, chunking, preemption, finish rules."""

from __future__ import annotations

from dsinfer.config import SchedulerConfig
from dsinfer.engine.block_pool import BlockPool
from dsinfer.engine.kv_cache_manager import KVCacheManager
from dsinfer.engine.request import Request, RequestStatus
from dsinfer.engine.scheduler import Scheduler
from dsinfer.sampling import SamplingParams
from dsinfer.worker.step_io import ModelRunnerOutput, SchedulerOutput


def _sched(num_blocks=16, block_size=4, max_seqs=8, budget=64) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks), block_size)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget), kv)


def _fake_run(out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled={s.req_id: token for s in out.seqs if s.do_sample})


def _req(rid, n, max_tokens=3, **kw) -> Request:
    return Request(
        rid,
        list(range(10, 10 + n)),
        SamplingParams(max_tokens=max_tokens, **kw),
        eos_token_ids=frozenset({2}),
    )


def test_chunked_prefill_respects_budget_then_decodes():
    s = _sched(budget=5)
    s.add_request(_req("a", 12))
    out = s.schedule()
    assert [(q.req_id, len(q.token_ids), q.start_pos, q.do_sample) for q in out.seqs] == [
        ("a", 5, 0, False)
    ]
    assert out.seqs[0].block_table == [0, 1]
    assert out.new_requests[0].req_id == "a"
    s.update(out, _fake_run(out))
    out = s.schedule()
    assert (len(out.seqs[0].token_ids), out.seqs[0].start_pos) == (5, 5)
    assert out.new_requests == []
    s.update(out, _fake_run(out))
    out = s.schedule()
    assert (len(out.seqs[0].token_ids), out.seqs[0].do_sample) == (2, True)
    ups = s.update(out, _fake_run(out))
    assert ups[0].new_token_ids == [7]
    out = s.schedule()
    assert out.seqs[0].token_ids == [7] and out.seqs[0].start_pos == 12


def test_new_requests_join_running_batch_and_max_num_seqs():
    s = _sched(max_seqs=2)
    s.add_request(_req("a", 3))
    out = s.schedule()
    s.update(out, _fake_run(out))
    s.add_request(_req("b", 3))
    s.add_request(_req("c", 3))
    out = s.schedule()
    assert [q.req_id for q in out.seqs] == ["a", "b"]
    assert [len(q.token_ids) for q in out.seqs] == [1, 3]


def test_length_and_eos_and_stop_token_finish_and_free():
    s = _sched()
    s.add_request(_req("len", 3, max_tokens=2))
    s.add_request(_req("eos", 3, max_tokens=5))
    s.add_request(_req("stop", 3, max_tokens=5, stop_token_ids=[9]))
    out = s.schedule()
    ups = s.update(out, ModelRunnerOutput(sampled={"len": 5, "eos": 2, "stop": 9}))
    fin = {u.req.request_id: u.req.status for u in ups if u.finished}
    assert fin == {"eos": RequestStatus.FINISHED_STOPPED, "stop": RequestStatus.FINISHED_STOPPED}
    out = s.schedule()
    assert sorted(out.finished_req_ids) == ["eos", "stop"]
    ups = s.update(out, ModelRunnerOutput(sampled={"len": 5}))
    assert ups[0].finished and ups[0].req.status == RequestStatus.FINISHED_LENGTH
    assert not s.has_unfinished
    s.kv.pool.check_integrity()
    assert s.kv.pool.num_used == 0


def test_ignore_eos_and_min_tokens():
    s = _sched()
    s.add_request(_req("a", 3, max_tokens=3, ignore_eos=True))
    s.add_request(_req("b", 3, max_tokens=3, min_tokens=2))
    for _ in range(2):
        out = s.schedule()
        ups = s.update(out, _fake_run(out, token=2))
    assert {u.req.request_id for u in ups if u.finished} == {"b"}
    out = s.schedule()
    ups = s.update(out, _fake_run(out, token=2))
    assert ups[0].req.status == RequestStatus.FINISHED_LENGTH


def test_preemption_when_pool_runs_out_then_recompute():
    s = _sched(num_blocks=3, block_size=2, budget=64)
    s.add_request(_req("a", 2, max_tokens=4))
    s.add_request(_req("b", 2, max_tokens=4))
    out = s.schedule()
    assert [q.block_table for q in out.seqs] == [[0], [1]]
    s.update(out, _fake_run(out))
    out = s.schedule()  # a needs block 2; b then needs one more: b is preempted
    assert [q.req_id for q in out.seqs] == ["a"]
    assert s.num_preemptions == 1
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7]
    for _ in range(10):
        if not s.has_unfinished:
            break
        out = s.schedule()
        s.update(out, _fake_run(out))
    assert not s.has_unfinished
    # b resumed by recomputing prompt + its first token in one chunk.
    s.kv.pool.check_integrity()
    assert s.kv.pool.num_used == 0


def test_abort_frees_blocks_and_tells_runner():
    s = _sched()
    s.add_request(_req("a", 5))
    out = s.schedule()
    s.update(out, _fake_run(out))
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_used == 0
    assert s.schedule().finished_req_ids == ["a"]


def _decoding(s: Scheduler, rid: str, prompt: int, max_tokens: int, drafts: list[int]) -> Request:
    """A greedy request through its prefill, holding `drafts` for its next decode step."""
    req = _req(rid, prompt, max_tokens=max_tokens, temperature=0)
    s.add_request(req)
    out = s.schedule()
    s.update(out, ModelRunnerOutput(sampled={rid: 7}, drafts={rid: drafts}))
    return req


def test_drafts_are_cut_to_what_the_request_may_still_emit():
    s = _sched()
    _decoding(s, "a", 3, max_tokens=3, drafts=[1, 2, 3, 4])
    out = s.schedule()
    # One token out, two to go: the sampled one and one accepted draft's follower.
    assert out.seqs[0].num_draft == 1 and out.seqs[0].token_ids == [7, 1]


def test_drafts_never_preempt_another_request():
    s = _sched(num_blocks=4, block_size=4)
    a = _req("a", 4, max_tokens=8, temperature=0)
    b = _req("b", 4, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()  # both prompts: blocks 0 and 1
    s.update(out, ModelRunnerOutput(sampled={"a": 7, "b": 7}, drafts={"a": [1, 2, 3, 4, 5]}))
    out = s.schedule()
    # Each decode needs one more block (2 free). a's five drafts would need a second one,
    # which b's decode needs: the drafts wait, b runs.
    by_id = {q.req_id: q for q in out.seqs}
    assert by_id["a"].num_draft == 0 and by_id["a"].token_ids == [7]
    assert by_id["b"].token_ids == [7] and s.num_preemptions == 0
    s.update(out, ModelRunnerOutput(sampled={"a": 8, "b": 8}, drafts={"a": [1, 2]}))
    out = s.schedule()  # room now (positions 5-7 in a's second block): the drafts go in
    assert {q.req_id: q.num_draft for q in out.seqs} == {"a": 2, "b": 0}
