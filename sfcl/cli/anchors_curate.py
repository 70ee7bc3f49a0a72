"""``sfcl anchors audit|prune|inject|conflicts|health``: curating a library between versions.

Each command reads a library (``sfcl.library.store``), calls its domain module
(``sfcl.anchors.audit``, ``inject``, ``conflicts``, ``health``) with that module's config record,
prints a summary and writes either a report directory or a new version of the library
(``sfcl.library.versions.write_version``, with the command line recorded in the lineage).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from sfcl.anchors.health import EXIT_DRIFT
from sfcl.cli.flags import FMT, add_model_flags, describe_command, load_model_flags

LIB_HELP = "library: a root (its CURRENT version), a version or a plain directory"
OUT_HELP = "library root to write the new version into (may be LIB's root)"


def add_parsers(asub) -> None:
    """Add audit, prune, inject, conflicts and health to the ``anchors`` subparsers ``asub``."""
    p = asub.add_parser("audit", help="find dense clusters of low-quality (stop-word/boilerplate) anchors", **FMT)
    p.add_argument("lib", help=LIB_HELP)
    p.add_argument("--out", default=None,
                   help="report directory for report.json, summary.txt, projection.png "
                        "(default ./anchor-audit-<content hash>)")
    p.add_argument("--projection", default="tsne", choices=["tsne", "pca"], help="2-D projection method")
    p.add_argument("--max-points", type=int, default=5000, help="anchors shown in the projection (sampled)")
    _audit_flags(p)
    p.set_defaults(fn=cmd_audit)
    q = asub.add_parser("prune", help="write a new library version without the audit's flagged anchors", **FMT)
    q.add_argument("lib", help=LIB_HELP)
    q.add_argument("--flagged", action="store_true", help="drop the anchors the audit flags")
    q.add_argument("--report", default=None,
                   help="audit report directory to take the flagged ids from (default: audit LIB now "
                        "with the thresholds below)")
    q.add_argument("--out", required=True, help=OUT_HELP)
    _audit_flags(q)
    q.set_defaults(fn=cmd_prune)

    p = asub.add_parser("inject", help="add domain anchors from key clauses (de-duplicated)", **FMT)
    p.add_argument("lib", help=LIB_HELP)
    p.add_argument("--clauses", required=True,
                   help="UTF-8 text file: one clause per line, or blank-line separated paragraphs")
    p.add_argument("--weight", type=float, default=0.3, help="weight of the new domain anchors")
    p.add_argument("--decay", type=float, default=None,
                   help="decay rate of the new anchors (default: the library's median general-anchor decay)")
    p.add_argument("--dedupe", type=float, default=0.92,
                   help="merge clauses whose all-MiniLM-L6-v2 cosine is at least this")
    p.add_argument("--out", required=True, help=OUT_HELP)
    add_model_flags(p)
    p.set_defaults(fn=cmd_inject)

    p = asub.add_parser("conflicts", help="report (and optionally drop) domain anchors that crowd general ones", **FMT)
    p.add_argument("lib", help=LIB_HELP)
    p.add_argument("--sim", type=float, default=0.85,
                   help="flag a domain anchor whose mean cosine to its k nearest general anchors exceeds this")
    p.add_argument("--k", type=int, default=5, help="nearest general anchors averaged")
    p.add_argument("--centre-dist", type=float, default=0.15,
                   help="flag a domain anchor closer than this cosine distance to a general cluster centre")
    p.add_argument("--n-clusters", type=int, default=32, help="k-means clusters over the general anchors")
    p.add_argument("--raw", action="store_true", help="plain cosine instead of the centred space")
    p.add_argument("--seed", type=int, default=0, help="k-means seed")
    p.add_argument("--report", default=None, help="directory for conflicts.json and conflicts.txt")
    p.add_argument("--drop", action="store_true", help="write a new version without the flagged anchors")
    p.add_argument("--out", default=None, help="library root for the new version (with --drop)")
    p.set_defaults(fn=cmd_conflicts)

    p = asub.add_parser("health", help="drift, trigger precision and coverage gap between two versions; "
                                       f"exit {EXIT_DRIFT} when drift > --max-drift", **FMT)
    p.add_argument("old", help="reference library (root, version or plain directory)")
    p.add_argument("new", help="library to check against it")
    p.add_argument("--traffic", default=None,
                   help="request log (JSON lines from `sfcl serve` stdout, optional outcome/prompt/completion fields)")
    p.add_argument("--max-drift", type=float, default=0.15, help=f"drift above which the exit status is {EXIT_DRIFT}")
    p.add_argument("--n-axes", type=int, default=8, help="PCA axes of OLD used for the drift projection")
    p.add_argument("--min-count", type=int, default=2, help="occurrences for a traffic entity to count as frequent")
    p.add_argument("--out", default=None, help="directory for health.json, health.txt and drift.png")
    p.set_defaults(fn=cmd_health)


def _audit_flags(p: argparse.ArgumentParser) -> None:
    """The thresholds shared by audit and prune (``sfcl.anchors.audit.AuditConfig``)."""
    p.add_argument("--k", type=int, default=10, help="nearest neighbours for density and neighbourhood pollution")
    p.add_argument("--pollution-threshold", type=float, default=0.6,
                   help="neighbourhood span pollution (0..1) at or above which a region is low-quality")
    p.add_argument("--density-z", type=float, default=1.0,
                   help="robust z-score of kNN density at or above which an anchor is in a dense region")
    p.add_argument("--seed", type=int, default=0, help="seed of the projection sample and t-SNE")


def _audit_config(a: argparse.Namespace):
    from sfcl.anchors.audit import AuditConfig

    return AuditConfig(k=a.k, pollution_threshold=a.pollution_threshold, density_z=a.density_z,
                       max_points=getattr(a, "max_points", 5000), projection=getattr(a, "projection", "tsne"),
                       seed=a.seed)


def _write_without(a: argparse.Namespace, lib, drop) -> tuple[Path, int]:
    """A new version under ``--out``: ``lib`` without the anchor ids ``drop``. Returns (its
    directory, anchors left). Raises ValueError when nothing would be left."""
    from sfcl.library.versions import library_fields, select, write_version

    keep = np.ones(lib.n_anchors, bool)
    keep[drop] = False
    if not keep.any():
        raise ValueError("every anchor is flagged; refusing to write an empty library")
    path = write_version(a.out, select(library_fields(lib), torch.from_numpy(keep)),
                         command=describe_command(a), parent=lib)
    return path, int(keep.sum())


def _write_report(out_dir, rep: dict, text: str, report_file: str, summary_file: str) -> Path:
    """``rep`` as JSON and ``text`` beside it in ``out_dir`` (created). Returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / report_file).write_text(json.dumps(rep, indent=1, ensure_ascii=False), encoding="utf-8")
    (out / summary_file).write_text(text, encoding="utf-8")
    return out


def cmd_audit(a: argparse.Namespace) -> int:
    from sfcl.anchors.audit import PLOT_FILE, REPORT_FILE, SUMMARY_FILE, audit_library, summary_text, write_report
    from sfcl.library.versions import load_library

    lib = load_library(a.lib)
    cfg = _audit_config(a)
    res = audit_library(lib, cfg)
    out = Path(a.out) if a.out else Path(f"anchor-audit-{lib.content_hash[:12]}")
    write_report(lib, res, cfg, out)
    print(summary_text(lib, res, cfg), end="")
    print(f"[ANCHOR] audit report: {out / REPORT_FILE}, {out / SUMMARY_FILE}, {out / PLOT_FILE}")
    return 0


def cmd_prune(a: argparse.Namespace) -> int:
    from sfcl.anchors.audit import audit_library, flagged_from_report
    from sfcl.library.versions import load_library

    if not a.flagged:
        raise ValueError("say what to prune: --flagged (the anchors an audit flags)")
    lib = load_library(a.lib)
    if a.report:
        ids = flagged_from_report(lib, a.report)
    else:
        ids = np.nonzero(audit_library(lib, _audit_config(a)).flagged)[0]
    path, left = _write_without(a, lib, ids)
    print(f"[ANCHOR] pruned {len(ids)} flagged anchors, {left} left; new version {path}")
    return 0


def cmd_inject(a: argparse.Namespace) -> int:
    from sfcl.anchors.inject import inject, read_clauses
    from sfcl.library.versions import load_library, write_version

    clauses = read_clauses(a.clauses)
    lib = load_library(a.lib)
    lm = load_model_flags(a)
    res = inject(lib, lm, clauses, weight=a.weight, decay=a.decay, dedupe_threshold=a.dedupe,
                 source=f"clauses:{Path(a.clauses).name}")
    for m in res.merges:
        what = (f"clause {m.into + 1}" if m.into is not None else f"existing domain anchor {m.anchor}")
        print(f"merged: clause {m.dropped + 1} into {what} (cosine {m.cosine:.3f}): {clauses[m.dropped].text[:80]!r}")
    if not res.kept:
        raise ValueError("every clause duplicates an existing domain anchor; nothing to inject")
    path = write_version(a.out, res.fields, command=describe_command(a), parent=lib)
    print(f"[ANCHOR] injected {len(res.kept)} domain anchors from {len(clauses)} clauses "
          f"({len(res.merges)} merged as duplicates at cosine >= {a.dedupe}); new version {path}")
    return 0


def cmd_conflicts(a: argparse.Namespace) -> int:
    from sfcl.anchors.conflicts import REPORT_FILE, SUMMARY_FILE, ConflictConfig, find_conflicts, report
    from sfcl.library.versions import load_library

    if a.drop and not a.out:
        raise ValueError("--drop writes a new version: give --out ROOT")
    lib = load_library(a.lib)
    cfg = ConflictConfig(sim=a.sim, k=a.k, centre_dist=a.centre_dist, n_clusters=a.n_clusters,
                         centred=not a.raw, seed=a.seed)
    res = find_conflicts(lib, cfg)
    rep, text = report(lib, res, cfg)
    print(text, end="")
    if a.report:
        out = _write_report(a.report, rep, text, REPORT_FILE, SUMMARY_FILE)
        print(f"[ANCHOR] conflict report: {out / REPORT_FILE}")
    if a.drop:
        path, _ = _write_without(a, lib, res.flagged_ids)
        print(f"[ANCHOR] dropped {int(res.flagged.sum())} conflicting domain anchors; new version {path}")
    return 0


def cmd_health(a: argparse.Namespace) -> int:
    from sfcl.anchors.health import PLOT_FILE, REPORT_FILE, SUMMARY_FILE, HealthConfig, health, plot_drift, summary_text
    from sfcl.library.versions import load_library

    cfg = HealthConfig(n_axes=a.n_axes, max_drift=a.max_drift, min_count=a.min_count)
    old, new = load_library(a.old), load_library(a.new)
    rep = health(old, new, a.traffic, cfg)
    text = summary_text(rep)
    print(text, end="")
    if a.out:
        out = _write_report(a.out, rep, text, REPORT_FILE, SUMMARY_FILE)
        plot_drift(rep, out / PLOT_FILE)
    return EXIT_DRIFT if rep["drift_exceeded"] else 0
