"""The built-in live dashboard: ``GET /dashboard`` (a self-contained HTML page) and
``GET /dashboard/data`` (its JSON), for operators without Prometheus and Grafana.

Data comes from the server itself: ``start_generation`` (``sfcl.server.generation``) attaches an
observer from ``DashboardRecorder.observer`` to each request's engine stream, so every event the
HTTP layer reads is also seen here, on the event loop (no locks; nothing touches the engine).
Everything kept is bounded: per-interval snapshot counts for a sliding window
(``n_intervals x interval_s`` seconds, by best-anchor id and by trigger), the latest
``max_snapshots`` snapshots with their anchor spans, and the timings of the latest
``max_requests`` finished requests, from which TTFT / inter-token / end-to-end percentiles are
computed on each poll.

Timings are the engine's own (``Finished.ttft_ms``, ``token_gaps_ms``, ``e2e_ms``); for an engine
that reports none (test doubles) they fall back to what the server saw: request start -> first
text delta, gaps between text deltas, start -> finish.

Auth: the page itself holds no data and is always served; ``/dashboard/data`` needs the API key
when the server has one, as ``x-api-key`` / ``Authorization: Bearer`` or ``?key=KEY``. The page
reads the key from its own URL fragment (``/dashboard#key=KEY``, never sent to the server or its
access log) and sends it as ``x-api-key``.
"""

from __future__ import annotations

import hmac
import math
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, Callable

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from starlette.responses import HTMLResponse, JSONResponse

from sfcl.engine.events import ErrorEvent, Finished, SnapshotEvent, TextDelta
from sfcl.server.auth import check_api_key
from sfcl.server.errors import error_style

N_BUCKETS = 32  # anchor-id ranges on the heatmap's y axis (as sfcl.metrics.N_ANCHOR_BUCKETS)
SPAN_CHARS = 240  # anchor span text kept per snapshot
MAX_GAPS_PER_REQUEST = 4096
QUANTILES = (50, 95, 99)


@dataclass(slots=True)
class _Live:
    """What the server saw of one request so far (fallback timings)."""

    tag: str | None
    mode: str
    start: float  # time.monotonic() at submission
    first_delta: float | None = None
    last_delta: float | None = None
    gaps_ms: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Done:
    """Timings of one finished request, milliseconds."""

    tag: str | None
    ttft_ms: float | None
    e2e_ms: float
    gaps_ms: list[float]
    tokens: int


class DashboardRecorder:
    """Bounded recent history of snapshots and finished requests for ``/dashboard/data``.

    interval_s: width of one heatmap / trigger-rate column (seconds); n_intervals: columns kept.
    max_snapshots: latest snapshots listed; max_requests: finished requests kept for percentiles.
    n_anchors: anchor-library size (rows are ``anchor_id * N_BUCKETS // n_anchors``); 0 = unknown,
    then the id range is the smallest power of two above the largest anchor id seen.
    clock: wall clock in seconds (``time.time``), injectable for tests.
    """

    def __init__(self, *, interval_s: float = 5.0, n_intervals: int = 72, max_snapshots: int = 25,
                 max_requests: int = 512, n_anchors: int = 0, clock: Callable[[], float] = time.time):
        if interval_s <= 0 or n_intervals < 1 or max_snapshots < 1 or max_requests < 1:
            raise ValueError("interval_s must be > 0 and n_intervals, max_snapshots, max_requests >= 1")
        self.interval_s, self.n_intervals = float(interval_s), int(n_intervals)
        self.n_anchors = int(n_anchors)
        self.clock = clock
        self.max_anchor_id = -1
        self.anchors: dict[int, Counter] = {}  # interval index -> Counter(anchor_id)
        self.triggers: dict[int, Counter] = {}  # interval index -> Counter(trigger)
        self.snapshots: deque[dict] = deque(maxlen=max_snapshots)
        self.done: deque[_Done] = deque(maxlen=max_requests)
        self.n_snapshots = 0
        self.n_finished = 0
        self.live: dict[str, _Live] = {}

    # -- recording (event loop) ---------------------------------------------------------------
    def observer(self, request_id: str, tag: str | None = None, mode: str = "triggered") -> "StreamObserver":
        """An observer to be called with every event of request ``request_id``'s stream, in
        order, and closed when the stream is closed."""
        live = _Live(tag=tag, mode=mode, start=time.monotonic())
        self.live[request_id] = live
        return StreamObserver(self, request_id, live)

    def _interval(self, t: float) -> int:
        return int(t // self.interval_s)

    def _prune(self, now_idx: int) -> None:
        oldest = now_idx - self.n_intervals + 1
        for d in (self.anchors, self.triggers):
            for k in [k for k in d if k < oldest]:
                del d[k]

    def record_snapshot(self, request_id: str, tag: str | None, mode: str, ev: SnapshotEvent) -> None:
        now = self.clock()
        idx = self._interval(now)
        self.anchors.setdefault(idx, Counter())[ev.anchor_id] += 1
        self.triggers.setdefault(idx, Counter())[ev.trigger] += 1
        self._prune(idx)
        self.max_anchor_id = max(self.max_anchor_id, ev.anchor_id)
        self.n_snapshots += 1
        top = []
        for h in ev.top[:3]:
            span = dict(getattr(h, "span", None) or {})
            if isinstance(span.get("text"), str) and len(span["text"]) > SPAN_CHARS:
                span["text"] = span["text"][:SPAN_CHARS] + "…"
            top.append({"anchor_id": h.anchor_id, "score": round(float(h.score), 4), "kind": h.kind,
                        "span": span})
        self.snapshots.appendleft({
            "time": now, "request_id": request_id, "tag": tag, "mode": mode,
            "snapshot_id": ev.snapshot_id, "token_index": ev.token_index, "token": ev.token,
            "trigger": ev.trigger, "triggers": list(ev.triggers), "anchor_id": ev.anchor_id,
            "confidence": round(float(ev.confidence), 4), "top": top,
        })

    def record_finished(self, live: _Live, ev: Finished) -> None:
        now = time.monotonic()
        ttft = ev.ttft_ms if ev.ttft_ms > 0 else (
            (live.first_delta - live.start) * 1e3 if live.first_delta is not None else None)
        if not ev.completion_tokens:
            ttft = None
        gaps = list(ev.token_gaps_ms) if ev.token_gaps_ms else live.gaps_ms
        e2e = ev.e2e_ms if ev.e2e_ms > 0 else (now - live.start) * 1e3
        self.done.append(_Done(tag=live.tag, ttft_ms=ttft, e2e_ms=e2e, gaps_ms=gaps[:MAX_GAPS_PER_REQUEST],
                               tokens=ev.completion_tokens))
        self.n_finished += 1

    # -- reading ------------------------------------------------------------------------------
    def id_range(self) -> int:
        """Anchor ids covered by the heatmap rows (N_BUCKETS rows of id_range / N_BUCKETS)."""
        if self.n_anchors > 0:
            return self.n_anchors
        return max(N_BUCKETS, 1 << math.ceil(math.log2(self.max_anchor_id + 1))) if self.max_anchor_id >= 0 \
            else N_BUCKETS

    def data(self) -> dict:
        """The JSON of ``/dashboard/data`` (see the module docstring for units)."""
        now = self.clock()
        now_idx = self._interval(now)
        self._prune(now_idx)
        idx = list(range(now_idx - self.n_intervals + 1, now_idx + 1))
        n = self.id_range()
        columns = []
        for i in idx:
            counts = [0] * N_BUCKETS
            for a, c in self.anchors.get(i, {}).items():
                counts[min(N_BUCKETS - 1, max(0, a) * N_BUCKETS // n)] += c
            columns.append(counts)
        names = sorted({t for i in idx for t in self.triggers.get(i, {})})
        per_min = 60.0 / self.interval_s
        rate = {t: [round(self.triggers.get(i, {}).get(t, 0) * per_min, 3) for i in idx] for t in names}
        done = list(self.done)
        by_tag: dict[str, list[float]] = {}
        for d in done:
            by_tag.setdefault(d.tag or "none", []).append(d.e2e_ms)
        return {
            "now": now,
            "interval_s": self.interval_s,
            "times": [i * self.interval_s for i in idx],  # start of each column, unix seconds
            "heatmap": {"n_buckets": N_BUCKETS, "id_range": n, "n_anchors": self.n_anchors,
                        "columns": columns},  # columns[t][bucket] = snapshots
            "trigger_rate_per_min": rate,
            "latency_ms": {
                "ttft": _percentiles([d.ttft_ms for d in done if d.ttft_ms is not None]),
                "itl": _percentiles([g for d in done for g in d.gaps_ms]),
                "e2e": _percentiles([d.e2e_ms for d in done]),
                "e2e_by_tag": {t: _percentiles(v) for t, v in sorted(by_tag.items())},
            },
            "snapshots": list(self.snapshots),
            "totals": {"snapshots": self.n_snapshots, "finished_requests": self.n_finished,
                       "requests_in_window": len(done), "live_requests": len(self.live)},
        }


class StreamObserver:
    """Feeds one request's events to its ``DashboardRecorder`` (``__call__``) and drops the
    request's live state when its stream is closed (``close``; a client gone early)."""

    def __init__(self, recorder: DashboardRecorder, request_id: str, live: _Live):
        self.recorder, self.request_id, self.live = recorder, request_id, live

    def __call__(self, ev: Any) -> None:
        live, rec = self.live, self.recorder
        if isinstance(ev, TextDelta):
            now = time.monotonic()
            if live.first_delta is None:
                live.first_delta = now
            elif len(live.gaps_ms) < MAX_GAPS_PER_REQUEST:
                live.gaps_ms.append((now - live.last_delta) * 1e3)
            live.last_delta = now
        elif isinstance(ev, SnapshotEvent):
            rec.record_snapshot(self.request_id, live.tag, live.mode, ev)
        elif isinstance(ev, Finished):
            rec.record_finished(live, ev)
            self.close()
        elif isinstance(ev, ErrorEvent):
            self.close()

    def close(self) -> None:
        self.recorder.live.pop(self.request_id, None)


def _percentiles(values: list[float]) -> dict:
    """{"n", "p50", "p95", "p99"} in the values' unit (linear interpolation, numpy's default)."""
    if not values:
        return {"n": 0, **{f"p{q}": None for q in QUANTILES}}
    ps = np.percentile(np.asarray(values, dtype=np.float64), QUANTILES)
    return {"n": len(values), **{f"p{q}": round(float(p), 3) for q, p in zip(QUANTILES, ps)}}


def _page() -> bytes:
    return resources.files("sfcl.server").joinpath("static/dashboard.html").read_bytes()


def check_dashboard_key(request: Request) -> None:
    """The API key as header (``x-api-key`` / Bearer) or ``?key=``; 401 in the API's format."""
    expected: str | None = request.app.state.api_key
    key = request.query_params.get("key")
    if expected is not None and key is not None and hmac.compare_digest(
            key.encode("utf-8", "surrogateescape"), expected.encode("utf-8")):
        return
    check_api_key(request, openai=error_style(request) == "openai")


def install_dashboard(app: FastAPI, recorder: DashboardRecorder | None = None) -> DashboardRecorder:
    """Add ``/dashboard`` and ``/dashboard/data`` to ``app``; the recorder lives on
    ``app.state.dashboard`` (``start_generation`` feeds it)."""
    engine = app.state.engine
    if recorder is None:
        n_anchors = int(getattr(getattr(engine, "metrics", None), "n_anchors", 0) or 0)
        recorder = DashboardRecorder(n_anchors=n_anchors)
    app.state.dashboard = recorder
    page = _page()
    router = APIRouter(include_in_schema=False)

    @router.get("/dashboard")
    async def dashboard_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"cache-control": "no-store"})

    @router.get("/dashboard/data")
    async def dashboard_data(request: Request) -> JSONResponse:
        check_dashboard_key(request)
        return JSONResponse(app.state.dashboard.data(), headers={"cache-control": "no-store"})

    app.include_router(router)
    return recorder
