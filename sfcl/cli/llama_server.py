"""``sfcl llama-server``: find or build llama.cpp's ``llama-server`` (the benchmark peer) and print
its path (``sfcl.bench.llama_server``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sfcl.cli.flags import FMT


def add_parser(sub) -> None:
    """Add ``llama-server`` to the top-level subparsers ``sub``."""
    p = sub.add_parser("llama-server", help="find or build llama.cpp's llama-server (benchmark peer); prints its path",
                       description=__doc__.split("\n\n")[0], **FMT)
    p.add_argument("--version", default=None,
                   help="llama-cpp-python sdist version (default: the installed one, else the newest on PyPI)")
    p.add_argument("--cache-dir", default=None, help="cache root (default $SFCL_CACHE_DIR or ~/.cache/sfcl)")
    p.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all CPUs)")
    p.add_argument("--no-build", action="store_true", help="only look for a binary; exit 2 when there is none")
    p.set_defaults(fn=cmd_llama_server)


def cmd_llama_server(a: argparse.Namespace) -> int:
    from sfcl.bench.llama_server import LlamaServerUnavailable, build_llama_server, find_llama_server
    from sfcl.config import default_cache_dir

    try:
        cache = Path(a.cache_dir) if a.cache_dir else default_cache_dir()
        found = find_llama_server(cache, a.version)
        if found is None and a.no_build:
            raise LlamaServerUnavailable("no llama-server binary found (run `sfcl llama-server` to build one)")
        print(found if found is not None else build_llama_server(cache, a.version, a.jobs))
        return 0
    except LlamaServerUnavailable as e:
        print(f"sfcl: error: {e}", file=sys.stderr)
        return 2
