"""Hooks the anchor-library lifecycle commands into ``sfcl anchors`` (called by sfcl.cli).

audit/prune (sfcl.anchors.audit), inject (sfcl.anchors.inject), conflicts
(sfcl.anchors.conflicts), health (sfcl.anchors.health), versions/boost (sfcl.anchors.versions).
"""

from __future__ import annotations


def add_parsers(asub) -> None:
    """Add every lifecycle subcommand to the ``anchors`` subparsers ``asub``."""
    from sfcl.anchors import audit, conflicts, health, inject, versions

    for mod in (audit, inject, conflicts, health, versions):
        mod.add_parser(asub)
