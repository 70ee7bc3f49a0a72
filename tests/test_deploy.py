"""deploy/: the Grafana dashboard is well-formed and every PromQL query names a series the server
exports (scraped from /metrics after traffic); the Prometheus scrape example parses."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from sfcl.cluster.reports import ReplicaReport, render_metrics
from sfcl.engine.engine import StepStats
from sfcl.engine.events import AnchorHit, ErrorEvent, Finished, SnapshotEvent
from sfcl.metrics import PrometheusStatLogger
from sfcl.server import create_app
from sfcl.server.testing import FakeEngine, serve_in_thread
from tests.test_metrics import FakeNvml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "sfcl.json"

# PromQL words that are not metric names (functions, aggregations, keywords) and Grafana macros.
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by",
    "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
    "label_replace", "clamp_min", "clamp_max", "topk", "bottomk", "label_values", "abs",
    "__rate_interval", "__interval", "__range", "tag", "replica",  # $tag, $replica: dashboard variables
}
SERIES_PANELS = {"timeseries", "stat", "heatmap", "gauge", "bargauge", "table"}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """Sample name -> label names, scraped from GET /metrics after traffic of every kind (snapshots,
    tagged and untagged requests, an error, prefix-cache stats) on a server with a (fake) GPU."""
    mp = pytest.MonkeyPatch()
    mp.setitem(sys.modules, "pynvml", FakeNvml())
    mp.setattr(torch.cuda, "is_available", lambda: True)
    try:
        m = PrometheusStatLogger(snapshots_enabled=True, n_anchors=2048, price_per_hour=2.0, kv_slots=4)
    finally:
        mp.undo()
    m.watch_queue(lambda: 1, lambda: 0)
    hit = AnchorHit(700, 0.91, "domain", {"doc_id": "d", "start": 0, "end": 9, "text": "t"})
    snap = SnapshotEvent(snapshot_id=0, token_index=3, trigger="surprisal_deviation",
                         triggers=["surprisal_deviation"], anchor_id=700, confidence=0.8, token="x",
                         token_logprob=-2.0, entropy=1.5, top=[hit], lookup_ms=0.3)
    fins = [Finished("end_turn", None, prompt_tokens=12, completion_tokens=5, snapshot_summary={"mode": mode},
                     ttft_ms=80.0, queue_ms=5.0, e2e_ms=400.0, token_gaps_ms=[60.0, 90.0, 75.0], tag=tag)
            for mode, tag in (("triggered", "high-risk"), ("always", None))]
    m.log(StepStats(prefill_tokens=12, generated=1, prefix_cache_queries=12, prefix_cache_hits=8, step_ms=30.0),
          [("a", snap), ("b", snap)])
    m.log(StepStats(generated=2, lookups=1, lookup_ms=0.3, step_ms=8.0),
          [("a", fins[0]), ("b", fins[1]), ("c", ErrorEvent("x"))])
    eng = FakeEngine()
    eng.metrics = m
    with serve_in_thread(create_app(eng, api_key="k")) as url:
        text = httpx.get(url + "/metrics", headers={"authorization": "Bearer k"}).text
    # the same series as `sfcl serve --replicas N` exports them: one per engine replica, label `replica`
    cluster = render_metrics([ReplicaReport("r1", "SERVE_REPLICA::r1", 1.0, {}, list(m.registry.collect()))])
    names: dict[str, set[str]] = {}
    for exposition in (text, cluster.decode()):
        for fam in text_string_to_metric_families(exposition):
            for s in fam.samples:  # sample names carry the _total/_bucket/_sum/_count suffixes
                names.setdefault(s.name, set()).update(s.labels)
    return names


def targets(dashboard: dict):
    for p in dashboard["panels"]:
        for t in p.get("targets", []):
            yield p, t["expr"]
    for v in dashboard["templating"]["list"]:
        if v["type"] == "query":
            yield v, v["query"]["query"] if isinstance(v["query"], dict) else v["query"]


def parse_promql(expr: str) -> tuple[list[tuple[str, set[str]]], set[str], set[str]]:
    """-> ([(metric, labels matched in its {...})], labels in by/without (...), other identifiers)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors [5m], [$__rate_interval]
    selectors = []
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", e):
        selectors.append((m.group(1), set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", m.group(2)))))
    e = re.sub(r"\{[^}]*\}", "", e)
    grouping: set[str] = set()
    for m in re.finditer(r"\b(?:by|without)\s*\(([^)]*)\)", e):
        grouping.update(x.strip() for x in m.group(1).split(",") if x.strip())
    e = re.sub(r"\b(?:by|without)\s*\([^)]*\)", "", e)
    idents = set(re.findall(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*", re.sub(r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?", "", e)))
    idents |= {s[0] for s in selectors}
    return selectors, grouping, idents


def test_dashboard_is_importable_grafana_json(dashboard):
    assert dashboard["title"] and dashboard["uid"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    boxes = []
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "hwxy") and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for (x, y, w, h, other) in boxes:  # no two panels overlap on the 24-column grid
            assert not (g["x"] < x + w and x < g["x"] + g["w"] and g["y"] < y + h and y < g["y"] + g["h"]), \
                (p["title"], other)
        boxes.append((g["x"], g["y"], g["w"], g["h"], p["title"]))
        if p["type"] == "row":
            continue
        assert p["type"] in SERIES_PANELS and p["title"]
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["expr"].strip() for t in p["targets"])
        assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    heat = [p for p in dashboard["panels"] if p["type"] == "heatmap"]
    assert len(heat) == 1 and "sfcl_snapshots_by_anchor_bucket_total" in heat[0]["targets"][0]["expr"]
    assert "by (bucket)" in heat[0]["targets"][0]["expr"] and heat[0]["targets"][0]["legendFormat"] == "{{bucket}}"


def test_every_query_names_exported_series(dashboard, exported):
    assert "sfcl_requests_total" in exported and "sfcl_gpu_utilization_ratio" in exported
    used: set[str] = set()
    for where, expr in targets(dashboard):
        selectors, grouping, idents = parse_promql(expr)
        metrics = {i for i in idents if i not in PROMQL_WORDS}
        assert metrics, f"{expr!r} names no series"
        unknown = metrics - exported.keys()
        assert not unknown, f"{where.get('title') or where.get('name')}: {sorted(unknown)} not exported"
        for name, labels in selectors:
            assert labels <= exported[name], f"{name}: labels {labels - exported[name]} not exported"
        available = set().union(*(exported[n] for n in metrics))
        assert grouping <= available, f"{expr!r}: grouping labels {grouping - available} not on its series"
        used |= metrics
    # the views the issue asks for
    for name in ("sfcl_snapshots_by_anchor_bucket_total", "sfcl_snapshot_lookups_total",
                 "sfcl_time_to_first_token_seconds_bucket", "sfcl_inter_token_latency_seconds_bucket",
                 "sfcl_e2e_request_latency_seconds_bucket", "sfcl_anchor_hits_total", "sfcl_anchor_lookups_total",
                 "sfcl_cost_per_1k_tokens_dollars", "sfcl_requests_per_device_hour", "sfcl_num_requests_running",
                 "sfcl_num_requests_waiting", "sfcl_kv_cache_usage_ratio", "sfcl_prefix_cache_hits_total",
                 "sfcl_prefix_cache_queries_total", "sfcl_gpu_memory_used_bytes"):
        assert name in used, f"no panel shows {name}"
    exprs = [e for _, e in targets(dashboard)]
    assert any('tag="high-risk"' in e and "histogram_quantile(0.99" in e for e in exprs)
    assert any("by (trigger)" in e and "* 60" in e for e in exprs)  # trigger rate per minute


def test_every_series_can_be_narrowed_to_one_replica(dashboard):
    """One added variable, `replica`: all of a cluster's replicas by default, which also matches a
    single server's series (they have no `replica` label, and ".*" matches the empty value)."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    rep = variables["replica"]
    assert rep["includeAll"] and rep["allValue"] == ".*" and "replica" in rep["query"]["query"]
    for p, expr in targets(dashboard):
        if "name" in p:  # template variables list label values, they select no panel data
            continue
        selectors, _, _ = parse_promql(expr)
        assert selectors and all("replica" in labels for _, labels in selectors), (p.get("title"), expr)
        assert expr.count('replica=~"$replica"') == len(selectors)


def test_promql_parser_catches_unknown_names(exported):
    """The check above can fail: a misspelt series or label is reported."""
    _, _, idents = parse_promql('sum by (le) (rate(sfcl_ttft_seconds_bucket{tag="x"}[5m]))')
    assert {i for i in idents if i not in PROMQL_WORDS} - exported.keys() == {"sfcl_ttft_seconds_bucket"}
    sel, grouping, _ = parse_promql('sum by (trigger, zone) (rate(sfcl_snapshot_lookups_total{mode="always"}[1m]))')
    assert sel == [("sfcl_snapshot_lookups_total", {"mode"})] and grouping == {"trigger", "zone"}
    assert "zone" not in exported["sfcl_snapshot_lookups_total"]


def test_prometheus_scrape_example():
    yaml = pytest.importorskip("yaml")
    text = (DEPLOY / "prometheus.yml").read_text(encoding="utf-8")
    cfg = yaml.safe_load(text)
    job = cfg["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
    assert job["authorization"]["type"] == "Bearer" and job["authorization"]["credentials_file"]
    assert "--metrics-port" in text  # the key-less alternative is documented
