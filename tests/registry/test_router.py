"""The canary router in isolation: deterministic, sticky per user, proportional over users."""

from __future__ import annotations

import pytest

from dsinfer.registry.router import choose, route, user_point


def test_choice_follows_cumulative_weights_in_sorted_order():
    weights = {"v2": 1.0, "v1": 3.0}  # sorted: v1 [0, 0.75), v2 [0.75, 1)
    assert choose(weights, 0.0) == "v1"
    assert choose(weights, 0.7499) == "v1"
    assert choose(weights, 0.75) == "v2"
    assert choose(weights, 0.9999) == "v2"
    assert choose({"a": 0.0, "b": 2.0}, 0.1) == "b"  # weight 0 takes nothing
    with pytest.raises(ValueError, match="no version"):
        choose({"a": 0.0}, 0.5)


def test_a_user_sticks_to_a_version_and_users_spread_by_weight():
    weights = {"v1": 90.0, "v2": 10.0}
    assert {route("smol", weights, "alice") for _ in range(20)} == {route("smol", weights, "alice")}
    users = [f"user-{i}" for i in range(2000)]
    share = sum(route("smol", weights, u) == "v2" for u in users) / len(users)
    assert share == pytest.approx(0.10, abs=0.02)  # SHA-256 points: fixed, not random
    assert user_point("smol", "alice") != user_point("other", "alice")  # per model
    assert 0 <= user_point("smol", "alice") < 1
