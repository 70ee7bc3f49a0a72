"""What engine replicas tell the rest of the cluster, and how the ingress merges it (no Ray here).

* ``ReplicaInfo``: fixed facts the ingress needs once (model id, context window, whether snapshots
  are available, KV block size for prefix hashes, the tokenizer itself).
* ``ReplicaReport``: pushed by every replica every ``report_interval_s`` to the ``ReportHub``
  deployment: its health (``AsyncEngine.health()`` plus prefix-cache counters) and its Prometheus
  metric families (``prometheus_client`` ``Metric`` objects, collected from its own registry).
* ``render_metrics``: the families of all replicas as one Prometheus exposition, every sample
  labelled ``replica="<Serve replica id>"`` (one family per name, as the format requires).
* ``cluster_health``: the ``/health`` body of the cluster (sums plus one entry per replica).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric

REPLICA_LABEL = "replica"


@dataclass(slots=True)
class ReplicaInfo:
    model_name: str  # id reported by /v1/models
    max_model_len: int  # context window, tokens
    snapshots_available: bool  # an anchor library is loaded
    block_size: int  # KV block size, tokens (the prefix hashes' granularity)
    prefix_caching: bool  # the engine keeps a prefix cache (else affinity has nothing to follow)
    n_anchors: int  # anchor library size (0 without one), for the dashboard's anchor-id buckets
    tokenizer: Any  # the engine's transformers tokenizer (the ingress tokenizes with it)


@dataclass(slots=True)
class ReplicaReport:
    replica: str  # Serve replica id (``ReplicaID.unique_id``): the ``replica`` label
    actor_name: str  # Ray actor name of the replica (``ray.get_actor(name, namespace="serve")``)
    interval_s: float  # the replica reports this often; the hub drops it after 3 missed reports
    health: dict  # AsyncEngine.health() + {"prefix_cache": {"queries", "hits", "cached_blocks"}}
    families: list[Metric] = field(default_factory=list)  # its registry's collect()
    sent_at: float = field(default_factory=time.time)  # wall clock, seconds


class _Families:
    """A registry-like object over fixed families (what ``generate_latest`` needs)."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def merge_families(reports: Iterable[ReplicaReport]) -> list[Metric]:
    """Every replica's families merged by name, each sample labelled ``replica``."""
    merged: dict[str, Metric] = {}
    for rep in sorted(reports, key=lambda r: r.replica):
        for fam in rep.families:
            m = merged.get(fam.name)
            if m is None:
                m = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            m.samples.extend(s._replace(labels={**s.labels, REPLICA_LABEL: rep.replica}) for s in fam.samples)
    return list(merged.values())


def render_metrics(reports: Iterable[ReplicaReport]) -> bytes:
    """Prometheus text exposition of ``merge_families(reports)``."""
    return generate_latest(_Families(merge_families(reports)))


def cluster_health(info: ReplicaInfo, reports: list[ReplicaReport], router: str) -> dict:
    """``/health`` of the cluster: model facts, totals, and each live replica's own health.
    Raises RuntimeError when no replica has reported recently (the endpoint then answers 503)."""
    if not reports:
        raise RuntimeError("no engine replica has reported recently")
    now = time.time()
    replicas = [{"replica": r.replica, "actor_name": r.actor_name, "reported_at": r.sent_at,
                 "report_age_s": round(max(0.0, now - r.sent_at), 2), **r.health}
                for r in sorted(reports, key=lambda r: r.replica)]
    return {"model": info.model_name, "max_model_len": info.max_model_len,
            "snapshots_available": info.snapshots_available, "router": router, "n_replicas": len(replicas),
            "running": sum(int(r.get("running", 0)) for r in replicas),
            "waiting": sum(int(r.get("waiting", 0)) for r in replicas), "replicas": replicas}
