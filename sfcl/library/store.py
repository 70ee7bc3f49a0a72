"""The on-disk anchor library: format, save, load, validation.

Owns: the ``sfcl-anchors`` directory format (version 1), :func:`save_library`,
:func:`load_library_dir`, :class:`AnchorLibrary` and the keyword-boost rules stored in the
manifest. Layers above it: ``sfcl.library.versions`` (version roots; its ``load_library`` is what
callers open a library with) and ``sfcl.library.index`` (the search index the snapshotter queries).
Callers of the format itself: the anchor builder and the lifecycle commands write through
``sfcl.library.versions.write_version`` or :func:`save_library`. Nothing here touches the model
or a GPU, and nothing here imports the layers above.

A library is an immutable directory::

    anchors.safetensors  vectors f16 (N,D) unit-norm; counts i32 (N,); weights f32 (N,);
                         decay f32 (N,) (>0); next_ids i32 (N,K) (pad -1); next_probs f16 (N,K)
                         (pad 0); kinds u8 (N,) (0 general, 1 domain); span_doc/span_start/span_end
                         i32 (N,) (index into manifest doc list, char offsets)
    spans.json           {"docs": [doc_id, ...], "texts": [span text per anchor, <= 300 chars]}
    manifest.json        format, format_version, model_fingerprint, model_name, layer,
                         hidden_size, n_anchors, top_k_next, build, corpus_hash, calibration,
                         created, files {name: sha256hex}, content_hash (sha256 over the two
                         data-file hashes), keyword_boost (rule list, optional, default []),
                         version (lineage record of a versioned write, optional; see
                         ``sfcl.library.versions``)

Data lives on the CPU. Loaded tensors are zero-copy views of a private (copy-on-write) memory map
of ``anchors.safetensors``: treat them as read-only; writing would only dirty process pages, never
the file. :meth:`AnchorLibrary.close` drops them so the map is released.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "sfcl-anchors"
FORMAT_VERSION = 1
TENSORS_FILE, SPANS_FILE, MANIFEST_FILE = "anchors.safetensors", "spans.json", "manifest.json"
MAX_SPAN_CHARS = 300
KIND_NAMES = ("general", "domain")
_REBUILD = "rebuild it with `sfcl anchors build`"
# name -> (dtype, shape pattern); "N", "D", "K" are resolved from the manifest.
_SCHEMA = {
    "vectors": (torch.float16, ("N", "D")), "counts": (torch.int32, ("N",)),
    "weights": (torch.float32, ("N",)), "decay": (torch.float32, ("N",)),
    "next_ids": (torch.int32, ("N", "K")), "next_probs": (torch.float16, ("N", "K")),
    "kinds": (torch.uint8, ("N",)), "span_doc": (torch.int32, ("N",)),
    "span_start": (torch.int32, ("N",)), "span_end": (torch.int32, ("N",)),
}
_FIELDS = tuple(_SCHEMA)


class AnchorLibraryError(Exception):
    """A library directory is missing, damaged, of another format, or built for another model."""


@dataclass(frozen=True, slots=True)
class KeywordBoost:
    """One library-level keyword-boost rule, applied at snapshot time.

    When the request text contains any of ``keywords`` (case-insensitive substring match, so
    "indemnif" matches "Indemnification"), anchors whose kind is in ``kinds`` ("general",
    "domain") have their weight multiplied by ``multiplier`` (> 0; 1.5 = the seed's 1.5x).
    Several matching rules multiply. Stored in the manifest as
    ``{"keywords": [...], "kinds": [...], "multiplier": 1.5}``.
    """

    keywords: tuple[str, ...]
    kinds: tuple[str, ...]
    multiplier: float

    def __post_init__(self) -> None:
        if not self.keywords or not all(isinstance(k, str) and k.strip() for k in self.keywords):
            raise ValueError("keyword_boost: 'keywords' must be a non-empty list of non-empty strings")
        if not self.kinds or any(k not in KIND_NAMES for k in self.kinds):
            raise ValueError(f"keyword_boost: 'kinds' must be a non-empty list of {KIND_NAMES}")
        m = self.multiplier
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not (0 < m < float("inf")):
            raise ValueError(f"keyword_boost: 'multiplier' must be a finite number > 0, got {m!r}")

    def to_json(self) -> dict:
        return {"keywords": list(self.keywords), "kinds": list(self.kinds),
                "multiplier": float(self.multiplier)}


def parse_keyword_boost(obj) -> list[KeywordBoost]:
    """Validate a rule list (the manifest's ``keyword_boost`` or a ``--rules`` file).

    Raises ValueError naming the bad rule."""
    if obj is None:
        return []
    if not isinstance(obj, list):
        raise ValueError("keyword_boost must be a JSON list of rules")
    rules = []
    for i, r in enumerate(obj):
        if not isinstance(r, dict) or set(r) - {"keywords", "kinds", "multiplier"}:
            raise ValueError(f"keyword_boost rule {i}: expected an object with keys keywords, kinds, "
                             f"multiplier, got {r!r}")
        kw, kinds = r.get("keywords"), r.get("kinds", ["domain"])
        if isinstance(kw, str) or isinstance(kinds, str) or not isinstance(kw, list) \
                or not isinstance(kinds, list):
            raise ValueError(f"keyword_boost rule {i}: 'keywords' and 'kinds' must be lists")
        try:
            rules.append(KeywordBoost(tuple(kw), tuple(kinds), r.get("multiplier")))
        except ValueError as e:
            raise ValueError(f"rule {i}: {e}") from None
    return rules


@dataclass
class AnchorLibrary:
    """A loaded anchor library. N anchors of hidden size D with top-K next-token lists.

    Tensor fields (CPU, memory-mapped, read-only by convention; dtypes/shapes as in the module
    docstring): ``vectors`` (N, D) f16, ``counts``, ``weights``, ``decay``, ``next_ids`` (N, K),
    ``next_probs`` (N, K), ``kinds``, ``span_doc``, ``span_start``, ``span_end``.
    ``span_texts`` has N entries; ``doc_ids`` is the manifest's doc list indexed by ``span_doc``.
    """

    path: Path
    manifest: dict
    vectors: torch.Tensor
    counts: torch.Tensor
    weights: torch.Tensor
    decay: torch.Tensor
    next_ids: torch.Tensor
    next_probs: torch.Tensor
    kinds: torch.Tensor
    span_doc: torch.Tensor
    span_start: torch.Tensor
    span_end: torch.Tensor
    span_texts: list[str]
    doc_ids: list[str]

    @property
    def n_anchors(self) -> int:
        return int(self.manifest["n_anchors"])

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def layer(self) -> int:
        """Decoder layer whose hidden states the anchors were taken from."""
        return int(self.manifest["layer"])

    @property
    def top_k_next(self) -> int:
        return int(self.manifest["top_k_next"])

    @property
    def calibration(self) -> dict:
        """Free-form trigger statistics recorded by the builder."""
        return self.manifest.get("calibration") or {}

    def span(self, i: int) -> dict:
        """Representative source span of anchor ``i``: {"doc_id", "start", "end", "text"}."""
        return {"doc_id": self.doc_ids[int(self.span_doc[i])], "start": int(self.span_start[i]),
                "end": int(self.span_end[i]), "text": self.span_texts[i]}

    @property
    def keyword_boost(self) -> list[KeywordBoost]:
        """Library-level keyword-boost rules (validated at load; [] for older libraries)."""
        return parse_keyword_boost(self.manifest.get("keyword_boost"))

    @property
    def content_hash(self) -> str:
        """sha256 over the data files' hashes: equal for libraries with identical content."""
        return self.manifest.get("content_hash") or content_hash(self.manifest["files"])

    def kind_name(self, i: int) -> str:
        """"general" or "domain" for anchor ``i``."""
        return KIND_NAMES[int(self.kinds[i])]

    def close(self) -> None:
        """Drop this object's references to the mapped tensors (the map is unmapped once no
        other tensor, e.g. a ``sfcl.library.index.AnchorIndex``, still views it). Any later use
        of the tensor fields fails."""
        for name in _FIELDS:
            setattr(self, name, None)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def content_hash(files: dict) -> str:
    """Hash identifying a library's content: sha256 of the tensor and span file hashes."""
    return hashlib.sha256(f"{files.get(TENSORS_FILE)}:{files.get(SPANS_FILE)}".encode()).hexdigest()


def _as(name: str, x, dtype: torch.dtype) -> torch.Tensor:
    t = torch.as_tensor(x)
    if dtype.is_floating_point != t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name}: expected a {'float' if dtype.is_floating_point else 'integer'}"
                         f" tensor convertible to {dtype}, got {t.dtype}")
    return t.detach().to("cpu", dtype).contiguous()


UNIT_NORM_TOL = 1e-3  # |norm - 1| of a float16-rounded unit vector (D <= 16k) stays far below this


def save_library(out_dir, *, vectors, counts, weights, decay, next_ids, next_probs, kinds,
                 span_doc, span_start, span_end, span_texts: list[str], doc_ids: list[str],
                 model_fingerprint: str, model_name: str, layer: int, build: dict,
                 corpus_hash: str, calibration: dict, keyword_boost: list | None = None,
                 version: dict | None = None) -> Path:
    """Write a new library directory ``out_dir`` and return its path.

    Array arguments may be tensors or numpy arrays of any float (resp. integer) dtype; they are
    cast to the format dtypes. ``vectors`` (N, D) is L2-normalised (in float32) before the float16
    cast. ``next_ids``/``next_probs`` are (N, K); the rest are (N,). ``span_texts`` has N strings
    (cut to 300 chars); ``span_doc`` indexes ``doc_ids``. ``keyword_boost`` is a rule list
    (:class:`KeywordBoost` objects or their JSON dicts); ``version`` the lineage record that
    ``sfcl.library.versions.write_version`` passes (stored as the manifest's ``version``).

    Raises ValueError on wrong shapes/dtypes/values (zero vector, kind not 0/1, decay <= 0,
    span_doc out of range, next_ids < -1); FileExistsError if ``out_dir`` exists and is not an
    empty directory (libraries are immutable versions: write a new directory). Written to a
    temporary sibling directory first, then renamed into place atomically.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} already exists and is not empty; anchor libraries are "
                              "immutable, write a new version directory instead")
    given = dict(vectors=vectors, counts=counts, weights=weights, decay=decay, next_ids=next_ids,
                 next_probs=next_probs, kinds=kinds, span_doc=span_doc, span_start=span_start,
                 span_end=span_end)
    t = {name: _as(name, given[name], _SCHEMA[name][0]) for name in _FIELDS}
    v = torch.as_tensor(vectors).detach().to("cpu", torch.float32)
    if v.dim() != 2:
        raise ValueError(f"vectors: expected shape (N, D), got {tuple(v.shape)}")
    n, d = v.shape
    nids = t["next_ids"]
    if nids.dim() != 2 or nids.shape[0] != n:
        raise ValueError(f"next_ids: expected shape (N={n}, K), got {tuple(nids.shape)}")
    dims = {"N": n, "D": d, "K": nids.shape[1]}
    for name, (_, pattern) in _SCHEMA.items():
        want = tuple(dims[p] for p in pattern)
        if tuple(t[name].shape) != want:
            raise ValueError(f"{name}: expected shape {want}, got {tuple(t[name].shape)}")
    norms = v.norm(dim=1, keepdim=True)
    if n and not bool((norms > 0).all() and torch.isfinite(v).all()):
        raise ValueError("vectors: every row must be finite and non-zero")
    # rows already unit-norm to float16 precision (a library's own stored vectors, re-saved by
    # inject/prune/versions) are kept as they are: dividing by a norm of 1 +- 1e-4 re-rounds some
    # float16 elements, so a re-saved library would not be bit-identical to its parent
    unit = (norms - 1.0).abs() <= UNIT_NORM_TOL
    t["vectors"] = torch.where(unit, v, v / norms).to(torch.float16)
    if n and bool(((t["kinds"] != 0) & (t["kinds"] != 1)).any()):
        raise ValueError("kinds: values must be 0 (general) or 1 (domain)")
    if n and not bool((t["decay"] > 0).all()):
        raise ValueError("decay: every rate must be > 0")
    if n and bool((t["next_ids"] < -1).any()):
        raise ValueError("next_ids: ids must be >= 0, or -1 for padding")
    if n and bool(((t["span_doc"] < 0) | (t["span_doc"] >= len(doc_ids))).any()):
        raise ValueError(f"span_doc: indices must be in [0, {len(doc_ids)})")
    if len(span_texts) != n or not all(isinstance(s, str) for s in span_texts):
        raise ValueError(f"span_texts: expected {n} strings, got {len(span_texts)} items")
    spans = {"docs": [str(x) for x in doc_ids], "texts": [s[:MAX_SPAN_CHARS] for s in span_texts]}
    boost = [r.to_json() for r in parse_keyword_boost(
        [r.to_json() if isinstance(r, KeywordBoost) else r for r in (keyword_boost or [])])]

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file(t, str(tmp / TENSORS_FILE), metadata={"format": FORMAT})
        (tmp / SPANS_FILE).write_text(json.dumps(spans, ensure_ascii=False), encoding="utf-8")
        manifest = {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "model_fingerprint": str(model_fingerprint), "model_name": str(model_name),
            "layer": int(layer), "hidden_size": d, "n_anchors": n, "top_k_next": dims["K"],
            "build": dict(build), "corpus_hash": str(corpus_hash),
            "calibration": dict(calibration),
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "files": {f: _sha256(tmp / f) for f in (TENSORS_FILE, SPANS_FILE)},
        }
        manifest["content_hash"] = content_hash(manifest["files"])
        manifest["keyword_boost"] = boost
        if version is not None:
            manifest["version"] = dict(version)
        (tmp / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
        # mkdtemp makes 0700; a library is a shared read-only artefact: honour the umask instead
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for f in (TENSORS_FILE, SPANS_FILE, MANIFEST_FILE):
            os.chmod(tmp / f, 0o666 & ~umask)
        try:
            os.rename(tmp, out_dir)  # replaces only a missing or empty directory
        except OSError as e:
            raise FileExistsError(f"{out_dir} appeared while writing; not overwritten: {e}") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise AnchorLibraryError(f"{path}: {what} is missing; {_REBUILD}")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AnchorLibraryError(f"{path}: {what} is not valid JSON ({e}); {_REBUILD}") from e
    if not isinstance(obj, dict):
        raise AnchorLibraryError(f"{path}: {what} must be a JSON object; {_REBUILD}")
    return obj


def load_library_dir(path, *, expect_fingerprint: str | None = None,
                     expect_hidden_size: int | None = None, verify_checksums: bool = True,
                     expect_model_name: str | None = None) -> AnchorLibrary:
    """Open and validate the library directory ``path`` (tensors memory-mapped, not copied).
    A versioned root is opened by ``sfcl.library.versions.load_library``, which resolves it to
    one of these directories.

    ``expect_fingerprint``/``expect_hidden_size`` are the serving model's; ``expect_model_name``
    only improves the mismatch message. ``verify_checksums`` hashes both data files (reads them
    once; ~40 MB for N=32768, D=576).

    Raises AnchorLibraryError on: missing directory/files, invalid JSON, other format or
    format_version, sha256 mismatch (damaged or truncated file), unreadable safetensors header,
    missing tensors, dtype/shape inconsistent with the manifest (N, D, K), span lists of the
    wrong length, model fingerprint mismatch, hidden size mismatch, invalid keyword_boost.
    """
    path = Path(path)
    if not path.is_dir():
        raise AnchorLibraryError(f"anchor library directory {path} does not exist; build one "
                                 "with `sfcl anchors build` or fix the configured path")
    mf_path = path / MANIFEST_FILE
    m = _read_json(mf_path, "manifest")
    if m.get("format") != FORMAT or m.get("format_version") != FORMAT_VERSION:
        raise AnchorLibraryError(
            f"{mf_path}: format {m.get('format')!r} version {m.get('format_version')!r} is not "
            f"supported (this server reads {FORMAT!r} version {FORMAT_VERSION}); {_REBUILD}")
    for key, typ in (("model_fingerprint", str), ("model_name", str), ("layer", int),
                     ("hidden_size", int), ("n_anchors", int), ("top_k_next", int),
                     ("files", dict)):
        if not isinstance(m.get(key), typ):
            raise AnchorLibraryError(f"{mf_path}: field {key!r} missing or not {typ.__name__}; "
                                     f"{_REBUILD}")
    if not isinstance(m.get("calibration") or {}, dict):
        raise AnchorLibraryError(f"{mf_path}: field 'calibration' is not dict; {_REBUILD}")
    if expect_fingerprint is not None and m["model_fingerprint"] != expect_fingerprint:
        raise AnchorLibraryError(
            f"anchor library {path} was built for model {m['model_name']!r} (fingerprint "
            f"{m['model_fingerprint']}), but the server runs model "
            f"{expect_model_name or '<unnamed>'!r} (fingerprint {expect_fingerprint}); "
            f"rebuild it for this model with `sfcl anchors build` or point the server at a "
            f"library built for it")
    if expect_hidden_size is not None and m["hidden_size"] != expect_hidden_size:
        raise AnchorLibraryError(
            f"anchor library {path} has hidden size {m['hidden_size']} (layer {m['layer']} of "
            f"{m['model_name']!r}) but the server model's hidden size is {expect_hidden_size}; "
            f"{_REBUILD} for the served model")
    for fname in (TENSORS_FILE, SPANS_FILE):
        fp = path / fname
        if not fp.is_file():
            raise AnchorLibraryError(f"{fp} is missing; {_REBUILD}")
        if verify_checksums and _sha256(fp) != m["files"].get(fname):
            raise AnchorLibraryError(f"{fp}: sha256 checksum does not match the manifest (file "
                                     f"damaged or truncated); {_REBUILD} or restore a copy")
    n, d, k = m["n_anchors"], m["hidden_size"], m["top_k_next"]
    dims = {"N": n, "D": d, "K": k}
    tensors = {}
    tf = path / TENSORS_FILE
    try:
        with safe_open(str(tf), framework="pt") as f:
            present = set(f.keys())
            for name, (dtype, pattern) in _SCHEMA.items():
                if name not in present:
                    raise AnchorLibraryError(f"{tf}: tensor {name!r} is missing; {_REBUILD}")
                x = f.get_tensor(name)
                want = tuple(dims[p] for p in pattern)
                if x.dtype != dtype or tuple(x.shape) != want:
                    raise AnchorLibraryError(
                        f"{tf}: tensor {name!r} is {x.dtype} {tuple(x.shape)}, manifest implies "
                        f"{dtype} {want}; {_REBUILD}")
                tensors[name] = x
    except AnchorLibraryError:
        raise
    except Exception as e:  # SafetensorError (header/size problems), OSError
        raise AnchorLibraryError(f"{tf}: cannot read safetensors file ({e}); {_REBUILD}") from e
    sp_path = path / SPANS_FILE
    spans = _read_json(sp_path, "span file")
    docs, texts = spans.get("docs"), spans.get("texts")
    if not isinstance(docs, list) or not isinstance(texts, list) or len(texts) != n:
        raise AnchorLibraryError(f"{sp_path}: expected 'docs' list and {n} 'texts'; {_REBUILD}")
    sd = tensors["span_doc"]
    if n and (int(sd.max()) >= len(docs) or int(sd.min()) < 0):
        raise AnchorLibraryError(f"{tf}: span_doc indexes outside the {len(docs)} docs in "
                                 f"{sp_path}; {_REBUILD}")
    try:
        parse_keyword_boost(m.get("keyword_boost"))
    except ValueError as e:
        raise AnchorLibraryError(f"{mf_path}: invalid keyword_boost ({e}); fix the rules with "
                                 "`sfcl anchors boost`") from e
    return AnchorLibrary(path=path, manifest=m, span_texts=texts, doc_ids=docs, **tensors)
