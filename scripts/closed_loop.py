"""A light closed-loop load client for a running server (OpenAI chat completions, streaming).

Usage: python scripts/closed_loop.py [--url http://127.0.0.1:8000] [--concurrency 16]
           [--requests 128] [--max-tokens 64] [--mode off|triggered|always] [--temperature T]

Each of ``concurrency`` clients sends its next request when the previous one ended, until
``requests`` were sent; prints the content chunks received and their aggregate rate. It frames
the stream with ``sfcl.client.sse`` (the package's one SSE reader) but decodes no JSON, so it
takes less of the machine than ``sfcl bench``'s client, which decodes and times every chunk: the
difference shows how much the bench's client costs a server on the same two cores. Omitting
--temperature uses the server's default (1.0 for SFCL).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from sfcl.client.sse import aiter_response_events


async def run(a) -> None:
    sent = iter(range(a.requests))
    chunks = 0
    tag = f"[{a.mode} {time.time_ns() % 10**9}]"  # no run reuses another's prefix-cached prompts

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal chunks
        body = {"model": a.model, "stream": True, "max_tokens": a.max_tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": f"{tag} R{i}: Explain what a non-disclosure agreement is."}]}
        if a.temperature is not None:
            body["temperature"] = a.temperature
        async with client.stream("POST", a.url.rstrip("/") + "/v1/chat/completions", json=body,
                                 headers={"x-sfcl-snapshot": a.mode}) as r:
            r.raise_for_status()
            async for sse in aiter_response_events(r):
                if '"content"' in sse.data:  # no JSON decoding: a content chunk is all it counts
                    chunks += 1

    async def worker(client: httpx.AsyncClient) -> None:
        for i in sent:
            await one(client, i)

    limits = httpx.Limits(max_connections=a.concurrency + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(a.concurrency)))
        dt = time.perf_counter() - t0
    print(f"mode={a.mode} concurrency={a.concurrency}: {chunks} content chunks in {dt:.1f} s = {chunks / dt:.1f} /s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="default: the first model of GET /v1/models")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--mode", default="off", choices=["off", "triggered", "always"])
    ap.add_argument("--temperature", type=float, default=None)
    a = ap.parse_args(argv)
    if a.model is None:
        from sfcl.bench.clients import discover_model

        a.model = discover_model(a.url)
    asyncio.run(run(a))


if __name__ == "__main__":
    main()
