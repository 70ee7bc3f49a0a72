"""Prometheus series from the engine's per-step records (vLLM v1 ``StatLogger`` pattern).

The engine fills a ``StepStats`` per step and emits typed events; the engine thread hands both to
``PrometheusStatLogger.log`` — the only place that touches prometheus-client. Names follow the
Prometheus conventions: ``sfcl_`` prefix, base units (seconds), ``_total`` counters. Request tags
become a ``tag`` label from a bounded set (configured tags; anything else is ``other``, no tag is
``none``) so a client cannot blow up the series count.

GPU utilisation and memory come from NVML (``nvidia-ml-py``, extra ``gpu``) through a collector
read at scrape time; the series are absent on a machine without CUDA or without the package.
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.core import GaugeMetricFamily

from sfcl.engine.events import ErrorEvent, Finished, SnapshotEvent

# Buckets that resolve both CPU (tens of ms to seconds) and GPU (ms) speeds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1)
STEP_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
                5.0)  # one engine step: ~5-10 ms decoding one stream on 2 CPU cores, seconds with a long prompt chunk
VARIANCE_BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0)  # seconds^2 (1e-4 s^2 = 100 ms^2)
N_ANCHOR_BUCKETS = 32  # anchor-id ranges on the heatmap's y axis

log = logging.getLogger("sfcl.metrics")


class PrometheusStatLogger:
    """Turns StepStats + events into series.

    known_tags: tags kept as label values. n_anchors: library size (0 without one), for the
    anchor-id buckets. hit_threshold: best cosine similarity that counts as an anchor hit.
    price_per_hour: device price in dollars per hour for the cost series (0 disables them).
    kv_slots: KV slots of the engine, for the cache-usage ratio.
    gpu: export NVML GPU gauges; None = when CUDA and ``pynvml`` (nvidia-ml-py) are available.
    """

    def __init__(self, snapshots_enabled: bool, registry: CollectorRegistry | None = None, *,
                 known_tags: tuple[str, ...] = ("high-risk",), n_anchors: int = 0, hit_threshold: float = 0.8,
                 price_per_hour: float = 0.0, kv_slots: int = 1, gpu: bool | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.known_tags = set(known_tags)
        self.n_anchors, self.hit_threshold = n_anchors, hit_threshold
        self.price_per_hour, self.kv_slots = price_per_hour, max(1, kv_slots)
        self.started = time.monotonic()
        self._library_info: Info | None = None  # sfcl_anchor_library, made by the first set_library
        self.n_requests = 0
        self.n_tokens = 0
        self.requests = Counter("sfcl_requests", "Ended requests by outcome (stop reason, error or aborted) and tag",
                                ["status", "tag"], registry=r)
        self.prompt_tokens = Counter("sfcl_prompt_tokens", "Prompt tokens of finished requests", ["tag"], registry=r)
        self.generation_tokens = Counter("sfcl_generation_tokens", "Generated tokens", registry=r)
        self.running = Gauge("sfcl_num_requests_running", "Requests in the decode batch", registry=r)
        self.waiting = Gauge("sfcl_num_requests_waiting", "Requests waiting for a KV slot", registry=r)
        self.kv_usage = Gauge("sfcl_kv_cache_usage_ratio", "Share of KV slots in use (0..1)", registry=r)
        self.steps = Counter("sfcl_engine_steps", "Engine steps executed", registry=r)
        self.step_seconds = Histogram("sfcl_engine_step_seconds", "Wall time of one engine step (schedule, "
                                      "forward, sampling, triggers, lookups, events), by kind: decode (decode rows "
                                      "only) or prefill (with prompt tokens)", ["kind"], buckets=STEP_BUCKETS,
                                      registry=r)
        self.lookups = Counter("sfcl_snapshot_lookups", "Anchor lookups by the (first) trigger that caused "
                               "them ('always' for every-token mode without a trigger) and the request's "
                               "snapshot mode (triggered | always)", ["trigger", "mode"], registry=r)
        self._mode_of: Callable[[str], str | None] = lambda rid: None
        self.prefix_queries = Counter("sfcl_prefix_cache_queries", "Prompt tokens looked up in the prefix KV "
                                      "cache", registry=r)
        self.prefix_hits = Counter("sfcl_prefix_cache_hits", "Prompt tokens found in the prefix KV cache "
                                   "(KV reused, not recomputed)", registry=r)
        self.anchor_lookups = Counter("sfcl_anchor_lookups", "Anchor lookups (snapshots)", registry=r)
        self.anchor_hits = Counter("sfcl_anchor_hits", "Lookups whose best anchor similarity reached the hit "
                                   "threshold", registry=r)
        self.anchor_bucket = Counter("sfcl_snapshots_by_anchor_bucket", "Snapshots by best-anchor id range "
                                     f"(library split into {N_ANCHOR_BUCKETS} equal ranges, label 00..{N_ANCHOR_BUCKETS - 1:02d})", ["bucket"], registry=r)
        self.lookup_seconds = Histogram("sfcl_snapshot_lookup_seconds", "Batched anchor search time per step",
                                        buckets=LOOKUP_BUCKETS, registry=r)
        self.ttft = Histogram("sfcl_time_to_first_token_seconds", "Arrival to first generated token", ["tag"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sfcl_inter_token_latency_seconds", "Gap between consecutive generated tokens",
                             ["tag"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("sfcl_e2e_request_latency_seconds", "Arrival to finish", ["tag"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("sfcl_request_queue_time_seconds", "Arrival to admission into a KV slot", ["tag"],
                               buckets=LATENCY_BUCKETS, registry=r)
        self.gap_var = Histogram("sfcl_token_gap_variance_seconds2", "Per-request variance of the gaps between "
                                 "generated tokens (stream smoothness)", ["tag"], buckets=VARIANCE_BUCKETS, registry=r)
        self.snapshots_enabled = Gauge("sfcl_snapshots_enabled",
                                       "1 when an anchor library is loaded, 0 when snapshots are disabled",
                                       registry=r)
        self.snapshots_enabled.set(1 if snapshots_enabled else 0)
        self.cost = Gauge("sfcl_cost_per_1k_tokens_dollars", "Device cost per 1,000 generated tokens since start "
                          "(--price-per-hour x uptime / tokens)", registry=r)
        self.req_per_hour = Gauge("sfcl_requests_per_device_hour", "Finished requests per hour of uptime", registry=r)
        self.cost.set_function(self._cost)
        self.req_per_hour.set_function(lambda: self.n_requests / max(1e-9, self._hours()))
        self.gpu_collector = NvmlCollector.create() if gpu or gpu is None else None
        if gpu and self.gpu_collector is None:
            log.warning("GPU metrics requested but CUDA or nvidia-ml-py (pynvml) is unavailable")
        if self.gpu_collector is not None:
            r.register(self.gpu_collector)

    def _hours(self) -> float:
        return (time.monotonic() - self.started) / 3600.0

    def _cost(self) -> float:
        return self.price_per_hour * self._hours() / (self.n_tokens / 1000.0) if self.n_tokens else 0.0

    def tag_label(self, tag: str | None) -> str:
        return "none" if tag is None else (tag if tag in self.known_tags else "other")

    def watch_queue(self, num_running, num_waiting) -> None:
        """Gauges read at scrape time: callables returning the current counts."""
        self.running.set_function(num_running)
        self.waiting.set_function(num_waiting)
        self.kv_usage.set_function(lambda: num_running() / self.kv_slots)

    def watch_requests(self, mode_of: Callable[[str], str | None]) -> None:
        """mode_of(request_id) -> the live request's snapshot mode, or None once it is gone.
        Called on the engine thread inside ``log``, so it may read engine state directly."""
        self._mode_of = mode_of

    def set_library(self, info: dict) -> None:
        """Export the anchor library in use (``sfcl_anchor_library`` info: path, version, n_anchors,
        layer, created, model_name) and size the anchor-id buckets for it. Best effort: a failure
        is logged, never raised (health still says the version)."""
        self.n_anchors = int(info.get("n_anchors") or 0)
        try:
            if self._library_info is None:
                self._library_info = Info("sfcl_anchor_library", "Anchor library in use for new requests",
                                          registry=self.registry)
            self._library_info.info({k: str(v) for k, v in info.items()})
        except Exception:
            log.exception("could not export the anchor library version")

    def log(self, stats, events) -> None:
        """stats: ``sfcl.engine.engine.StepStats``; events: the step's (request_id, event) pairs."""
        self.steps.inc()
        if stats.step_ms:
            self.step_seconds.labels(kind="prefill" if stats.prefill_tokens else "decode").observe(stats.step_ms / 1e3)
        self.generation_tokens.inc(stats.generated)
        self.n_tokens += stats.generated
        self.prefix_queries.inc(getattr(stats, "prefix_cache_queries", 0))
        self.prefix_hits.inc(getattr(stats, "prefix_cache_hits", 0))
        if stats.lookups:
            self.lookup_seconds.observe(stats.lookup_ms / 1e3)
        self.log_events(events)

    def aborted(self, tag: str | None) -> None:
        """A request ended by its client (disconnect, closed stream) before it finished: counted
        in ``sfcl_requests_total{status="aborted"}``; it has no Finished record."""
        self.n_requests += 1
        self.requests.labels(status="aborted", tag=self.tag_label(tag)).inc()

    def log_events(self, events) -> None:
        """The per-request series of (request_id, event) pairs (``log`` passes a step's)."""
        # A request that finished in this step is already gone from the engine: its Finished
        # record in the same batch carries the mode.
        finished_modes = {rid: ev.snapshot_summary.get("mode") for rid, ev in events
                          if isinstance(ev, Finished) and isinstance(ev.snapshot_summary, dict)}
        for rid, ev in events:
            if isinstance(ev, SnapshotEvent):
                mode = finished_modes.get(rid) or self._mode_of(rid) or "unknown"
                self.lookups.labels(trigger=ev.trigger, mode=mode).inc()
                self.anchor_lookups.inc()
                if ev.top and ev.top[0].score >= self.hit_threshold:
                    self.anchor_hits.inc()
                if self.n_anchors:
                    b = min(N_ANCHOR_BUCKETS - 1, ev.anchor_id * N_ANCHOR_BUCKETS // self.n_anchors)
                    self.anchor_bucket.labels(bucket=f"{b:02d}").inc()  # zero-padded: sorts as numbers
            elif isinstance(ev, Finished):
                tag = self.tag_label(ev.tag)
                self.n_requests += 1
                self.requests.labels(status=ev.stop_reason, tag=tag).inc()
                self.prompt_tokens.labels(tag=tag).inc(ev.prompt_tokens)
                self.queue.labels(tag=tag).observe(ev.queue_ms / 1e3)
                self.e2e.labels(tag=tag).observe(ev.e2e_ms / 1e3)
                if ev.completion_tokens:
                    self.ttft.labels(tag=tag).observe(ev.ttft_ms / 1e3)
                for g in ev.token_gaps_ms:
                    self.itl.labels(tag=tag).observe(g / 1e3)
                if len(ev.token_gaps_ms) >= 2:
                    self.gap_var.labels(tag=tag).observe(statistics.pvariance(ev.token_gaps_ms) / 1e6)
            elif isinstance(ev, ErrorEvent):
                self.n_requests += 1
                self.requests.labels(status="error", tag=self.tag_label(ev.tag)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class NvmlCollector:
    """``sfcl_gpu_utilization_ratio{gpu}`` and ``sfcl_gpu_memory_used_bytes{gpu}``, read from NVML at
    every scrape (no background thread). ``gpu`` is the NVML device index (as in ``nvidia-smi``).

    Utilisation is NVML's ``utilization.gpu`` (share of the last sample period, 1/6 s to 1 s
    depending on the product, in which a kernel ran) divided by 100; memory is ``memory.used`` in
    bytes. A device whose query fails is left out of that scrape.
    """

    def __init__(self, nvml, n_devices: int):
        self.nvml, self.n_devices = nvml, n_devices

    @classmethod
    def create(cls) -> "NvmlCollector | None":
        """A collector when CUDA is available and NVML initialises, else None (CPU: no series)."""
        try:
            import torch

            if not torch.cuda.is_available():
                return None
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            n = int(pynvml.nvmlDeviceGetCount())
        except Exception as e:  # NVMLError: no driver library, permissions...
            log.warning("NVML unavailable, no GPU metrics: %s", e)
            return None
        return cls(pynvml, n)

    def describe(self):
        return [GaugeMetricFamily("sfcl_gpu_utilization_ratio", "GPU busy share (0..1)", labels=["gpu"]),
                GaugeMetricFamily("sfcl_gpu_memory_used_bytes", "GPU memory in use (bytes)", labels=["gpu"])]

    def collect(self):
        util = GaugeMetricFamily("sfcl_gpu_utilization_ratio", "GPU busy share (0..1), from NVML at scrape time",
                                 labels=["gpu"])
        mem = GaugeMetricFamily("sfcl_gpu_memory_used_bytes", "GPU memory in use (bytes), from NVML at scrape "
                                "time", labels=["gpu"])
        for i in range(self.n_devices):
            try:
                h = self.nvml.nvmlDeviceGetHandleByIndex(i)
                u = self.nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0
                used = self.nvml.nvmlDeviceGetMemoryInfo(h).used
            except Exception:  # one device failing must not break the scrape
                continue
            util.add_metric([str(i)], u)
            mem.add_metric([str(i)], float(used))
        yield util
        yield mem
