"""TTFT of short requests sent while a long prompt prefills, against a running server.

    python scripts/long_vs_short.py [--url http://127.0.0.1:8000] [--chars 30000] [--shorts 12]
        [--delay 1.0] [--data ../shared/data/contractnli/dev.json]

Sends one streaming /v1/messages request whose prompt is the first ``--chars`` characters of the
ContractNLI NDAs (read at run time; ~7,000 tokens at the default), then, ``--delay`` seconds later,
``--shorts`` one-line questions at once (greedy, 16 tokens each), and prints the long request's
TTFT and the short ones' TTFT (min / median / max, from their own send). What it measures: whether
the scheduler holds short prompts behind a long prompt's chunks (``sfcl.engine.scheduler``,
``short_prefill_tokens``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx


async def _one(client: httpx.AsyncClient, url: str, content: str, t0: float) -> float:
    body = {"model": "smollm2-135m-instruct", "max_tokens": 16, "stream": True, "temperature": 0,
            "messages": [{"role": "user", "content": content}]}
    first = None
    async with client.stream("POST", url + "/v1/messages", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and "content_block_delta" in line:
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("a stream ended without text")
    return first


async def _run(a: argparse.Namespace) -> None:
    docs = json.loads(Path(a.data).read_text())["documents"]
    text = "\n\n".join(d["text"] for d in docs)[: a.chars]
    async with httpx.AsyncClient() as client:
        t0 = time.perf_counter()
        long_task = asyncio.create_task(_one(client, a.url, text + "\n\nSummarise the first agreement.", t0))
        await asyncio.sleep(a.delay)
        t1 = time.perf_counter()
        shorts = await asyncio.gather(*[_one(client, a.url, f"Question {i}: in one sentence, what is a mutual NDA?", t1)
                                        for i in range(a.shorts)])
        long_ttft = await long_task
    print(f"long prompt ({a.chars:,} chars) TTFT {long_ttft:.2f} s; {a.shorts} short requests sent {a.delay:g} s "
          f"later: TTFT min {min(shorts):.2f} / median {statistics.median(shorts):.2f} / max {max(shorts):.2f} s")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--chars", type=int, default=30000, help="characters of NDA text in the long prompt")
    ap.add_argument("--shorts", type=int, default=12, help="short requests sent while it prefills")
    ap.add_argument("--delay", type=float, default=1.0, help="seconds between the long request and the short ones")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[1].parent / "shared/data/contractnli/dev.json"))
    asyncio.run(_run(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
