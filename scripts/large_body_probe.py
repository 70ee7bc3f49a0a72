"""How long a running server takes to refuse a huge JSON body, and how much a small request beside
it is slowed: the check behind the request-body fixes of 2026-12-06 (twenty-second session).

Usage: python scripts/large_body_probe.py [--url http://127.0.0.1:8000] [--items 16000000] [--escape]

Posts ``{"model": ..., "max_tokens": 2, "messages": [...], "x": [1, 1, ...]}`` (``--items`` array
items: 16 million make a ~32 MB body, just under the server's 32 MiB limit) to ``/v1/messages``,
which refuses it (400: ``x`` is not a field), and meanwhile sends 16-token requests one after
another. ``--escape`` ends the array with a ``"\\ud800"`` escape, so that the server's lone-surrogate walk
runs over the whole body before it finds it. Prints the small request's time before, each one during, and the big
request's status and time.
"""

from __future__ import annotations

import argparse
import threading
import time

import httpx


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--items", type=int, default=16_000_000)
    ap.add_argument("--escape", action="store_true")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    a = ap.parse_args(argv)
    head = '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "x": [' % a.model
    raw = (head + ",".join(["1"] * a.items) + (', "\\ud800"' if a.escape else "") + "]}").encode()
    small = {"model": a.model, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}

    def timed_small() -> float:
        t = time.perf_counter()
        httpx.post(a.url + "/v1/messages", json=small, timeout=600).raise_for_status()
        return time.perf_counter() - t

    print(f"body {len(raw):,} bytes; a 16-token request alone: {timed_small():.2f} s, {timed_small():.2f} s", flush=True)
    big: dict = {}

    def post_big() -> None:
        t = time.perf_counter()
        r = httpx.post(a.url + "/v1/messages", content=raw, headers={"content-type": "application/json"}, timeout=900)
        big.update(status=r.status_code, seconds=time.perf_counter() - t, body=r.text[:120])

    th = threading.Thread(target=post_big)
    th.start()
    time.sleep(0.5)
    while th.is_alive():
        print(f"during: a 16-token request {timed_small():.2f} s", flush=True)
    th.join()
    print(f"the big body: HTTP {big['status']} after {big['seconds']:.1f} s: {big['body']}")


if __name__ == "__main__":
    main()
