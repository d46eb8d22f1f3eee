"""Attention backends by (backend name, device type, kind: "mha" | "mla").

Device type "any" registers an implementation for every device (the reference). A model asks
for a kind; the backend chosen for the engine replaces it after loading. A kind the chosen
backend does not implement for the device keeps the reference (logged once per kind).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger(__name__)
_REGISTRY: dict[tuple[str, str, str], type] = {}
_warned: set[tuple[str, str, str]] = set()
T = TypeVar("T", bound=type)


def register_attention(backend: str, device_type: str, kind: str) -> Callable[[T], T]:
    def register(cls: T) -> T:
        _REGISTRY[(backend, device_type, kind)] = cls
        return cls

    return register


def attention_class(backend: str, device_type: str, kind: str) -> type:
    for key in ((backend, device_type, kind), (backend, "any", kind)):
        if key in _REGISTRY:
            return _REGISTRY[key]
    if (backend, device_type, kind) not in _warned:
        _warned.add((backend, device_type, kind))
        logger.info(
            "no %s %s attention for %s: this kind keeps the reference", backend, kind, device_type
        )
    return _REGISTRY[("reference", "any", kind)]


def make_attention(kind: str, **shape: Any) -> Any:
    """The reference attention of `kind` for this shape (models build with it)."""
    return _REGISTRY[("reference", "any", kind)](**shape)
