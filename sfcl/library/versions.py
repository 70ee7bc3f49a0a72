"""Immutable anchor-library versions under a library root, and the field plumbing every write uses.

Owns the version layout, :func:`load_library` (how every caller opens a library: a root, one of
its versions or a plain directory), :func:`write_version` (the one way the lifecycle commands and
``sfcl anchors build`` write a library), :func:`resolve_library_dir`, :func:`list_versions` and
:func:`describe_command`, behind ``sfcl anchors versions`` and ``sfcl anchors boost`` (``sfcl.cli.anchors``). It sits above the file format
(``sfcl.library.store``), which knows nothing of versions. Data lives on the CPU; nothing here
touches the model.

Layout::

    ROOT/
      CURRENT          one line: the current version's directory name, e.g. "v0003"
      v0001/           an ordinary library directory (see sfcl.library.store), never modified
      v0002/           ... its manifest.json carries "version": {number, parent, parent_content_hash,
      v0003/               command, created, counts {general, domain}} and "content_hash"

Every write creates the next ``vNNNN`` (a directory rename, so a half-written version never
appears) and then replaces ``CURRENT`` atomically (temp file + ``os.replace``): a reader sees the
old or the new version, never a mix. Two concurrent writers get different numbers (the second
rename fails and it takes the next one), and CURRENT only moves forward (flock on the root).
Rolling back is :func:`set_current` (or writing CURRENT by hand): only the pointer moves.
``load_library(ROOT)`` opens the version ``CURRENT`` names; ``load_library(ROOT/v0002)`` opens
that version; a plain library directory (the format before versions) loads as before and can be
the parent of a new root.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from sfcl.library.store import (KIND_NAMES, MANIFEST_FILE, AnchorLibrary, AnchorLibraryError, load_library_dir,
                                 parse_keyword_boost, save_library)

CURRENT_FILE = "CURRENT"
_VERSION_DIR = re.compile(r"^v(\d{4,})$")
# what a root may hold: the pointer, versions, and the temporaries of writes in progress
_ROOT_ENTRY = re.compile(r"^(CURRENT|v\d{4,}|\.v\d{4,}\.tmp-.*|\.CURRENT\.tmp-.*)$")
_TENSOR_FIELDS = ("vectors", "counts", "weights", "decay", "next_ids", "next_probs", "kinds",
                  "span_doc", "span_start", "span_end")
_INHERITED = ("model_fingerprint", "model_name", "layer", "build", "corpus_hash", "calibration",
              "keyword_boost")


def _version_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        m = _VERSION_DIR.match(p.name)
        if m and (p / MANIFEST_FILE).is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def is_root(path) -> bool:
    """True if ``path`` is a versioned library root (has CURRENT or vNNNN version directories)."""
    p = Path(path)
    return (p / CURRENT_FILE).is_file() or (not (p / MANIFEST_FILE).exists() and bool(_version_dirs(p)))


def resolve_library_dir(path) -> Path:
    """The library directory ``path`` stands for: CURRENT's target for a root (the newest version
    if CURRENT is missing, e.g. after a crash between the two steps of a write), else ``path``.

    Raises AnchorLibraryError if CURRENT is unreadable or names no version directory."""
    p = Path(path)
    cur = p / CURRENT_FILE
    if cur.is_file():
        try:
            name = cur.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise AnchorLibraryError(f"{cur}: cannot read the CURRENT pointer ({e})") from e
        if not _VERSION_DIR.match(name) or not (p / name).is_dir():
            raise AnchorLibraryError(f"{cur} names {name!r}, which is not a version directory in {p}; "
                                     f"point it at one of: {', '.join(d.name for _, d in _version_dirs(p)) or 'none'}")
        return p / name
    if not (p / MANIFEST_FILE).exists():
        versions = _version_dirs(p)
        if versions:
            return versions[-1][1]
    return p


def load_library(path, *, expect_fingerprint: str | None = None, expect_hidden_size: int | None = None,
                 verify_checksums: bool = True, expect_model_name: str | None = None) -> AnchorLibrary:
    """Open the library ``path`` stands for (:func:`resolve_library_dir`: CURRENT's version of a
    root, else ``path``) with ``sfcl.library.store.load_library_dir`` and its checks (the keyword
    arguments are its own). Raises AnchorLibraryError for a damaged CURRENT pointer and for
    everything ``load_library_dir`` rejects."""
    return load_library_dir(resolve_library_dir(Path(path)), expect_fingerprint=expect_fingerprint,
                            expect_hidden_size=expect_hidden_size, verify_checksums=verify_checksums,
                            expect_model_name=expect_model_name)


def set_current(root, name: str) -> None:
    """Point ``ROOT/CURRENT`` at version ``name`` atomically (temp file + fsync + os.replace)."""
    root = Path(root)
    if not _VERSION_DIR.match(name) or not (root / name / MANIFEST_FILE).is_file():
        raise ValueError(f"{root / name} is not a version directory")
    fd, tmp = tempfile.mkstemp(prefix=".CURRENT.tmp-", dir=root)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(name + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, root / CURRENT_FILE)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _advance_current(root: Path, n: int) -> None:
    """Point CURRENT at version ``n`` unless a concurrent writer already made a newer one current
    (check and replace under an exclusive flock on the root directory, so CURRENT never goes
    backwards)."""
    import fcntl

    fd = os.open(root, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        cur = resolve_library_dir(root) if (root / CURRENT_FILE).is_file() else None
        m = _VERSION_DIR.match(cur.name) if cur is not None else None
        if m is None or int(m.group(1)) < n:
            set_current(root, f"v{n:04d}")
    finally:
        os.close(fd)  # releases the lock


@dataclass(frozen=True, slots=True)
class VersionInfo:
    """One version of a root, as listed by ``sfcl anchors versions``."""

    name: str  # directory name, "v0001"
    path: Path
    current: bool
    n_anchors: int
    counts: dict  # {"general": int, "domain": int} (from the lineage record; {} for unversioned)
    created: str
    command: str
    parent: str | None
    content_hash: str


def list_versions(root) -> list[VersionInfo]:
    """Versions of ``root``, oldest first. Raises AnchorLibraryError if ``root`` is no root."""
    root = Path(root)
    if not is_root(root):
        raise AnchorLibraryError(f"{root} is not a versioned anchor-library root (no {CURRENT_FILE} and "
                                 "no vNNNN directories)")
    cur = resolve_library_dir(root).name
    out = []
    for _, p in _version_dirs(root):
        try:
            m = json.loads((p / MANIFEST_FILE).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise AnchorLibraryError(f"{p / MANIFEST_FILE}: unreadable ({e})") from e
        v = m.get("version") or {}
        out.append(VersionInfo(name=p.name, path=p, current=p.name == cur, n_anchors=int(m.get("n_anchors", 0)),
                               counts=dict(v.get("counts") or {}), created=str(m.get("created", "")),
                               command=str(v.get("command", "")), parent=v.get("parent"),
                               content_hash=str(m.get("content_hash", ""))))
    return out


# ---------------------------------------------------------------------------------------------
# Fields of a library, as save_library takes them


def library_fields(lib: AnchorLibrary) -> dict:
    """Everything ``save_library`` needs to write ``lib`` again: tensors (CPU copies, not views of
    the map), span texts, doc ids and the inherited manifest fields."""
    f = {name: getattr(lib, name).clone() for name in _TENSOR_FIELDS}
    f["span_texts"] = list(lib.span_texts)
    f["doc_ids"] = list(lib.doc_ids)
    for key in _INHERITED:
        f[key] = lib.manifest.get(key)
    f["build"] = dict(f["build"] or {})
    f["calibration"] = dict(f["calibration"] or {})
    f["corpus_hash"] = str(f["corpus_hash"] or "")
    f["keyword_boost"] = list(f["keyword_boost"] or [])
    return f


def select(fields: dict, keep) -> dict:
    """The same fields restricted to anchor indices ``keep`` (a bool mask (N,) or an index list)."""
    keep = torch.as_tensor(keep)
    idx = torch.nonzero(keep)[:, 0] if keep.dtype == torch.bool else keep.long()
    out = dict(fields)
    for name in _TENSOR_FIELDS:
        out[name] = fields[name][idx]
    out["span_texts"] = [fields["span_texts"][int(i)] for i in idx]
    return out


def append(fields: dict, new: dict) -> dict:
    """Fields with the anchors in ``new`` appended. ``new`` has the tensor fields for M anchors,
    ``span_texts`` (M) and ``doc_ids`` (the docs its ``span_doc`` indexes, merged by name)."""
    out = dict(fields)
    docs = list(fields["doc_ids"])
    remap = []
    for d in new["doc_ids"]:
        if d not in docs:
            docs.append(d)
        remap.append(docs.index(d))
    for name in _TENSOR_FIELDS:
        t = torch.as_tensor(new[name]).to(fields[name].dtype)
        if name == "span_doc":
            t = torch.as_tensor(remap, dtype=fields[name].dtype)[t.long()] if len(t) else t
        if name in ("next_ids", "next_probs") and t.shape[1] != fields[name].shape[1]:
            raise ValueError(f"{name}: new anchors have {t.shape[1]} next-token entries, the library "
                             f"{fields[name].shape[1]}")
        out[name] = torch.cat([fields[name], t])
    out["span_texts"] = list(fields["span_texts"]) + list(new["span_texts"])
    out["doc_ids"] = docs
    return out


def kind_counts(kinds: torch.Tensor) -> dict:
    c = torch.bincount(kinds.long(), minlength=len(KIND_NAMES))
    return {name: int(c[i]) for i, name in enumerate(KIND_NAMES)}


def write_version(out, fields: dict, *, command: str, parent: AnchorLibrary | Path | None = None) -> Path:
    """Write ``fields`` (see :func:`library_fields`) as the next version under root ``out`` and
    make it current. Returns the new version directory.

    ``out`` must be a root, a missing path, or an empty directory (then it becomes a root).
    ``parent`` (the library the write started from) is recorded in the lineage. Raises
    FileExistsError if ``out`` is a plain library or some other non-empty directory (versions are
    immutable), ValueError on invalid fields (see ``save_library``).
    """
    root = Path(out)
    if root.exists() and not root.is_dir():
        raise FileExistsError(f"{root} exists and is not a directory; --out names a library root")
    if (root / MANIFEST_FILE).exists():
        raise FileExistsError(f"{root} is a plain (unversioned) anchor library and is never modified; "
                              "give --out a new directory or a versioned library root")
    if root.is_dir() and not all(_ROOT_ENTRY.match(p.name) for p in root.iterdir()):
        raise FileExistsError(f"{root} is a non-empty directory but not an anchor-library root; "
                              "give --out a new directory or a versioned library root")
    root.mkdir(parents=True, exist_ok=True)
    ppath = parent.path if isinstance(parent, AnchorLibrary) else (Path(parent) if parent else None)
    pman = parent.manifest if isinstance(parent, AnchorLibrary) else None
    kw = {k: v for k, v in fields.items() if k not in ("keyword_boost",)}
    boost = parse_keyword_boost(fields.get("keyword_boost"))
    for _ in range(100):
        versions = _version_dirs(root)
        n = (versions[-1][0] + 1) if versions else 1
        while (root / f"v{n:04d}").exists():  # a half-written or foreign directory: skip it
            n += 1
        name = f"v{n:04d}"
        lineage = {
            "number": n,
            "parent": str(ppath.resolve()) if ppath else None,
            "parent_content_hash": (pman or {}).get("content_hash"),
            "command": command,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "counts": kind_counts(torch.as_tensor(fields["kinds"])),
        }
        try:
            path = save_library(root / name, **kw, keyword_boost=boost, version=lineage)
        except FileExistsError:
            if (root / name).exists():  # another writer took this number
                continue
            raise
        _advance_current(root, n)
        return path
    raise FileExistsError(f"could not allocate a new version directory under {root}")
