"""Every `--stats-interval` seconds while a model is busy, one line of what it did (as vLLM
prints): prompt and generation tokens/s, running and waiting requests, KV use, MBU."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from dsinfer.server.metrics import PREFIX, ServerMetrics, labels_of

stats_log = logging.getLogger("dsinfer.stats")


class StatsLogger:
    def __init__(self, metrics: ServerMetrics, served: Callable[[], Iterable[Any]]) -> None:
        self.metrics, self.served = metrics, served
        self._last: dict[str, tuple[float, float]] = {}

    def _tokens(self, served: Any) -> tuple[float, float]:
        name, version = labels_of(served)
        labels = {"model_name": name, "version": version}
        get = self.metrics.registry.get_sample_value
        return (
            get(f"{PREFIX}prompt_tokens_total", labels) or 0.0,
            get(f"{PREFIX}generation_tokens_total", labels) or 0.0,
        )

    def lines(self, interval: float) -> list[str]:
        """One line per model that had work since the last call."""
        out = []
        for served in self.served():
            prompt, gen = self._tokens(served)
            last_prompt, last_gen = self._last.get(served.name, (0.0, 0.0))
            self._last[served.name] = (prompt, gen)
            st = served.engine.stats()
            running = st.running if st is not None else 0
            waiting = st.waiting if st is not None else 0
            if prompt == last_prompt and gen == last_gen and not running and not waiting:
                continue  # idle: say nothing
            kv = st.kv_usage if st is not None else 0.0
            mbu = st.utilization.mbu if st is not None else 0.0
            out.append(
                f"{served.name}: prompt {(prompt - last_prompt) / interval:.1f} tok/s, "
                f"generation {(gen - last_gen) / interval:.1f} tok/s, running {running}, "
                f"waiting {waiting}, KV {100 * kv:.1f}%, MBU {100 * mbu:.1f}%"
            )
        return out

    async def run(self, interval: float) -> None:
        self.lines(interval)  # baseline
        while True:
            await asyncio.sleep(interval)
            for line in self.lines(interval):
                stats_log.info("%s", line)
