"""The Ray Serve deployments behind the ingress: engine replicas and the report hub.

``EngineReplica``: one ``AsyncEngine`` (its own model copy and engine thread, built by
``sfcl.engine_stack.build_engine``) per Serve replica, on the CPUs or the GPU that
``ray_actor_options`` reserved for it. The ingress calls ``stream`` through
``DeploymentHandle.options(stream=True)``; cancelling that call (client gone) cancels the
generator here, whose ``finally`` aborts the request in the engine (KV slot freed), exactly as in
the single server. Serve's hooks: ``check_health`` pings the engine thread (a step stuck or the
thread dead fails it, not only a dead event loop), ``record_routing_stats`` reports the prefix
cache's block hashes to the routers (``sfcl.cluster.router``).

``ReportHub``: one small replica (no CPU reserved) that keeps the latest ``ReplicaReport`` of
every engine replica (pushed every ``report_interval_s``), for the ingress's ``/health`` and
``/metrics``; a replica that missed three reports is dropped (dead or scaled down).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

import ray
from ray import serve

from sfcl.cluster.reports import ReplicaInfo, ReplicaReport
from sfcl.config import EngineConfig, ModelConfig, SnapshotConfig
from sfcl.engine.protocol import EngineBusyError
from sfcl.engine.request import SamplingParams

log = logging.getLogger("sfcl.cluster")
HEALTH_PING_TIMEOUT_S = 20.0  # longer than any engine step (a 512-token prefill chunk on 1 CPU: ~1 s)


@dataclass(slots=True)
class Busy:
    """The replica's engine queue was full on arrival (the ingress answers 529 / 429)."""

    retry_after_s: int


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1000, num_replicas=1)
class ReportHub:
    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, ReplicaReport]] = {}  # replica -> (received, monotonic s)

    def push(self, report: ReplicaReport) -> None:
        self._reports[report.replica] = (time.monotonic(), report)

    def collect(self, metrics: bool = True) -> list[ReplicaReport]:
        """Reports of the replicas that reported within 3 of their intervals (+2 s of slack);
        metrics=False leaves out the metric families (``/health`` needs none)."""
        now = time.monotonic()
        for replica, (at, rep) in list(self._reports.items()):
            if now - at > 3 * rep.interval_s + 2.0:
                del self._reports[replica]
        reports = [rep for _, rep in self._reports.values()]
        return reports if metrics else [replace(rep, families=[]) for rep in reports]


@serve.deployment
class EngineReplica:
    async def __init__(self, mcfg: ModelConfig, ecfg: EngineConfig, scfg: SnapshotConfig, hub,
                     report_interval_s: float):
        from sfcl.engine.host_memory import freeze_startup_objects, return_freed_memory
        from sfcl.engine_stack import build_engine

        # off the event loop: loading takes seconds to minutes, and Serve polls the replica meanwhile
        built = await asyncio.to_thread(build_engine, mcfg, ecfg, scfg, False)
        freeze_startup_objects()  # a replica's actor process serves only this engine (sfcl.engine.host_memory)
        return_freed_memory()  # what loading freed (conversion, index build) goes back to the kernel
        self._engine = built.engine  # it owns the anchor library from here on
        self._hub = hub
        self._interval = report_interval_s
        self._replica = serve.get_replica_context().replica_id.unique_id
        self._actor_name = ray.get_runtime_context().get_actor_name() or ""
        self._reporter = asyncio.get_running_loop().create_task(self._report_forever())

    def describe(self) -> ReplicaInfo:
        eng = self._engine
        sched = eng.engine.scheduler
        return ReplicaInfo(model_name=eng.model_name, max_model_len=eng.max_model_len,
                           snapshots_available=eng.snapshots_available, block_size=sched.cfg.block_size,
                           prefix_caching=sched.prefix.enabled, n_anchors=int(eng.metrics.n_anchors or 0),
                           tokenizer=eng.tokenizer)

    async def stream(self, prompt_ids: list[int], params: SamplingParams, request_id: str,
                     prefix_hashes: list[int] | None = None):
        """The request's engine events (``sfcl.engine.events``), or one ``Busy`` when the engine
        queue is full. prefix_hashes: the prompt's block hashes, read by the router only."""
        try:
            async for ev in self._engine.stream(prompt_ids, params, request_id):
                yield ev
        except EngineBusyError as e:
            yield Busy(e.retry_after_s)

    def record_routing_stats(self) -> dict:
        """Serve pulls this every ``request_routing_stats_period_s``: the prefix cache's block hashes."""
        return {"prefix_hashes": self._engine.engine.scheduler.prefix.cached_hashes()}

    async def check_health(self) -> None:
        await self._engine.check_engine_thread(HEALTH_PING_TIMEOUT_S)

    def report(self) -> ReplicaReport:
        """This replica's health and metric families, as pushed to the hub."""
        prefix = self._engine.engine.scheduler.prefix
        health = {**self._engine.health(),
                  "prefix_cache": {"queries": prefix.queries, "hits": prefix.hits,
                                   "cached_blocks": len(prefix.by_hash)}}
        return ReplicaReport(self._replica, self._actor_name, self._interval, health,
                             list(self._engine.metrics.registry.collect()))

    async def _report_forever(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._hub.push.remote(self.report()), timeout=10 * self._interval)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the hub restarting: the next report goes through
                log.warning("report to the hub failed: %s: %s", type(e).__name__, e)
            await asyncio.sleep(self._interval)

    def __del__(self) -> None:
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:
            reporter.cancel()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.shutdown()
