"""The built-in dashboard: the recorder's bounded history and percentiles, /dashboard/data auth,
a self-contained page, and a headless-Chromium render after real traffic (heatmap has content).

``SFCL_DASHBOARD_PNG=docs/dashboard.png python -m pytest -q tests/test_dashboard.py -k chromium``
also writes the screenshot used in the README.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from sfcl.engine.events import AnchorHit, Finished, SnapshotEvent, TextDelta
from sfcl.server import create_app
from sfcl.server.dashboard import N_BUCKETS, DashboardRecorder
from sfcl.server.testing import FakeEngine, serve_in_thread

CHROMIUM = shutil.which("chromium") or ("/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else None)


def snap(anchor_id: int, trigger: str = "entity_low_confidence", text: str = "clause") -> SnapshotEvent:
    return SnapshotEvent(snapshot_id=0, token_index=0, trigger=trigger, triggers=[trigger], anchor_id=anchor_id,
                         confidence=0.6, token="x", token_logprob=-1.0, entropy=1.0,
                         top=[AnchorHit(anchor_id, 0.85, "domain", {"doc_id": "nda-1", "start": 5, "end": 40,
                                                                    "text": text})])


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_heatmap_columns_buckets_and_window():
    clock = Clock()
    rec = DashboardRecorder(interval_s=10, n_intervals=3, n_anchors=64, clock=clock)
    obs = rec.observer("r1", tag="high-risk", mode="triggered")
    obs(snap(0))
    obs(snap(63, "surprisal_deviation"))
    clock.t += 10
    obs(snap(2))
    obs(snap(3))
    d = rec.data()
    cols = d["heatmap"]["columns"]
    assert len(cols) == 3 and all(len(c) == N_BUCKETS for c in cols)
    # anchor ids 0..63 over 32 rows: 2 ids per row
    assert cols[1][0] == 1 and cols[1][31] == 1 and cols[2][1] == 2 and sum(map(sum, cols)) == 4
    assert d["trigger_rate_per_min"]["entity_low_confidence"] == [0.0, 6.0, 12.0]  # per 10 s -> per min
    assert d["trigger_rate_per_min"]["surprisal_deviation"] == [0.0, 6.0, 0.0]
    clock.t += 25  # the first interval leaves the 3-interval window; the latest snapshots stay listed
    d = rec.data()
    assert sum(map(sum, d["heatmap"]["columns"])) == 2 and len(rec.anchors) == 1
    assert [s["anchor_id"] for s in d["snapshots"]] == [3, 2, 63, 0]  # newest first
    assert d["snapshots"][0]["tag"] == "high-risk" and d["snapshots"][0]["top"][0]["span"]["doc_id"] == "nda-1"


def test_unknown_library_size_scales_rows_to_the_largest_anchor_id():
    rec = DashboardRecorder(n_anchors=0)
    obs = rec.observer("r")
    obs(snap(100))
    obs(snap(1000))  # ids up to 1000 -> range 1024, 32 ids per row
    cols = rec.data()["heatmap"]["columns"]
    assert rec.data()["heatmap"]["id_range"] == 1024
    assert cols[-1][100 // 32] == 1 and cols[-1][1000 // 32] == 1


def test_bounded_history_and_long_spans():
    rec = DashboardRecorder(max_snapshots=5, max_requests=3)
    obs = rec.observer("r")
    for i in range(20):
        obs(snap(i, text="y" * 1000))
    for _ in range(10):
        rec.observer("q")(Finished("end_turn", None, 1, 2, {"mode": "triggered"}, ttft_ms=5.0, e2e_ms=9.0))
    d = rec.data()
    assert len(d["snapshots"]) == 5 and len(d["snapshots"][0]["top"][0]["span"]["text"]) == 241
    assert d["latency_ms"]["e2e"]["n"] == 3 and d["totals"]["finished_requests"] == 10
    assert d["totals"]["snapshots"] == 20


def test_percentiles_from_engine_timings():
    rec = DashboardRecorder()
    for k in range(1, 101):  # TTFT 1..100 ms, e2e 10x, gaps k and 2k ms
        fin = Finished("end_turn", None, 3, 3, {"mode": "off"}, ttft_ms=float(k), e2e_ms=10.0 * k,
                       token_gaps_ms=[float(k), 2.0 * k], tag="high-risk" if k % 2 else None)
        rec.observer(f"r{k}", tag=fin.tag)(fin)
    lat = rec.data()["latency_ms"]
    ttft = np.arange(1, 101, dtype=float)
    assert lat["ttft"] == {"n": 100, "p50": 50.5, "p95": round(float(np.percentile(ttft, 95)), 3),
                           "p99": round(float(np.percentile(ttft, 99)), 3)}
    assert lat["itl"]["n"] == 200 and lat["e2e"]["p50"] == 505.0
    assert lat["e2e_by_tag"]["high-risk"]["n"] == 50 and lat["e2e_by_tag"]["none"]["n"] == 50
    assert lat["e2e_by_tag"]["high-risk"]["p50"] == 500.0  # odd k: 10, 30, ..., 990


def test_server_side_timings_when_the_engine_reports_none():
    rec = DashboardRecorder()
    obs = rec.observer("r")
    for i in range(3):
        obs(TextDelta("w ", i))
        time.sleep(0.01)
    obs(Finished("end_turn", None, 1, 3, {"mode": "off"}))  # no ttft/e2e/gaps from the engine
    lat = rec.data()["latency_ms"]
    assert lat["ttft"]["n"] == 1 and lat["ttft"]["p50"] >= 0
    assert lat["itl"]["n"] == 2 and lat["itl"]["p50"] >= 10.0 * 0.9  # slept 10 ms between deltas
    assert lat["e2e"]["p50"] >= 20.0 * 0.9 and rec.data()["totals"]["live_requests"] == 0


def post(url: str, key: str, mode: str, max_tokens: int, tag: str | None = None, stream: bool = False,
         openai: bool = False) -> None:
    headers = {"x-api-key": key, "x-sfcl-snapshot": mode}
    if tag:
        headers["x-sfcl-tag"] = tag
    body = {"model": "default", "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": "Summarise the NDA."}]}
    r = httpx.post(url + ("/v1/chat/completions" if openai else "/v1/messages"), json=body, headers=headers,
                   timeout=30)
    assert r.status_code == 200, r.text


def test_data_endpoint_needs_the_key_and_page_is_self_contained():
    eng = FakeEngine()
    with serve_in_thread(create_app(eng, api_key="sekret")) as url:
        page = httpx.get(url + "/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "<canvas id=\"heatmap\"" in page.text
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", page.text)  # nothing from a CDN
        assert "@import" not in page.text and "url(" not in page.text
        assert httpx.get(url + "/dashboard/data").status_code == 401
        assert httpx.get(url + "/dashboard/data?key=wrong").status_code == 401
        post(url, "sekret", "always", 5, tag="high-risk")
        post(url, "sekret", "triggered", 12, stream=True, openai=True)
        for auth in ({"params": {"key": "sekret"}}, {"headers": {"x-api-key": "sekret"}},
                     {"headers": {"authorization": "Bearer sekret"}}):
            r = httpx.get(url + "/dashboard/data", **auth)
            assert r.status_code == 200
        d = r.json()
        # always: 5 snapshots; triggered every 4th token of 12: 3 snapshots
        assert d["totals"]["snapshots"] == 8 and d["totals"]["finished_requests"] == 2
        assert sum(map(sum, d["heatmap"]["columns"])) == 8
        assert d["trigger_rate_per_min"].keys() == {"always", "entity_low_confidence"}
        assert d["snapshots"][0]["trigger"] == "entity_low_confidence" and d["snapshots"][-1]["tag"] == "high-risk"
        assert d["latency_ms"]["e2e_by_tag"].keys() == {"high-risk", "none"}
        eng.busy = True  # a refused request leaves nothing behind in the recorder
        assert httpx.post(url + "/v1/messages", headers={"x-api-key": "sekret"}, json={
            "model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}).status_code == 529
        d = httpx.get(url + "/dashboard/data", params={"key": "sekret"}).json()
        assert d["totals"]["live_requests"] == 0 and d["totals"]["finished_requests"] == 2


def chromium(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1280,900",
                           "--virtual-time-budget=8000", *args], capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (Debian package `chromium`; "
                                             ".ci/run installs it when running as root)")
def test_chromium_renders_a_live_heatmap_after_traffic(tmp_path):
    from PIL import Image

    eng = FakeEngine(reply=" ".join(f"w{i}" for i in range(64)))
    app = create_app(eng, api_key="sekret")
    app.state.dashboard = DashboardRecorder(interval_s=1.0, n_intervals=60)  # several columns in a short test
    with serve_in_thread(app) as url:
        for i in range(8):  # traffic over a few seconds: both routes, streamed or not, tagged or not
            post(url, "sekret", "always", 6 + 7 * i, tag="high-risk" if i % 2 else None, stream=i % 3 == 0)
            post(url, "sekret", "triggered", 64, openai=True, stream=i % 2 == 0)
            time.sleep(0.4)
        d = httpx.get(url + "/dashboard/data", params={"key": "sekret"}).json()
        expected_cells = sum(1 for c in d["heatmap"]["columns"] for v in c if v)
        assert expected_cells > 0
        page = url + "/dashboard#key=sekret"
        dom = chromium("--dump-dom", page)
        shot = tmp_path / "dashboard.png"
        chromium(f"--screenshot={shot}", page)
    assert dom.returncode == 0, dom.stderr[-2000:]
    canvas = re.search(r'<canvas id="heatmap"[^>]*>', dom.stdout)
    assert canvas, dom.stdout[:2000]
    attrs = dict(re.findall(r'([\w-]+)="([^"]*)"', canvas.group(0)))
    assert int(attrs["data-nonempty-cells"]) == expected_cells  # the page drew what the server holds
    assert int(attrs["data-updates"]) >= 2  # it polled again (live refresh)
    snaps = re.search(r'<table id="snaptable">.*?<tbody>(.*?)</tbody>', dom.stdout, re.S)
    assert snaps and snaps.group(1).count("<tr>") == min(12, len(d["snapshots"]))  # latest snapshots listed
    assert "anchor text 0" in snaps.group(1)  # with their anchor spans
    lat = re.search(r'<table id="latency">.*?<tbody>(.*?)</tbody>', dom.stdout, re.S)
    assert lat and lat.group(1).count("<tr>") == 3  # TTFT, ITL, end-to-end

    assert shot.is_file(), "chromium wrote no screenshot"
    img = np.asarray(Image.open(shot).convert("RGB")).astype(int)  # (900, 1280, 3)
    assert img.shape[:2] == (900, 1280)
    x, y, w, h = (int(v) for v in attrs["data-rect"].split(","))
    area = img[y:y + h, x:x + w]
    coloured = (area.max(axis=2) - area.min(axis=2)) > 60  # viridis cells; empty cells and text are grey
    assert coloured.sum() >= expected_cells * 20, coloured.sum()  # each cell is ~10x8 px
    assert coloured.mean() < 0.9  # and not everything: empty cells stay grey
    out = os.environ.get("SFCL_DASHBOARD_PNG")
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, out)


@pytest.mark.slow
def test_real_server_feeds_dashboard_and_mode_labels(server, nda_library):
    """The real engine (SmolLM2 + NDA anchors): every-token snapshots reach /dashboard/data with real
    anchor spans, rows are scaled to the library size, and /metrics labels lookups by mode."""
    from prometheus_client.parser import text_string_to_metric_families

    url, _ = server
    r = httpx.post(url + "/v1/messages", headers={"x-sfcl-snapshot": "always", "x-sfcl-tag": "high-risk"},
                   timeout=120, json={"model": "default", "max_tokens": 6, "temperature": 0,
                                      "messages": [{"role": "user", "content": "What is confidential?"}]})
    assert r.status_code == 200
    n = r.json()["usage"]["output_tokens"]
    d = httpx.get(url + "/dashboard/data").json()
    assert d["heatmap"]["id_range"] == nda_library.n_anchors
    mine = [s for s in d["snapshots"] if s["request_id"] == r.json()["id"]]
    assert len(mine) == min(n, 25) and all(s["mode"] == "always" and s["tag"] == "high-risk" for s in mine)
    span = mine[0]["top"][0]["span"]
    assert span["doc_id"] and span["end"] > span["start"] and span["text"]
    assert d["latency_ms"]["e2e_by_tag"]["high-risk"]["n"] >= 1 and d["latency_ms"]["ttft"]["p50"] > 0
    samples = [s for f in text_string_to_metric_families(httpx.get(url + "/metrics").text) for s in f.samples
               if s.name == "sfcl_snapshot_lookups_total"]
    assert sum(s.value for s in samples if s.labels["mode"] == "always") >= n
    assert all(s.labels["mode"] in ("triggered", "always") for s in samples)  # never "unknown" on the engine
