"""sfcl.cluster.reports: per-replica metrics merged into one exposition, cluster health."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sfcl.cluster.reports import ReplicaInfo, ReplicaReport, cluster_health, render_metrics
from sfcl.engine.engine import StepStats
from sfcl.engine.events import Finished
from sfcl.metrics import PrometheusStatLogger


def replica_report(name: str, prompt_tokens: int, hits: int, running: int) -> ReplicaReport:
    m = PrometheusStatLogger(snapshots_enabled=True, n_anchors=64, gpu=False)
    m.watch_queue(lambda: running, lambda: 0)
    fin = Finished("end_turn", None, prompt_tokens=prompt_tokens, completion_tokens=3, snapshot_summary={},
                   ttft_ms=50.0, e2e_ms=90.0, token_gaps_ms=[20.0, 20.0])
    m.log(StepStats(generated=1, prefix_cache_queries=prompt_tokens, prefix_cache_hits=hits), [("a", fin)])
    return ReplicaReport(name, f"SERVE_REPLICA::{name}", 0.5, {"running": running, "waiting": 1},
                         list(m.registry.collect()))


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text.decode()):  # fails on a second TYPE line for one name
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_every_series_is_kept_per_replica_under_one_family():
    text = render_metrics([replica_report("b2", 40, 32, 1), replica_report("a1", 100, 0, 0)])
    got = samples(text)
    assert got[("sfcl_prefix_cache_hits_total", (("replica", "b2"),))] == 32
    assert got[("sfcl_prefix_cache_hits_total", (("replica", "a1"),))] == 0
    assert got[("sfcl_prefix_cache_queries_total", (("replica", "a1"),))] == 100
    assert got[("sfcl_num_requests_running", (("replica", "b2"),))] == 1
    assert got[("sfcl_requests_total", (("replica", "a1"), ("status", "end_turn"), ("tag", "none")))] == 1
    assert text.decode().count("# TYPE sfcl_prefix_cache_hits_total counter") == 1
    buckets = [k for k in got if k[0] == "sfcl_time_to_first_token_seconds_bucket"]
    assert {dict(k[1])["replica"] for k in buckets} == {"a1", "b2"}


def test_cluster_health_sums_the_replicas_and_lists_each():
    info = ReplicaInfo("m", 2048, True, 16, True, 64, tokenizer=None)
    h = cluster_health(info, [replica_report("b2", 1, 0, 2), replica_report("a1", 1, 0, 1)], "affinity")
    assert (h["n_replicas"], h["running"], h["waiting"], h["router"]) == (2, 3, 2, "affinity")
    assert [r["replica"] for r in h["replicas"]] == ["a1", "b2"]
    assert 0 <= h["replicas"][0]["report_age_s"] < 60
    old = replica_report("c3", 1, 0, 0)
    old.sent_at = time.time() - 5
    assert cluster_health(info, [old], "pow2")["replicas"][0]["report_age_s"] >= 5
    with pytest.raises(RuntimeError):  # /health answers 503
        cluster_health(info, [], "affinity")
