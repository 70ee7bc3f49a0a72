"""Command line: ``sfcl serve``, ``sfcl generate``, ``sfcl anchors build``.

Flags map 1:1 onto the config records in ``sfcl.config``; every flag has help text. Errors that a
user can fix (missing model, damaged anchor library, bad corpus) print one line and exit 2.

This package owns the argument parsers; domain packages take plain arguments or a config record
and never import it. One module per command (group), each with the same two parts:

* ``add_parser(sub)`` adds the subcommand to the subparsers ``sub``: its flags, each with help
  text, and ``set_defaults(fn=cmd_NAME)``;
* ``cmd_NAME(a) -> int`` turns the parsed namespace into the domain's arguments or config record,
  calls the domain, prints, and returns the exit status. ``main`` turns the errors a user can fix
  into one line and exit 2.

Modules: ``flags`` (flag groups shared by several commands: ``add_model_flags``,
``add_snapshot_flags``; ``configs`` -> the ``sfcl.config`` records), ``serve``, ``generate``,
``soak``, ``ingest``, ``bench``, ``anchors`` (build, versions, boost) and ``anchors_curate``
(audit, prune, inject, conflicts, health), ``eval`` (``sfcl eval``, ``sfcl stress`` and ``sfcl
anchors calibrate``).
"""

from __future__ import annotations

import argparse
import os
import sys

from sfcl.engine.openmp_env import limit_openmp_spinning

# before torch loads libgomp, which reads GOMP_SPINCOUNT once (sfcl.engine.threads, item 3)
limit_openmp_spinning()

PROGRESS_LOG_INTERVAL_S = 10  # seconds between a progress bar's updates when stderr is a file or pipe


def quiet_progress_in_logs() -> bool:
    """Progress bars (tqdm) written to a file or a pipe, as a service's log is, update every
    ``PROGRESS_LOG_INTERVAL_S`` seconds instead of up to ten times a second: each update is a
    carriage-return line there, and a first start's anchor build left long runs of them. tqdm
    reads ``TQDM_MININTERVAL`` when it is imported, so this runs before any command imports it; a
    value the user set wins. Returns True when it set the value."""
    if sys.stderr is None or sys.stderr.isatty() or "TQDM_MININTERVAL" in os.environ:
        return False
    os.environ["TQDM_MININTERVAL"] = str(PROGRESS_LOG_INTERVAL_S)
    return True


quiet_progress_in_logs()

from sfcl.cli import anchors, bench, generate, ingest, llama_server, serve, soak  # noqa: E402
from sfcl.cli import eval as eval_cli  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sfcl", description="SFCL: an LLM inference server with an event-triggered "
                                 "semantic fidelity check. Commands below; `sfcl COMMAND --help` for each.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    serve.add_parser(sub)
    generate.add_parser(sub)
    soak.add_parser(sub)
    ingest.add_parser(sub)
    bench.add_parser(sub)
    llama_server.add_parser(sub)
    eval_cli.add_eval_parser(sub)
    eval_cli.add_stress_parser(sub)
    anchors.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from sfcl.anchors.corpus import CorpusError
    from sfcl.library.store import AnchorLibraryError
    from sfcl.model.loader import ModelLoadError

    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except (ModelLoadError, AnchorLibraryError, CorpusError, FileExistsError, ValueError) as e:
        print(f"sfcl: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
