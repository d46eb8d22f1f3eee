"""Weighted canary routing: a request for NAME goes to a version drawn by the weights.

With a `user`, the draw is a hash of (name, user) instead of a random number, so the same user
lands on the same version for as long as the weights stand (sticky), and users spread over the
versions in the weights' proportions.
"""

from __future__ import annotations

import hashlib
import random


def user_point(name: str, user: str) -> float:
    """A stable number in [0, 1) for this user of this model."""
    digest = hashlib.sha256(f"{name}\0{user}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def choose(weights: dict[str, float], point: float) -> str:
    """The version whose cumulative-weight interval holds `point` (versions in sorted order,
    so the choice depends only on the weights)."""
    live = sorted((v, w) for v, w in weights.items() if w > 0)
    if not live:
        raise ValueError("no version of this model takes traffic")
    total = sum(w for _v, w in live)
    acc = 0.0
    for version, w in live:
        acc += w / total
        if point < acc:
            return version
    return live[-1][0]


def route(name: str, weights: dict[str, float], user: str | None) -> str:
    point = user_point(name, user) if user else random.random()
    return choose(weights, point)
