"""Name → versions, their traffic weights, and the weights to roll back to.

A version is a loaded engine (`ServedModel`) with an id: the artifact's short version hash, or
`local` for a plain checkpoint, plus an optional label. Requests say `NAME` (routed by the
weights) or `NAME@VERSION` (pinned: a version id, a prefix of one, or a label). Changes happen
on the server's event loop, so no lock is needed; readers see either the old or the new weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from dsinfer.registry.router import route


class Servable(Protocol):
    """What the registry needs of a loaded version (the server's ServedModel)."""

    name: str
    version: str | None
    engine: Any  # an AsyncEngine: num_pending, stats(), restarts
    tokenizer: Any


class RegistryError(ValueError):
    """A registry operation that cannot be done; `status` is the HTTP code to answer with."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Version:
    id: str
    served: Servable
    path: str
    label: str | None = None
    state: str = "ready"  # ready | draining

    @classmethod
    def of(cls, served: Servable, path: str, label: str | None = None) -> Version:
        """A version whose id comes from the served name NAME@VERSION (`local`: no version)."""
        return cls(served.name.partition("@")[2] or "local", served, path, label)

    def matches(self, ref: str) -> bool:
        return ref == self.label or (len(ref) >= 4 and self.id.startswith(ref)) or ref == self.id


@dataclass
class ModelEntry:
    name: str
    versions: dict[str, Version] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    stable: dict[str, float] = field(default_factory=dict)  # weights at the last load: rollback

    def find(self, ref: str) -> Version:
        hits = [v for v in self.versions.values() if v.matches(ref)]
        if len(hits) != 1:
            known = ", ".join(
                v.id + (f" ({v.label})" if v.label else "") for v in self.versions.values()
            )
            why = "is ambiguous" if hits else "does not exist"
            raise RegistryError(f"version {ref!r} of {self.name!r} {why}; versions: {known}", 404)
        return hits[0]


class ModelRegistry:
    def __init__(self) -> None:
        self.entries: dict[str, ModelEntry] = {}

    # -- reads --------------------------------------------------------------------------------
    def served(self) -> Iterator[Servable]:
        for entry in self.entries.values():
            for v in entry.versions.values():
                yield v.served

    def resolve(self, model: str | None, user: str | None) -> Servable:
        """The engine for a request's `model` (NAME, NAME@VERSION, or None: the first name)."""
        if not self.entries:
            raise RegistryError("no model is loaded", 503)
        if model is None:
            model = next(iter(self.entries))
        name, _, ref = model.partition("@")
        entry = self.entries.get(name)
        if entry is None:
            raise RegistryError(
                f"model {model!r} does not exist; available: {', '.join(self.entries)}", 404
            )
        if ref:
            return entry.find(ref).served
        try:
            return entry.versions[route(name, entry.weights, user)].served
        except ValueError as e:
            raise RegistryError(f"model {name!r}: {e}", 503) from None

    def entry(self, name: str) -> ModelEntry:
        if name not in self.entries:
            raise RegistryError(f"model {name!r} does not exist", 404)
        return self.entries[name]

    # -- changes ------------------------------------------------------------------------------
    def add(self, name: str, version: Version) -> None:
        entry = self.entries.setdefault(name, ModelEntry(name))
        if version.id in entry.versions:
            raise RegistryError(f"{name}@{version.id} is already loaded", 409)
        if version.label and any(v.label == version.label for v in entry.versions.values()):
            raise RegistryError(f"label {version.label!r} is taken in {name!r}", 409)
        first = not entry.versions
        entry.versions[version.id] = version
        if first:  # a new name takes all of its traffic at once
            entry.weights = {version.id: 1.0}
        else:
            entry.weights = {**entry.weights, version.id: 0.0}
        entry.stable = dict(entry.weights)

    def set_weights(self, name: str, weights: dict[str, float]) -> dict[str, float]:
        entry = self.entry(name)
        resolved: dict[str, float] = {v: 0.0 for v in entry.versions}
        for ref, w in weights.items():
            if w < 0:
                raise RegistryError(f"weight for {ref!r} must be >= 0, got {w}")
            resolved[entry.find(ref).id] = float(w)
        if sum(resolved.values()) <= 0:
            raise RegistryError("at least one version needs a weight above 0")
        total = sum(resolved.values())
        entry.weights = {v: w / total for v, w in resolved.items()}
        return entry.weights

    def promote(self, name: str, ref: str) -> dict[str, float]:
        entry = self.entry(name)
        version = entry.find(ref)
        entry.weights = {v: float(v == version.id) for v in entry.versions}
        return entry.weights

    def rollback(self, name: str) -> dict[str, float]:
        """Back to the weights in force when the newest version was loaded (before any canary
        or promotion moved traffic to it); the next load takes a new snapshot."""
        entry = self.entry(name)
        entry.weights = {v: entry.stable.get(v, 0.0) for v in entry.versions}
        if sum(entry.weights.values()) <= 0:
            raise RegistryError(f"{name!r} has no earlier weights to roll back to", 409)
        return entry.weights

    def detach(self, name: str, ref: str) -> Version:
        """Stop routing to a version that has no weight; the caller drains and frees it."""
        entry = self.entry(name)
        version = entry.find(ref)
        if entry.weights.get(version.id, 0.0) > 0 and len(entry.versions) > 1:
            raise RegistryError(
                f"{name}@{version.id} still takes {entry.weights[version.id]:.0%} of traffic; "
                "move its weight away (weights or rollback) before unloading it",
                409,
            )
        version.state = "draining"
        del entry.versions[version.id]
        entry.weights.pop(version.id, None)
        entry.stable.pop(version.id, None)
        if not entry.versions:
            del self.entries[name]
        return version

    def describe(self) -> list[dict]:
        return [
            {
                "name": e.name,
                "versions": [
                    {
                        "version": v.id,
                        "label": v.label,
                        "path": v.path,
                        "state": v.state,
                        "weight": round(e.weights.get(v.id, 0.0), 6),
                        "in_flight": v.served.engine.num_pending,
                        "model": v.served.name,
                    }
                    for v in e.versions.values()
                ],
            }
            for e in self.entries.values()
        ]
