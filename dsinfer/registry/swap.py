"""Hot swap: load and warm a version off the event loop, then let it take traffic; unload by
stopping its routing, draining its in-flight requests and freeing its memory.

Loading runs in a worker thread (the engine itself is built on its own engine thread), so
requests to every other version keep flowing while a new one loads; a version is registered
(at weight 0) only after one warm-up forward pass has run through it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable
from typing import Any

from dsinfer.device.host_memory import release_freed_memory
from dsinfer.registry.store import ModelRegistry, RegistryError, Servable, Version
from dsinfer.sampling import SamplingParams

logger = logging.getLogger(__name__)


async def warm_up(served: Servable) -> None:
    """One real forward pass (a one-token greedy generate) before any traffic moves."""
    ids = served.tokenizer.encode("Hello") or [0]
    async for _ in served.engine.generate(ids, SamplingParams(max_tokens=1), "warm-up"):
        pass


async def load_version(
    registry: ModelRegistry,
    name: str,
    path: str,
    build: Callable[[str, str], Any],
    label: str | None = None,
) -> Version:
    """Build (verify under the trust policy, load) and warm a version of `name` from `path`.

    `build(name, path)` returns a ServedModel whose name is NAME@VERSION; it raises ValueError
    for an artifact the policy refuses, and nothing changes."""
    if "@" in name or not name:
        raise RegistryError(f"bad model name {name!r}")
    t0 = time.perf_counter()
    served = await asyncio.to_thread(build, name, path)
    try:
        await warm_up(served)
        version = Version.of(served, path, label)
        registry.add(name, version)
    except BaseException:
        served.engine.shutdown()
        raise
    logger.info("loaded %s from %s in %.1fs", served.name, path, time.perf_counter() - t0)
    return version


async def unload_version(
    registry: ModelRegistry, name: str, ref: str, drain_timeout: float = 300.0
) -> Version:
    """Stop routing to a version, wait for its in-flight requests, free its engine."""
    version = registry.detach(name, ref)
    deadline = time.monotonic() + drain_timeout
    while version.served.engine.num_pending and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if version.served.engine.num_pending:
        logger.warning(
            "%s: %d requests still running at unload",
            version.served.name,
            version.served.engine.num_pending,
        )
    await asyncio.to_thread(version.served.engine.shutdown)
    release_memory(version.served)
    logger.info("unloaded %s", version.served.name)
    return version


def release_memory(served: Servable) -> None:
    """Drop the engine's tensors and hand freed heap pages back to the OS."""
    served.engine.engine = None
    gc.collect()
    release_freed_memory()  # glibc keeps freed pages otherwise; RSS would not show the release
