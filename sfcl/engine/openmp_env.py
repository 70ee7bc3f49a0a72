"""OpenMP settings that must be in the environment before torch loads GNU libgomp, which reads
them once (why: ``sfcl.engine.threads``, item 3). This module imports nothing heavy, so that the
``sfcl`` command can call ``limit_openmp_spinning`` before anything imports torch."""

from __future__ import annotations

import os

OPENMP_SPINCOUNT = "10000"  # GOMP_SPINCOUNT for SFCL's processes (sfcl.engine.threads, item 3)
_UNSET = object()
_inherited: object = _UNSET  # GOMP_SPINCOUNT before limit_openmp_spinning: a str, None (absent), or _UNSET (not run)


def limit_openmp_spinning() -> bool:
    """Set ``GOMP_SPINCOUNT`` to ``OPENMP_SPINCOUNT`` in this process's environment unless it is
    set already (``sfcl.engine.threads``, item 3); call before torch is imported. Returns True
    when it set the value."""
    global _inherited
    if _inherited is _UNSET:
        _inherited = os.environ.get("GOMP_SPINCOUNT")
    if "GOMP_SPINCOUNT" in os.environ:
        return False
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPINCOUNT
    return True


def inherited_environ() -> dict[str, str]:
    """This process's environment as it was before ``limit_openmp_spinning``: what other programs
    started from here get (llama.cpp's ``llama-server`` runs on libgomp too, and a benchmark peer
    must run as its user would run it)."""
    env = dict(os.environ)
    if _inherited is None:
        env.pop("GOMP_SPINCOUNT", None)
    elif isinstance(_inherited, str):
        env["GOMP_SPINCOUNT"] = _inherited
    return env
