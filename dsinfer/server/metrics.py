"""Prometheus metrics in the text exposition format (a small, dependency-free registry)."""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    30.0,
    60.0,
)


def _escape(value: str) -> str:
    """Label values as the exposition format wants them: a quote or newline in a value would
    otherwise make the whole page unparseable."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    if not names:
        return ""
    inner = ",".join(f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + inner + "}"


class Counter:
    def __init__(self, name: str, help_: str, labels: tuple[str, ...] = ()) -> None:
        self.name, self.help, self.label_names = name, help_, labels
        self.values: dict[tuple[str, ...], float] = defaultdict(float)
        self._lock = threading.Lock()

    def inc(self, amount: float = 1.0, *labels: str) -> None:
        with self._lock:
            self.values[labels] += amount

    def set_total(self, value: float, *labels: str) -> None:
        """Mirror a running total kept elsewhere (it only grows)."""
        with self._lock:
            self.values[labels] = max(self.values[labels], value)

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for lv, v in sorted(self.values.items()):
            out.append(f"{self.name}{_labels(self.label_names, lv)} {v}")
        return out


class Gauge(Counter):
    def set(self, value: float, *labels: str) -> None:
        with self._lock:
            self.values[labels] = value

    def render(self) -> list[str]:
        lines = super().render()
        lines[1] = f"# TYPE {self.name} gauge"
        return lines


class Histogram:
    def __init__(
        self,
        name: str,
        help_: str,
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
        labels: tuple[str, ...] = (),
    ) -> None:
        self.name, self.help, self.buckets, self.label_names = name, help_, buckets, labels
        self._data: dict[tuple[str, ...], list[float]] = {}
        self._lock = threading.Lock()

    def observe(self, value: float, *labels: str) -> None:
        with self._lock:
            d = self._data.setdefault(labels, [0.0] * (len(self.buckets) + 2))
            d[bisect.bisect_left(self.buckets, value)] += 1  # per-bucket, cumulated on render
            d[-1] += value

    def render(self) -> list[str]:
        out = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for lv, d in sorted(self._data.items()):
            cum = 0.0
            for le, n in zip([*map(str, self.buckets), "+Inf"], d[:-1], strict=True):
                cum += n
                names = (*self.label_names, "le")
                out.append(f"{self.name}_bucket{_labels(names, (*lv, le))} {cum}")
            out.append(f"{self.name}_sum{_labels(self.label_names, lv)} {d[-1]}")
            out.append(f"{self.name}_count{_labels(self.label_names, lv)} {cum}")
        return out


class ServerMetrics:
    """Everything /metrics exposes; engine gauges are refreshed by `update_engine`."""

    def __init__(self) -> None:
        m = ("model",)
        self.requests = Counter(
            "dsinfer_requests_total", "HTTP requests by endpoint and status", ("endpoint", "status")
        )
        self.ttft = Histogram(
            "dsinfer_time_to_first_token_seconds", "Time to first token", labels=m
        )
        self.itl = Histogram("dsinfer_inter_token_latency_seconds", "Time between tokens", labels=m)
        self.e2e = Histogram("dsinfer_e2e_request_latency_seconds", "End-to-end latency", labels=m)
        self.prompt_tokens = Counter("dsinfer_prompt_tokens_total", "Prompt tokens", m)
        self.generation_tokens = Counter("dsinfer_generation_tokens_total", "Generated tokens", m)
        self.queue = Gauge("dsinfer_num_requests_waiting", "Requests waiting", m)
        self.running = Gauge("dsinfer_num_requests_running", "Sequences running", m)
        self.kv_used = Gauge("dsinfer_kv_blocks_used", "KV blocks in use", m)
        self.kv_free = Gauge("dsinfer_kv_blocks_free", "KV blocks free or evictable", m)
        self.kv_usage = Gauge("dsinfer_kv_cache_usage_perc", "KV pool usage, 0..1", m)
        self.prefix_hit = Gauge("dsinfer_prefix_cache_hit_rate", "Prefix-cache block hit rate", m)
        self.preemptions = Gauge("dsinfer_num_preemptions_total", "Preemptions so far", m)
        self.drafts = Gauge("dsinfer_spec_draft_tokens_total", "Speculative drafts verified", m)
        self.accepted = Gauge("dsinfer_spec_accepted_tokens_total", "Drafts accepted", m)
        self.restarts = Counter(
            "dsinfer_engine_restarts_total",
            "Engine restarts after a fault that was no request's",
            m,
        )
        self.acceptance = Gauge(
            "dsinfer_spec_acceptance_rate", "Accepted / verified drafts so far (MTP)", m
        )

    def update_engine(self, model: str, engine) -> None:  # noqa: ANN001 (an LLMEngine)
        s, pool = engine.scheduler, engine.pool
        self.queue.set(len(s.waiting), model)
        self.running.set(len(s.running), model)
        self.kv_used.set(pool.num_used, model)
        self.kv_free.set(pool.num_free, model)
        self.kv_usage.set(pool.num_used / pool.num_blocks, model)
        self.prefix_hit.set(pool.hits / pool.queries if pool.queries else 0.0, model)
        self.preemptions.set(s.num_preemptions, model)
        self.drafts.set(s.num_draft_tokens, model)
        self.accepted.set(s.num_accepted_draft_tokens, model)
        rate = s.num_accepted_draft_tokens / s.num_draft_tokens if s.num_draft_tokens else 0.0
        self.acceptance.set(rate, model)

    def retain_models(self, names: set[str]) -> None:
        """Drop the engine gauges of versions no longer served: an unloaded version's last
        KV and queue figures would otherwise be reported forever (and summed by dashboards)."""
        for metric in vars(self).values():
            if isinstance(metric, Gauge) and metric.label_names == ("model",):
                with metric._lock:
                    for key in [k for k in metric.values if k[0] not in names]:
                        del metric.values[key]

    def render(self) -> str:
        parts: list[str] = []
        for metric in vars(self).values():
            parts.extend(metric.render())
        return "\n".join(parts) + "\n"
