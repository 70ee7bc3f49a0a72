"""Bounded soak test of a running SFCL server: N concurrent streaming clients for T seconds, some
of which hang up mid-stream, then a check that the server is idle again and lost nothing.

Every request runs with ``snapshot_mode: always``, so the stream carries one
``snapshot_triggered`` event per generated token (``token_index``, ``token``). That makes token
accounting exact on the wire: for every stream that completed, the token indices must be
0..n-1 with no gap or repeat, n must equal ``usage.output_tokens``, and the streamed text must
equal the concatenated token texts (up to a stop). Loopback only; the loop stops by itself.
Streams are read with ``sfcl.client.sse`` (the package's one SSE reader).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import httpx

from sfcl.client.sse import aiter_response_events

PROMPTS = [
    "Summarise a typical confidentiality clause in two sentences.",
    "What does a notice period of thirty (30) days mean?",
    "List three obligations of a receiving party.",
    "Explain governing law in one paragraph.",
    "Write a short clause about returning documents within 10 days.",
]


@dataclass
class SoakStats:
    started: int = 0
    completed: int = 0
    disconnected: int = 0  # clients that hung up on purpose
    errors: list[str] = field(default_factory=list)  # HTTP errors, error events, bad framing
    lost_or_duplicated: int = 0  # streams whose token accounting did not add up
    tokens: int = 0
    rss_start: int = 0
    rss_end: int = 0
    idle_after_s: float | None = None  # seconds until /health showed 0 running, 0 waiting

    def table(self) -> str:
        rows = [("requests started", self.started), ("completed", self.completed),
                ("disconnected on purpose", self.disconnected), ("errors", len(self.errors)),
                ("lost or duplicated tokens (streams)", self.lost_or_duplicated), ("tokens streamed", self.tokens),
                ("server RSS start MiB", f"{self.rss_start / 2**20:.0f}"),
                ("server RSS end MiB", f"{self.rss_end / 2**20:.0f}"),
                ("RSS growth MiB", f"{(self.rss_end - self.rss_start) / 2**20:+.0f}"),
                ("idle again after s", "never" if self.idle_after_s is None else f"{self.idle_after_s:.1f}")]
        w = max(len(r[0]) for r in rows)
        return "\n".join([f"| {'metric':<{w}} | value |", f"|{'-' * (w + 2)}|-------|"] +
                         [f"| {k:<{w}} | {v} |" for k, v in rows])


def _check(frames: list[tuple[str, dict]], st: SoakStats) -> None:
    text = "".join(d["delta"]["text"] for e, d in frames if e == "content_block_delta")
    snaps = [d for e, d in frames if e == "snapshot_triggered"]
    delta = next((d for e, d in frames if e == "message_delta"), None)
    if delta is None or frames[-1][0] != "message_stop":
        st.errors.append("stream ended without message_delta/message_stop")
        return
    n = delta["usage"]["output_tokens"]
    idx = [s["token_index"] for s in snaps]
    ok = idx == list(range(n))
    if ok and delta["delta"]["stop_reason"] in ("max_tokens", "end_turn"):
        toks = "".join(s["token"] for s in snaps if not s["token"].startswith("<|"))
        ok = "\ufffd" in toks or toks == text
    st.lost_or_duplicated += not ok
    st.tokens += n


async def _one(client: httpx.AsyncClient, url: str, st: SoakStats, rng: random.Random, disconnect_p: float,
               max_tokens: int) -> None:
    body = {"model": "default", "max_tokens": rng.randint(8, max_tokens), "temperature": 0.7, "stream": True,
            "snapshot_mode": "always", "messages": [{"role": "user", "content": rng.choice(PROMPTS)}]}
    hang_up_after = rng.randint(1, 12) if rng.random() < disconnect_p else None
    st.started += 1
    frames: list[tuple[str, dict]] = []
    try:
        async with client.stream("POST", url + "/v1/messages", json=body) as r:
            if r.status_code != 200:
                st.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for sse in aiter_response_events(r):
                event, d = sse.event, json.loads(sse.data)
                frames.append((event, d))
                if event == "error":
                    st.errors.append(f"error event: {d}")
                    return
                if hang_up_after is not None and event == "content_block_delta":
                    hang_up_after -= 1
                    if hang_up_after == 0:
                        st.disconnected += 1
                        return  # leaving the context manager closes the connection mid-stream
    except httpx.HTTPError as e:
        st.errors.append(f"{type(e).__name__}: {e}")
        return
    st.completed += 1
    _check(frames, st)


async def soak(url: str, concurrency: int = 64, duration_s: float = 180.0, disconnect_p: float = 0.3,
               max_tokens: int = 48, seed: int = 0, progress: bool = True) -> SoakStats:
    """Run the soak against ``url`` (must be a loopback address). Returns the stats."""
    host = httpx.URL(url).host
    if host not in ("127.0.0.1", "localhost", "::1") and not host.startswith("127."):
        raise ValueError("the soak test only targets loopback addresses")
    st = SoakStats()
    rng = random.Random(seed)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0)) as client:
        st.rss_start = (await client.get(url + "/health")).json().get("rss_bytes", 0)
        deadline = time.monotonic() + duration_s

        async def worker() -> None:
            while time.monotonic() < deadline:
                await _one(client, url, st, rng, disconnect_p, max_tokens)

        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=int(duration_s), desc="soak", unit="s")
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        while not all(t.done() for t in tasks):
            await asyncio.sleep(1.0)
            if bar is not None:
                bar.n = min(int(duration_s), int(duration_s - max(0.0, deadline - time.monotonic())))
                bar.set_postfix(done=st.completed, cut=st.disconnected, err=len(st.errors))
                bar.refresh()
        if bar is not None:
            bar.close()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            h = (await client.get(url + "/health")).json()
            if h.get("running") == 0 and h.get("waiting") == 0:
                st.idle_after_s = time.monotonic() - t0
                st.rss_end = h.get("rss_bytes", 0)
                break
            await asyncio.sleep(0.2)
    return st
