"""The model registry in isolation (names, versions, weights, promotion, rollback, unloading),
over stand-ins for served versions: only their name and in-flight count are read here."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest

from dsinfer.registry.store import ModelRegistry, RegistryError, Version


@dataclass
class _Engine:
    num_pending: int = 0


@dataclass
class _Served:
    name: str
    version: str | None = None
    engine: _Engine = field(default_factory=_Engine)
    tokenizer: object = None


def _registry() -> ModelRegistry:
    reg = ModelRegistry()
    reg.add("smol", Version.of(_Served("smol@aaaa1111"), "art/v1"))
    reg.add("smol", Version.of(_Served("smol@bbbb2222"), "art/v2", label="v2"))
    return reg


def test_first_version_takes_all_traffic_and_later_ones_none():
    reg = _registry()
    assert reg.entry("smol").weights == {"aaaa1111": 1.0, "bbbb2222": 0.0}
    assert reg.resolve("smol", "anyone").name == "smol@aaaa1111"
    assert reg.resolve(None, None).name == "smol@aaaa1111"  # the first name
    assert reg.resolve("smol@v2", None).name == "smol@bbbb2222"  # pinned by label
    assert reg.resolve("smol@bbbb", None).name == "smol@bbbb2222"  # by id prefix (≥ 4)


def test_errors_name_what_is_wrong_with_a_status():
    reg = _registry()
    for call, status, says in (
        (lambda: reg.resolve("ghost", None), 404, "does not exist"),
        (lambda: reg.resolve("smol@zzzz", None), 404, "versions: aaaa1111, bbbb2222 (v2)"),
        (lambda: reg.add("smol", Version.of(_Served("smol@aaaa1111"), "x")), 409, "already"),
        (lambda: reg.add("smol", Version.of(_Served("smol@cccc"), "x", "v2")), 409, "taken"),
        (lambda: reg.set_weights("smol", {"v2": -1}), 400, ">= 0"),
        (lambda: reg.set_weights("smol", {"v2": 0}), 400, "above 0"),
        (lambda: reg.detach("smol", "aaaa1111"), 409, "still takes 100%"),
    ):
        with pytest.raises(RegistryError, match=re.escape(says)) as err:
            call()
        assert err.value.status == status
    assert ModelRegistry().describe() == []
    with pytest.raises(RegistryError) as err:
        ModelRegistry().resolve(None, None)
    assert err.value.status == 503


def test_canary_promote_rollback_and_unload():
    reg = _registry()
    assert reg.set_weights("smol", {"aaaa1111": 90, "v2": 10}) == {
        "aaaa1111": 0.9, "bbbb2222": 0.1,
    }  # fmt: skip
    assert reg.promote("smol", "v2") == {"aaaa1111": 0.0, "bbbb2222": 1.0}
    assert reg.rollback("smol") == {"aaaa1111": 1.0, "bbbb2222": 0.0}  # as before v2 came
    gone = reg.detach("smol", "v2")
    assert gone.state == "draining" and gone.path == "art/v2"
    assert [v["version"] for v in reg.describe()[0]["versions"]] == ["aaaa1111"]
    reg.detach("smol", "aaaa1111")  # the last version may go with its weight
    assert "smol" not in reg.entries and list(reg.served()) == []
