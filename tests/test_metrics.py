"""The stat logger turns engine records into Prometheus series; /metrics honours the API key."""

import sys
import types

import httpx
import torch

from sfcl.engine.engine import StepStats
from sfcl.engine.events import AnchorHit, ErrorEvent, Finished, SnapshotEvent
from sfcl.metrics import PrometheusStatLogger
from sfcl.server import create_app
from sfcl.server.testing import FakeEngine, serve_in_thread


def value(text: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
               or line.startswith(name + "{"))


def snap(trigger):
    return SnapshotEvent(snapshot_id=0, token_index=0, trigger=trigger, triggers=[trigger], anchor_id=1,
                         confidence=0.5, token="x", token_logprob=-1.0, entropy=1.0,
                         top=[AnchorHit(1, 0.9, "general", {})])


def test_step_records_become_series():
    m = PrometheusStatLogger(snapshots_enabled=False, known_tags=("high-risk",), n_anchors=64, kv_slots=4,
                             price_per_hour=3.6)
    m.watch_queue(lambda: 3, lambda: 7)
    fin = Finished("max_tokens", None, prompt_tokens=11, completion_tokens=4, snapshot_summary={}, ttft_ms=250.0,
                   queue_ms=40.0, e2e_ms=900.0, token_gaps_ms=[100.0, 300.0, 200.0], tag="high-risk")
    other = Finished("end_turn", None, prompt_tokens=5, completion_tokens=1, snapshot_summary={}, tag="weird-tag")
    m.watch_requests({"a": "triggered"}.get)  # "b" is unknown to the engine
    m.log(StepStats(generated=2, lookups=1, lookup_ms=2.0, prefix_cache_queries=40, prefix_cache_hits=32,
                    decode_batch=2, step_ms=7.5), [("a", snap("entity_low_confidence")), ("b", snap("always"))])
    m.log(StepStats(generated=1, prefix_cache_queries=8, prefill_tokens=8, step_ms=40.0),
          [("a", fin), ("c", ErrorEvent("x")), ("d", other)])
    t = m.render().decode()
    assert value(t, "sfcl_generation_tokens_total") == 3 and value(t, "sfcl_engine_steps_total") == 2
    assert 'sfcl_snapshot_lookups_total{mode="triggered",trigger="entity_low_confidence"} 1.0' in t
    assert 'sfcl_snapshot_lookups_total{mode="unknown",trigger="always"} 1.0' in t
    assert value(t, "sfcl_prefix_cache_queries_total") == 48 and value(t, "sfcl_prefix_cache_hits_total") == 32
    assert 'sfcl_requests_total{status="max_tokens",tag="high-risk"} 1.0' in t
    assert 'sfcl_requests_total{status="end_turn",tag="other"} 1.0' in t  # unknown tags are bounded
    assert 'sfcl_requests_total{status="error",tag="none"} 1.0' in t
    assert value(t, "sfcl_prompt_tokens_total") == 16 and value(t, "sfcl_time_to_first_token_seconds_count") == 2
    assert 'sfcl_inter_token_latency_seconds_count{tag="high-risk"} 3.0' in t
    assert 'sfcl_inter_token_latency_seconds_sum{tag="high-risk"} 0.6' in t
    # population variance of 100/300/200 ms = 6666.7 ms^2 = 0.0066667 s^2
    assert abs(value(t, 'sfcl_token_gap_variance_seconds2_sum{tag="high-risk"}') - 0.0066667) < 1e-6
    assert 'sfcl_request_queue_time_seconds_sum{tag="high-risk"} 0.04' in t
    assert 'sfcl_e2e_request_latency_seconds_sum{tag="high-risk"} 0.9' in t
    assert value(t, "sfcl_anchor_lookups_total") == 2 and value(t, "sfcl_anchor_hits_total") == 2  # score 0.9
    assert 'sfcl_snapshots_by_anchor_bucket_total{bucket="00"} 2.0' in t  # anchor 1 of 64 -> bucket 0
    assert "sfcl_kv_cache_usage_ratio 0.75" in t and value(t, "sfcl_cost_per_1k_tokens_dollars") > 0
    assert value(t, "sfcl_snapshot_lookup_seconds_sum") == 0.002
    assert 'sfcl_engine_step_seconds_sum{kind="decode"} 0.0075' in t  # decode rows only
    assert 'sfcl_engine_step_seconds_sum{kind="prefill"} 0.04' in t  # with prompt tokens
    assert 'sfcl_engine_step_seconds_bucket{kind="decode",le="0.008"} 1.0' in t
    assert "sfcl_num_requests_running 3.0" in t and "sfcl_num_requests_waiting 7.0" in t
    assert "sfcl_snapshots_enabled 0.0" in t


def test_metrics_route_requires_the_api_key_when_set():
    eng = FakeEngine()
    eng.metrics = PrometheusStatLogger(snapshots_enabled=True)
    with serve_in_thread(create_app(eng, api_key="sekret")) as url:
        assert httpx.get(url + "/metrics").status_code == 401
        r = httpx.get(url + "/metrics", headers={"authorization": "Bearer sekret"})
        assert r.status_code == 200 and "sfcl_snapshots_enabled 1.0" in r.text
        assert httpx.get(url + "/health").status_code == 200  # health stays open for probes


def test_lookup_mode_comes_from_the_finished_record_of_the_same_step():
    """A request that finished in the step is gone from the engine; its Finished carries the mode."""
    m = PrometheusStatLogger(snapshots_enabled=True)
    m.watch_requests(lambda rid: None)
    fin = Finished("end_turn", None, prompt_tokens=1, completion_tokens=1, snapshot_summary={"mode": "always"})
    m.log(StepStats(generated=1), [("r", snap("always")), ("r", fin)])
    assert 'sfcl_snapshot_lookups_total{mode="always",trigger="always"} 1.0' in m.render().decode()


class FakeNvml:
    """Stands in for ``pynvml`` (nvidia-ml-py): two devices, the second one failing."""

    class NVMLError(Exception):
        pass

    def __init__(self):
        self.init_calls = 0
        self.util = 37

    def nvmlInit(self):
        self.init_calls += 1

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        if i == 1:
            raise self.NVMLError("GPU is lost")
        return ("handle", i)

    def nvmlDeviceGetUtilizationRates(self, h):
        return types.SimpleNamespace(gpu=self.util, memory=10)

    def nvmlDeviceGetMemoryInfo(self, h):
        return types.SimpleNamespace(used=3 * 2**30, total=80 * 2**30, free=77 * 2**30)


def test_gpu_gauges_from_nvml_are_read_at_scrape_time(monkeypatch):
    fake = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    m = PrometheusStatLogger(snapshots_enabled=True)
    t = m.render().decode()
    assert fake.init_calls == 1
    assert 'sfcl_gpu_utilization_ratio{gpu="0"} 0.37' in t
    assert value(t, 'sfcl_gpu_memory_used_bytes{gpu="0"}') == 3 * 2**30
    assert 'gpu="1"' not in t  # a failing device is left out, the scrape still works
    fake.util = 90
    assert 'sfcl_gpu_utilization_ratio{gpu="0"} 0.9' in m.render().decode()  # refreshed per scrape


def test_no_gpu_series_without_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    t = PrometheusStatLogger(snapshots_enabled=True).render().decode()
    assert "sfcl_gpu_" not in t


def test_no_gpu_series_without_nvidia_ml_py(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    t = PrometheusStatLogger(snapshots_enabled=True).render().decode()
    assert "sfcl_gpu_" not in t
