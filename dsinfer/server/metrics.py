"""/metrics through prometheus-client: one registry per server, vLLM's names where the meaning
is the same (prefix `dsinfer:` for `vllm:`), labels `model_name` and `version`.

Request-side figures (latencies, tokens, finished requests, HTTP statuses) are recorded as they
happen; engine state (queues, KV pool, prefix cache, preemptions, speculation, utilisation) is
read from the served engines when Prometheus scrapes (EngineCollector), so an unloaded version
simply stops being reported. The standard process, platform and GC collectors come with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from dsinfer.device import memory_stats

PREFIX = "dsinfer:"
LABELS = ("model_name", "version")
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0,
)  # fmt: skip
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
CONTENT_TYPE = CONTENT_TYPE_LATEST


def labels_of(served: Any) -> tuple[str, str]:
    """(model_name, version) of a served version: NAME@VERSION splits, a checkpoint has ""."""
    name = served.name.split("@", 1)[0]
    return name, served.version or ""


class ServerMetrics:
    """Everything /metrics exposes. `served` lists the versions being served right now."""

    def __init__(self, served: Callable[[], Iterable[Any]] = lambda: ()) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.requests = Counter(
            f"{PREFIX}http_requests",
            "HTTP requests by route template and status (streamed ones when their 200 is sent)",
            ("route", "status"),
            registry=r,
        )
        self.ttft = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Time to first token", LABELS,
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            f"{PREFIX}inter_token_latency_seconds", "Time between output tokens", LABELS,
            buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "End-to-end request latency", LABELS,
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens", "Prompt tokens processed", LABELS, registry=r
        )
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens", "Tokens generated", LABELS, registry=r
        )
        self.request_success = Counter(
            f"{PREFIX}request_success",
            "Finished requests by finish reason (stop, length, tool_calls, abort, error)",
            (*LABELS, "finished_reason"),
            registry=r,
        )
        r.register(EngineCollector(served))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Engine state, read at scrape time from every served version."""

    def __init__(self, served: Callable[[], Iterable[Any]]) -> None:
        self.served = served

    def describe(self) -> list[Metric]:
        return []  # collected live: the families depend on what is served

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"{PREFIX}{name}", doc, labels=LABELS)

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(f"{PREFIX}{name}", doc, labels=LABELS)

        fams = {
            "running": gauge("num_requests_running", "Requests running (in the batch)"),
            "waiting": gauge("num_requests_waiting", "Requests waiting to be scheduled"),
            "usage": gauge("kv_cache_usage_perc", "KV pool usage, 0..1"),
            "used": gauge("kv_blocks_used", "KV blocks in use"),
            "free": gauge("kv_blocks_free", "KV blocks free or evictable"),
            "mbu": gauge("memory_bandwidth_utilization", "Bytes moved / (busy time × peak "
                         "bandwidth) over the last minute, 0..1 (docs/metrics.md)"),
            "mfu": gauge("flops_utilization", "FLOPs / (busy time × peak FLOP/s) over the "
                         "last minute, 0..1"),
            "bw": gauge("achieved_bandwidth_bytes_per_second", "Bytes moved per busy second "
                        "over the last minute"),
            "busy": gauge("engine_busy_ratio", "Share of the last minute spent in steps"),
            "peak_bw": gauge("peak_bandwidth_bytes_per_second", "The peak MBU divides by"),
            "peak_fl": gauge("peak_flops", "The peak FLOP/s MFU divides by"),
            "step_s": counter("step_seconds", "Seconds spent in engine steps"),
            "step_b": counter("step_bytes", "Bytes engine steps had to move (MBU's numerator)"),
            "step_f": counter("step_flops", "FLOPs engine steps had to do (MFU's numerator)"),
            "hits": counter("prefix_cache_hits", "Prefix-cache hits (blocks)"),
            "queries": counter("prefix_cache_queries", "Prefix-cache lookups (blocks)"),
            "preempt": counter("num_preemptions", "Requests preempted (KV freed, recomputed)"),
            "drafts": counter("spec_decode_num_draft_tokens", "Speculative drafts verified"),
            "accepted": counter("spec_decode_num_accepted_tokens", "Drafts accepted"),
            "restarts": counter("engine_restarts", "Engine restarts after a fault that was "
                                "no request's"),
            "dev_alloc": gauge("device_memory_allocated_bytes", "Accelerator memory allocated "
                               "(CUDA/NPU allocator; absent on CPU)"),
            "dev_reserved": gauge("device_memory_reserved_bytes", "Accelerator memory reserved "
                                  "by the caching allocator"),
        }  # fmt: skip
        for served in self.served():
            lv = list(labels_of(served))
            runner = served.engine
            fams["restarts"].add_metric(lv, runner.restarts)
            st = runner.stats()
            if st is None:
                continue  # restarting: no state to read
            for key, value in (
                ("running", st.running),
                ("waiting", st.waiting),
                ("usage", st.kv_usage),
                ("used", st.kv_blocks_used),
                ("free", st.kv_blocks_free),
                ("hits", st.prefix_cache_hits),
                ("queries", st.prefix_cache_queries),
                ("preempt", st.preemptions),
                ("drafts", st.draft_tokens),
                ("accepted", st.accepted_draft_tokens),
                ("mbu", st.utilization.mbu),
                ("mfu", st.utilization.mfu),
                ("bw", st.utilization.bandwidth),
                ("busy", st.utilization.busy),
                ("peak_bw", st.peak_bandwidth),
                ("peak_fl", st.peak_flops),
                ("step_s", st.step_seconds),
                ("step_b", st.step_bytes),
                ("step_f", st.step_flops),
            ):
                fams[key].add_metric(lv, value)
            device = memory_stats(runner.device)
            if device is not None:
                fams["dev_alloc"].add_metric(lv, device["allocated"])
                fams["dev_reserved"].add_metric(lv, device["reserved"])
        yield from fams.values()
