"""EngineCore: what a driver loop (the server's AsyncEngine) needs of an engine, and no more.

LLMEngine is the implementation; the protocol is the seam that lets the server's protocol tests
run over a scripted engine, and keeps the server from reaching into the scheduler or the pool.
"""

from __future__ import annotations

from typing import Any, Protocol

from dsinfer.engine.llm_engine import EngineStats
from dsinfer.engine.outputs import RequestOutput
from dsinfer.sampling import SamplingParams


class EngineCore(Protocol):
    device: Any  # torch.device of rank 0: where the KV pool and weights live

    def add_request(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> str:
        """Queue a request; ValueError for one the engine cannot take (said to the client)."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Stop a request; its KV blocks return to the pool."""
        ...

    def step(self) -> list[RequestOutput]:
        """One scheduling step: the outputs (deltas) it produced."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    @property
    def num_running(self) -> int:
        """Requests in the running batch; cheap (read per request by admission)."""
        ...

    def stats(self) -> EngineStats:
        """What the engine is doing now (metrics, admission, /health)."""
        ...

    def check_integrity(self) -> None:
        """Raise if the KV pool's bookkeeping is inconsistent (tests, after a fault)."""
        ...

    def shutdown(self) -> None:
        """Stop any worker processes."""
        ...
