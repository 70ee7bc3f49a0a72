"""``sfcl anchors ...``: build a library, curate it (``sfcl.cli.anchors_curate``), list its
versions, set its keyword boost; ``calibrate`` is registered from ``sfcl.eval.calibrate``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sfcl.cli import anchors_curate
from sfcl.cli.anchors_curate import LIB_HELP, OUT_HELP
from sfcl.cli.flags import FMT, add_model_flags, describe_command, load_model_flags


def add_parser(sub) -> None:
    """Add ``anchors`` and its subcommands to the top-level subparsers ``sub``."""
    an = sub.add_parser("anchors", help="anchor library tools")
    asub = an.add_subparsers(dest="anchors_cmd", required=True)
    b = asub.add_parser("build", help="Static Anchor Generator: corpus -> anchor library", **FMT)
    b.add_argument("corpus", nargs="+", help=".txt/.md files, directories, ContractNLI .json or .jsonl, or an `sfcl ingest` output directory")
    b.add_argument("--out", required=True,
                   help="library root: a new directory (becomes ROOT/v0001 + CURRENT) or an existing root "
                        "(the build becomes its next version)")
    b.add_argument("--n-anchors", type=int, default=32768, help="anchors at most")
    b.add_argument("--layer", type=int, default=None, help="snapshot layer (default: 3/4 of the depth)")
    b.add_argument("--seed", type=int, default=0, help="clustering seed (same corpus, model, dtype, --threads and seed: the same library)")
    # 19: sfcl.anchors.builder.MIN_CALIBRATION_WINDOW, which BuildConfig checks (not imported here: torch)
    b.add_argument("--window-tokens", type=int, default=1024,
                   help="tokens per window (a position attends to the earlier tokens of its window): at least 19, at "
                        "most the model's context")
    b.add_argument("--batch-tokens", type=int, default=4096, help="tokens per forward: windows are batched up to this")
    b.add_argument("--max-points", type=int, default=None, help="stop after this many token positions")
    b.add_argument("--max-docs", type=int, default=None, help="use only the first N documents")
    add_model_flags(b)
    b.set_defaults(fn=cmd_anchors_build)
    anchors_curate.add_parsers(asub)  # audit, prune, inject, conflicts, health
    v = asub.add_parser("versions", help="list the versions of a library root (* = CURRENT)", **FMT)
    v.add_argument("root", help="versioned library root (a directory with CURRENT and vNNNN/)")
    v.set_defaults(fn=cmd_versions)
    b = asub.add_parser("boost", help="set the library's keyword-boost rules (new version)", **FMT)
    b.add_argument("lib", help=LIB_HELP)
    b.add_argument("--rules", required=True,
                   help='JSON file: [{"keywords": ["indemnif"], "kinds": ["domain"], "multiplier": 1.5}, ...]')
    b.add_argument("--out", required=True, help=OUT_HELP)
    b.set_defaults(fn=cmd_boost)
    from sfcl.cli.eval import add_calibrate_parser

    add_calibrate_parser(asub)


def cmd_anchors_build(a: argparse.Namespace) -> int:
    from sfcl.anchors.builder import BuildConfig, build_library
    from sfcl.anchors.corpus import read_corpus
    from sfcl.library.versions import load_library

    docs = read_corpus(a.corpus)
    if a.max_docs:
        docs = docs[: a.max_docs]
    lm = load_model_flags(a)
    cfg = BuildConfig(n_anchors=a.n_anchors, layer=a.layer, seed=a.seed, window_tokens=a.window_tokens,
                      batch_tokens=a.batch_tokens, max_points=a.max_points)
    path = build_library(lm, docs, a.out, cfg, versioned=True, command=describe_command(a))
    lib = load_library(path)
    print(f"[ANCHOR] built {lib.n_anchors} anchors from {len(docs)} documents "
          f"({lib.manifest['build']['n_points']} positions, layer {lib.layer}) into {path}", file=sys.stderr)
    return 0


def cmd_versions(a: argparse.Namespace) -> int:
    from sfcl.library.versions import list_versions

    vs = list_versions(a.root)
    print(f"{'':2}{'version':8} {'anchors':>8} {'general':>8} {'domain':>7}  {'created':25} command")
    for v in vs:
        print(f"{'*' if v.current else ' ':2}{v.name:8} {v.n_anchors:8d} {v.counts.get('general', '-'):>8} "
              f"{v.counts.get('domain', '-'):>7}  {v.created:25} {v.command}")
    return 0


def cmd_boost(a: argparse.Namespace) -> int:
    from sfcl.library.store import parse_keyword_boost
    from sfcl.library.versions import library_fields, load_library, write_version

    try:
        rules = parse_keyword_boost(json.loads(Path(a.rules).read_text(encoding="utf-8")))
    except OSError as e:
        raise ValueError(f"cannot read --rules {a.rules}: {e}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"--rules {a.rules} is not valid JSON: {e}") from e
    lib = load_library(a.lib)
    f = library_fields(lib)
    f["keyword_boost"] = [r.to_json() for r in rules]
    path = write_version(a.out, f, command=describe_command(a), parent=lib)
    print(f"[ANCHOR] {len(rules)} keyword-boost rule(s) set; new version {path}")
    return 0
