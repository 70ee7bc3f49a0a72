"""``sfcl soak``: the bounded soak test of a running server (``sfcl.tools.soak``)."""

from __future__ import annotations

import argparse
import asyncio
import sys

from sfcl.cli.flags import FMT


def add_parser(sub) -> None:
    """Add ``soak`` to the top-level subparsers ``sub``."""
    k = sub.add_parser("soak", help="bounded soak test of a running server (loopback only)", **FMT)
    k.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback)")
    k.add_argument("--concurrency", type=int, default=64, help="concurrent streaming clients")
    k.add_argument("--duration", type=float, default=180.0, help="seconds to keep starting requests")
    k.add_argument("--disconnect", type=float, default=0.3, help="share of clients that hang up mid-stream")
    k.add_argument("--max-tokens", type=int, default=48, help="max_tokens per request (random 8..this)")
    k.add_argument("--seed", type=int, default=0, help="random seed of the client mix")
    k.set_defaults(fn=cmd_soak)


def cmd_soak(a: argparse.Namespace) -> int:
    from sfcl.tools.soak import soak

    st = asyncio.run(soak(a.url, a.concurrency, a.duration, a.disconnect, a.max_tokens, a.seed))
    print(st.table())
    for e in st.errors[:10]:
        print("error:", e, file=sys.stderr)
    bad = st.errors or st.lost_or_duplicated or st.idle_after_s is None
    return 1 if bad else 0
