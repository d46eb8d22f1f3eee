"""The host's cores split between the engines of one process that are stepping
(device/host_threads.CoreShare): alone an engine steps on every core, two busy engines on half
each. Each way's tokens and the engine-level behaviour: tests/engine/test_two_engines.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dsinfer.device.host_threads import CoreShare, intra_op_threads


@pytest.fixture(autouse=True)
def _keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_alone_every_core_beside_another_engine_half() -> None:
    share = CoreShare(4, linger_s=60)
    a, b = object(), object()
    with share.step(a) as n:
        assert n == 4 and torch.get_num_threads() == 4
        with share.step(b) as m:  # b starts while a is mid-step
            assert m == 2 and torch.get_num_threads() == 2
        assert torch.get_num_threads() == 4  # a's step keeps what it started with
    # Between their steps both still count as busy (the linger): a's next step takes half.
    with share.step(a) as n:
        assert n == 2
    assert share.busy() == 2


def _two_busy(cores: int, linger_s: float) -> tuple[CoreShare, object, object]:
    """A share whose two engines have each just stepped (both busy within the linger)."""
    share = CoreShare(cores, linger_s=linger_s)
    a, b = object(), object()
    with share.step(a), share.step(b):
        pass
    return share, a, b


def test_an_engine_idle_past_the_linger_gives_its_cores_back() -> None:
    share, a, _ = _two_busy(4, linger_s=60)
    assert share.threads() == 2
    share.linger_s = 0.05  # set only now: a stalled CI machine must not end the linger early
    time.sleep(0.1)
    assert share.busy() == 0
    with share.step(a) as n:
        assert n == 4


def test_more_engines_than_cores_take_one_thread_each() -> None:
    share = CoreShare(2, linger_s=60)
    engines = [object() for _ in range(3)]
    for e in engines:
        with share.step(e):
            pass
    with share.step(engines[0]) as n:
        assert n == 1


def test_a_step_puts_the_thread_count_back_even_when_it_fails() -> None:
    """Nothing outside a step sees the share: not the stepping thread, not a thread started
    after it (torch's new threads take the last count set), not the busy count after a step
    that raised."""
    torch.set_num_threads(3)
    share = CoreShare(4, linger_s=0)
    with pytest.raises(RuntimeError), share.step(object()):
        assert torch.get_num_threads() == 4
        raise RuntimeError("a failing step")
    assert torch.get_num_threads() == 3
    seen: list[int] = []
    t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert seen == [3]
    assert share.busy() == 0


def test_a_disabled_share_gives_every_engine_every_core() -> None:
    share, a, b = _two_busy(4, linger_s=60)
    share.enabled = False
    with share.step(a) as n, share.step(b) as m:
        assert n == m == 4


def test_intra_op_threads_sets_inside_and_puts_back() -> None:
    torch.set_num_threads(2)
    with intra_op_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2


def test_the_cores_left_over_go_one_each_to_the_first_engines() -> None:
    """Three cores and two busy engines: 2 and 1, not 1 and 1 (a core left idle)."""
    share, a, b = _two_busy(3, linger_s=60)
    got = {}
    for e in (a, b):
        with share.step(e) as n:
            got[id(e)] = n
    assert sorted(got.values()) == [1, 2]
    assert share.threads() == 1  # the fewest any busy engine gets
