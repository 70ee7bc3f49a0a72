"""Statistics over request samples: percentiles, variance, per-workload summaries.

Pure Python (no numpy needed), so the report code is testable on synthetic samples. Units: every
latency is in milliseconds, variances in ms², throughput in output tokens per second, memory in
bytes. Percentiles use linear interpolation between closest ranks (numpy's default "linear",
Hyndman & Fan 1996 definition 7).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Iterable, Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (q in [0, 100]) with linear interpolation; None for no values.
    Raises ValueError when q is outside [0, 100]."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(float(v) for v in values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def variance(values: Sequence[float]) -> float | None:
    """Population variance (divide by n); None for no values."""
    xs = [float(v) for v in values]
    if not xs:
        return None
    m = sum(xs) / len(xs)
    return sum((x - m) ** 2 for x in xs) / len(xs)


def ratio(num: float | None, den: float | None) -> float | None:
    """num / den, or None when either is missing or den is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


@dataclass(slots=True)
class RequestSample:
    """What one streamed request measured, as seen by the client (times in ms from its send)."""

    ttft_ms: float | None  # send -> first content chunk (None: no content arrived)
    e2e_ms: float  # send -> end of stream
    chunk_times_ms: list[float] = field(default_factory=list)  # arrival of each content chunk
    output_tokens: int = 0  # usage.completion_tokens when the server reports it, else chunks
    tokens_from_usage: bool = False  # True: output_tokens is the server's count
    prompt_tokens: int | None = None
    snapshot_lookup_ms: list[float] = field(default_factory=list)  # one per snapshot event
    snapshots: int = 0  # snapshot events in the stream
    error: str | None = None  # HTTP status/error text; the sample still counts as sent
    start_s: float = 0.0  # monotonic send time (s), for the wall-clock span of a workload
    end_s: float = 0.0  # monotonic end time (s)

    @property
    def gaps_ms(self) -> list[float]:
        """Inter-chunk gaps (ms): the client-visible inter-token latency (ITL)."""
        t = self.chunk_times_ms
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first: (last - first chunk) / (tokens - 1)."""
        if self.output_tokens < 2 or len(self.chunk_times_ms) < 2:
            return None
        return (self.chunk_times_ms[-1] - self.chunk_times_ms[0]) / (self.output_tokens - 1)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(slots=True)
class Summary:
    """Figures of one system x workload (x concurrency level). None = not measured/applicable."""

    system: str
    workload: str  # single | concurrent | longdoc-cold | longdoc-repeat
    concurrency: int
    requests: int
    errors: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float | None  # aggregate output tokens / wall time of the workload
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    tpot_p50_ms: float | None
    tpot_p95_ms: float | None
    itl_p50_ms: float | None
    itl_p95_ms: float | None
    itl_var_ms2: float | None  # mean over requests of the variance of their inter-chunk gaps
    peak_rss_bytes: int | None = None
    gpu_mem_bytes: int | None = None
    snapshots_per_1k_tokens: float | None = None
    lookup_p50_ms: float | None = None
    lookup_p99_ms: float | None = None
    lookups: int | None = None  # snapshot lookups the two percentiles rest on
    tokens_counted_by: str = "usage"  # usage | chunks | generate

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(system: str, workload: str, concurrency: int, samples: Iterable[RequestSample], *,
              wall_s: float | None = None, peak_rss_bytes: int | None = None,
              gpu_mem_bytes: int | None = None, snapshots: bool = False) -> Summary:
    """Summary of ``samples``. wall_s: the workload's wall time (default: first send to last end).
    snapshots=True fills the snapshot columns (lookups per 1,000 output tokens, lookup p50/p99 and
    how many lookups they rest on)."""
    ss = list(samples)
    ok = [s for s in ss if s.error is None]
    tokens = sum(s.output_tokens for s in ok)
    if wall_s is None:
        wall_s = (max(s.end_s for s in ss) - min(s.start_s for s in ss)) if ss else 0.0
    ttft = [s.ttft_ms for s in ok if s.ttft_ms is not None]
    tpot = [t for t in (s.tpot_ms for s in ok) if t is not None]
    gaps = [g for s in ok for g in s.gaps_ms]
    per_req_var = [v for v in (variance(s.gaps_ms) for s in ok if len(s.gaps_ms) >= 2) if v is not None]
    look = [x for s in ok for x in s.snapshot_lookup_ms]
    n_snap = sum(s.snapshots for s in ok)
    by = "usage" if ok and all(s.tokens_from_usage for s in ok) else ("chunks" if ok else "usage")
    return Summary(
        system=system, workload=workload, concurrency=concurrency, requests=len(ss), errors=len(ss) - len(ok),
        output_tokens=tokens, wall_s=wall_s, tokens_per_s=ratio(tokens, wall_s),
        ttft_p50_ms=percentile(ttft, 50), ttft_p95_ms=percentile(ttft, 95),
        tpot_p50_ms=percentile(tpot, 50), tpot_p95_ms=percentile(tpot, 95),
        itl_p50_ms=percentile(gaps, 50), itl_p95_ms=percentile(gaps, 95),
        itl_var_ms2=(sum(per_req_var) / len(per_req_var)) if per_req_var else None,
        peak_rss_bytes=peak_rss_bytes, gpu_mem_bytes=gpu_mem_bytes,
        snapshots_per_1k_tokens=(1000.0 * n_snap / tokens if tokens else None) if snapshots else None,
        lookup_p50_ms=percentile(look, 50) if snapshots else None,
        lookup_p99_ms=percentile(look, 99) if snapshots else None,
        lookups=len(look) if snapshots else None,
        tokens_counted_by=by,
    )
