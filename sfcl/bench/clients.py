"""Streaming OpenAI-compatible client for the benchmark, black-box over HTTP (httpx-sse connects,
``sfcl.client.sse``, the package's one SSE reader, reads the frames).

``stream_chat`` sends one ``POST /v1/chat/completions`` with ``stream: true`` and records, on the
client's monotonic clock (a stream that ends without a ``finish_reason`` counts as an error):
TTFT (send -> first non-empty content chunk), the arrival of every content chunk (inter-token
gaps; a chunk is timed as soon as the network read that completes its frame returns), the output
token count (``usage.completion_tokens`` when the server sends a usage chunk, else the number of
content chunks), and SFCL's ``sfcl_snapshot`` chunks (their ``lookup_ms``). ``closed_loop`` runs
``concurrency`` clients that each send their next request as soon as the previous one finished,
until ``n_requests`` were sent. Runs on the host; nothing here touches a model.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import httpx
from httpx_sse import aconnect_sse

from sfcl.bench.stats import RequestSample
from sfcl.client.sse import aiter_response_events

TIMEOUT = httpx.Timeout(600.0, connect=10.0)


@dataclass(slots=True)
class Target:
    """One system behind an OpenAI-compatible URL.

    headers: sent with every request (SFCL: ``x-sfcl-snapshot: off|triggered|always``).
    extra_body: merged into every request body (e.g. ``ignore_eos`` for servers that take it).
    include_usage: ask for the usage chunk (``stream_options.include_usage``).
    temperature: sampling temperature of every request (0: greedy), with top_p 1."""

    name: str
    base_url: str
    model: str = "default"
    headers: dict[str, str] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    include_usage: bool = True
    temperature: float = 0.0


async def stream_chat(client: httpx.AsyncClient, target: Target, messages: list[dict], max_tokens: int) -> RequestSample:
    """Send one streaming chat request and measure it. Never raises for HTTP or stream errors:
    they are recorded in ``RequestSample.error`` (a benchmark keeps going and counts them)."""
    body: dict[str, Any] = {"model": target.model, "messages": messages, "max_tokens": max_tokens,
                            "temperature": target.temperature, "top_p": 1.0, "stream": True, **target.extra_body}
    if target.include_usage:
        body["stream_options"] = {"include_usage": True}
    start = time.monotonic()
    s = RequestSample(ttft_ms=None, e2e_ms=0.0, start_s=start)
    usage_tokens = None
    chunks = 0
    finished = False
    try:
        async with aconnect_sse(client, "POST", target.base_url.rstrip("/") + "/v1/chat/completions",
                                json=body, headers=target.headers) as es:
            r = es.response
            if r.status_code >= 400:
                await r.aread()
                s.error = f"HTTP {r.status_code}: {r.text[:200]}"
            else:
                async for sse in aiter_response_events(r):
                    if sse.data == "[DONE]":
                        break
                    now_ms = (time.monotonic() - start) * 1e3
                    try:
                        obj = json.loads(sse.data)
                    except json.JSONDecodeError:
                        continue
                    if "error" in obj and not obj.get("choices"):
                        s.error = f"stream error: {str(obj['error'])[:200]}"
                        break
                    if obj.get("sfcl_snapshot"):
                        s.snapshots += 1
                        lm = obj["sfcl_snapshot"].get("lookup_ms")
                        if lm is not None:
                            s.snapshot_lookup_ms.append(float(lm))
                    if obj.get("usage"):
                        usage_tokens = obj["usage"].get("completion_tokens", usage_tokens)
                        s.prompt_tokens = obj["usage"].get("prompt_tokens", s.prompt_tokens)
                    for ch in obj.get("choices") or []:
                        finished = finished or bool(ch.get("finish_reason"))
                        text = (ch.get("delta") or {}).get("content")
                        if text:
                            chunks += 1
                            s.chunk_times_ms.append(now_ms)
                            if s.ttft_ms is None:
                                s.ttft_ms = now_ms
                if s.error is None and not finished:
                    # e.g. llama_cpp.server with interrupt_requests=True cuts a stream silently
                    s.error = "stream ended without a finish_reason (cut off)"
    except httpx.HTTPError as e:
        s.error = f"{type(e).__name__}: {e}"
    s.end_s = time.monotonic()
    s.e2e_ms = (s.end_s - start) * 1e3
    if usage_tokens is not None:
        s.output_tokens, s.tokens_from_usage = int(usage_tokens), True
    else:
        s.output_tokens = chunks
    return s


async def closed_loop(target: Target, prompts: Sequence[list[dict]], concurrency: int, n_requests: int,
                      max_tokens: int, on_done: Callable[[RequestSample], None] | None = None) -> list[RequestSample]:
    """``concurrency`` clients, each sending its next request when the previous one ended, until
    ``n_requests`` were sent; request i uses ``prompts[i % len(prompts)]``. Returns the samples in
    completion order. Raises ValueError for concurrency or n_requests < 1 or no prompts."""
    if concurrency < 1 or n_requests < 1 or not prompts:
        raise ValueError("concurrency and n_requests must be >= 1 and prompts non-empty")
    counter = iter(range(n_requests))
    out: list[RequestSample] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)

    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        async def worker() -> None:
            for i in counter:  # shared iterator: each index is taken by exactly one worker
                s = await stream_chat(client, target, prompts[i % len(prompts)], max_tokens)
                out.append(s)
                if on_done:
                    on_done(s)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, n_requests))))
    return out


async def sequential(target: Target, prompts: Sequence[list[dict]], max_tokens: int,
                     on_done: Callable[[RequestSample], None] | None = None) -> list[RequestSample]:
    """Send ``prompts`` one after another on one connection; samples in prompt order."""
    out = []
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        for p in prompts:
            s = await stream_chat(client, target, p, max_tokens)
            out.append(s)
            if on_done:
                on_done(s)
    return out


def discover_model(base_url: str, headers: dict[str, str] | None = None) -> str:
    """First model id of ``GET /v1/models``, or ``"default"`` when the server does not list one."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers or {}, timeout=10)
        data = r.json().get("data") or []
        if r.status_code == 200 and data and data[0].get("id"):
            return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return "default"


async def probe(target: Target) -> Target:
    """Check that ``target`` answers a 1-token streaming request. A server that rejects the extra
    body fields (e.g. ``ignore_eos``) or ``stream_options`` with a 4xx is retried without them
    (extras first, then the usage chunk); the returned target is the variant that worked.
    Raises RuntimeError when none does."""
    msgs = [{"role": "user", "content": "Hi"}]
    variants = [(target.include_usage, dict(target.extra_body))]
    if target.extra_body:
        variants.append((target.include_usage, {}))
    if target.include_usage:
        variants.append((False, {}))
    async with httpx.AsyncClient(timeout=TIMEOUT) as client:
        for usage, extra in variants:
            target.include_usage, target.extra_body = usage, extra
            s = await stream_chat(client, target, msgs, 1)
            if not (s.error and s.error.startswith("HTTP 4")):
                break
    if s.error:
        raise RuntimeError(f"{target.name} at {target.base_url} does not answer a streaming chat request: {s.error}")
    return target
