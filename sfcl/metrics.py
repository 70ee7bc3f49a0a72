"""Prometheus series from the engine's per-step records (vLLM v1 ``StatLogger`` pattern).

The engine fills a ``StepStats`` per step and emits typed events; the engine thread hands both to
``PrometheusStatLogger.log`` — the only place that touches prometheus-client. Names follow the
Prometheus conventions: ``sfcl_`` prefix, base units (seconds), ``_total`` counters.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from sfcl.engine.events import ErrorEvent, Finished, SnapshotEvent

# Buckets that resolve both CPU (tens of ms to seconds) and GPU (ms) speeds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)


class PrometheusStatLogger:
    def __init__(self, snapshots_enabled: bool, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.requests = Counter("sfcl_requests", "Finished requests by outcome", ["status"], registry=r)
        self.prompt_tokens = Counter("sfcl_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("sfcl_generation_tokens", "Generated tokens", registry=r)
        self.running = Gauge("sfcl_num_requests_running", "Requests in the decode batch", registry=r)
        self.waiting = Gauge("sfcl_num_requests_waiting", "Requests waiting for a KV slot", registry=r)
        self.steps = Counter("sfcl_engine_steps", "Engine steps executed", registry=r)
        self.lookups = Counter("sfcl_snapshot_lookups", "Anchor lookups by the (first) trigger that caused "
                               "them; 'always' for every-token mode without a trigger", ["trigger"], registry=r)
        self.lookup_seconds = Histogram("sfcl_snapshot_lookup_seconds", "Batched anchor search time per step",
                                        buckets=LOOKUP_BUCKETS, registry=r)
        self.ttft = Histogram("sfcl_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.snapshots_enabled = Gauge("sfcl_snapshots_enabled",
                                       "1 when an anchor library is loaded, 0 when snapshots are disabled",
                                       registry=r)
        self.snapshots_enabled.set(1 if snapshots_enabled else 0)
        self._modes: dict[str, str] = {}

    def watch_queue(self, num_running, num_waiting) -> None:
        """Gauges read at scrape time: callables returning the current counts."""
        self.running.set_function(num_running)
        self.waiting.set_function(num_waiting)

    def log(self, stats, events) -> None:
        """stats: ``sfcl.engine.engine.StepStats``; events: the step's (request_id, event) pairs."""
        self.steps.inc()
        self.generation_tokens.inc(stats.generated)
        if stats.lookups:
            self.lookup_seconds.observe(stats.lookup_ms / 1e3)
        for _, ev in events:
            if isinstance(ev, SnapshotEvent):
                self.lookups.labels(trigger=ev.trigger).inc()
            elif isinstance(ev, Finished):
                self.requests.labels(status=ev.stop_reason).inc()
                self.prompt_tokens.inc(ev.prompt_tokens)
                if ev.completion_tokens:
                    self.ttft.observe(ev.ttft_ms / 1e3)
            elif isinstance(ev, ErrorEvent):
                self.requests.labels(status="error").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
