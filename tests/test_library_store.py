"""sfcl.library.store: library format round trip, validation errors, memory mapping."""
import gc
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sfcl.library.store import AnchorLibrary, AnchorLibraryError, load_library_dir, save_library

FP = "fp-abc123"


def make_arrays(n=40, d=16, k=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    next_ids = torch.randint(0, 1000, (n, k), generator=g, dtype=torch.int32)
    next_probs = torch.rand(n, k, generator=g).to(torch.float16)
    next_ids[0, 5:] = -1
    next_probs[0, 5:] = 0
    return dict(
        vectors=torch.randn(n, d, generator=g) * 3.0,
        counts=torch.randint(1, 50, (n,), generator=g, dtype=torch.int32),
        weights=torch.where(torch.arange(n) % 3 == 0, 0.3, 1.0).float(),
        decay=torch.rand(n, generator=g) + 0.1,
        next_ids=next_ids, next_probs=next_probs,
        kinds=(torch.arange(n) % 3 == 0).to(torch.uint8),
        span_doc=torch.randint(0, 3, (n,), generator=g, dtype=torch.int32),
        span_start=torch.arange(n, dtype=torch.int32) * 10,
        span_end=torch.arange(n, dtype=torch.int32) * 10 + 7,
        span_texts=[f"span text {i} é" for i in range(n)],
        doc_ids=["doc/a.txt", "doc/b.txt", "doc/c.txt"],
    )


def save(out, arrays=None, **over):
    arrays = arrays if arrays is not None else make_arrays()
    kw = dict(model_fingerprint=FP, model_name="tiny-llama", layer=5, build={"seed": 0, "k": 8},
              corpus_hash="c0ffee", calibration={"p50": 0.8})
    kw.update(over)
    return save_library(out, **arrays, **kw)


@pytest.fixture
def lib_dir(tmp_path):
    return save(tmp_path / "lib-v1")


def test_round_trip(tmp_path):
    a = make_arrays()
    out = save(tmp_path / "lib", a)
    assert sorted(p.name for p in out.iterdir()) == ["anchors.safetensors", "manifest.json",
                                                     "spans.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dir gone
    lib = load_library_dir(out, expect_fingerprint=FP, expect_hidden_size=16)
    assert isinstance(lib, AnchorLibrary)
    assert (lib.n_anchors, lib.hidden_size, lib.layer, lib.top_k_next) == (40, 16, 5, 8)
    assert lib.calibration == {"p50": 0.8}
    m = lib.manifest
    assert m["format"] == "sfcl-anchors" and m["format_version"] == 1
    assert m["build"] == {"seed": 0, "k": 8} and m["corpus_hash"] == "c0ffee"
    assert m["model_name"] == "tiny-llama" and set(m["files"]) == {"anchors.safetensors",
                                                                  "spans.json"}
    assert lib.vectors.dtype == torch.float16 and lib.vectors.shape == (40, 16)
    norms = lib.vectors.float().norm(dim=1)
    assert torch.allclose(norms, torch.ones(40), atol=2e-3)
    ref = a["vectors"] / a["vectors"].norm(dim=1, keepdim=True)
    assert torch.allclose(lib.vectors.float(), ref, atol=1e-3)
    for name, dtype in [("counts", torch.int32), ("weights", torch.float32),
                        ("decay", torch.float32), ("next_ids", torch.int32),
                        ("next_probs", torch.float16), ("kinds", torch.uint8),
                        ("span_doc", torch.int32), ("span_start", torch.int32),
                        ("span_end", torch.int32)]:
        got = getattr(lib, name)
        assert got.dtype == dtype, name
        assert torch.equal(got, a[name].to(dtype)), name
    assert lib.span_texts == a["span_texts"] and lib.doc_ids == a["doc_ids"]
    assert lib.span(3) == {"doc_id": a["doc_ids"][int(a["span_doc"][3])], "start": 30, "end": 37,
                           "text": "span text 3 é"}
    assert lib.kind_name(0) == "domain" and lib.kind_name(1) == "general"
    assert lib.next_ids[0, 5:].tolist() == [-1, -1, -1]


def _mapped(path: Path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(str(path)) for line in f)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_vectors_are_memory_mapped_and_close_releases(lib_dir):
    tf = (lib_dir / "anchors.safetensors").resolve()
    lib = load_library_dir(lib_dir)
    assert _mapped(tf)
    # the tensor's bytes live inside the file mapping, i.e. they were not copied out
    ptr = lib.vectors.data_ptr()
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(tf)):
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((lo, hi))
    assert any(lo <= ptr < hi for lo, hi in ranges)
    lib.close()
    assert lib.vectors is None
    gc.collect()
    assert not _mapped(tf)


def test_refuses_overwrite(lib_dir, tmp_path):
    with pytest.raises(FileExistsError):
        save(lib_dir)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_library_dir(save(empty)).n_anchors == 40  # an empty directory is fine


def test_save_validation(tmp_path):
    a = make_arrays()
    with pytest.raises(ValueError, match="counts"):
        save(tmp_path / "x", {**a, "counts": a["counts"][:-1]})
    with pytest.raises(ValueError, match="kinds"):
        save(tmp_path / "x", {**a, "kinds": torch.full((40,), 2, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="counts"):
        save(tmp_path / "x", {**a, "counts": a["counts"].float()})
    with pytest.raises(ValueError, match="span_texts"):
        save(tmp_path / "x", {**a, "span_texts": a["span_texts"][:-1]})
    v = a["vectors"].clone()
    v[2] = 0
    with pytest.raises(ValueError, match="vectors"):
        save(tmp_path / "x", {**a, "vectors": v})
    assert not (tmp_path / "x").exists()
    assert not list(tmp_path.iterdir())  # no temp dirs left behind


def test_save_accepts_numpy_and_int64(tmp_path):
    a = make_arrays()
    a = {k: (v.numpy().astype(np.int64) if k in ("counts", "span_doc") else v)
         for k, v in a.items()}
    a["vectors"] = a["vectors"].numpy().astype(np.float64)
    lib = load_library_dir(save(tmp_path / "lib", a))
    assert lib.counts.dtype == torch.int32 and lib.vectors.dtype == torch.float16


def test_damaged_file_checksum(lib_dir):
    tf = lib_dir / "anchors.safetensors"
    data = bytearray(tf.read_bytes())
    for i in range(len(data) - 50, len(data) - 40):
        data[i] ^= 0xFF
    tf.write_bytes(bytes(data))
    with pytest.raises(AnchorLibraryError, match="checksum"):
        load_library_dir(lib_dir)


def test_damaged_spans_checksum(lib_dir):
    sp = lib_dir / "spans.json"
    sp.write_text(sp.read_text().replace("span text 1 ", "span text X "))
    with pytest.raises(AnchorLibraryError, match="spans.json.*checksum"):
        load_library_dir(lib_dir)


def test_truncated_file(lib_dir):
    tf = lib_dir / "anchors.safetensors"
    data = tf.read_bytes()
    tf.write_bytes(data[: len(data) // 2])
    with pytest.raises(AnchorLibraryError, match="checksum"):
        load_library_dir(lib_dir)
    # without checksums the safetensors reader itself must refuse, still as AnchorLibraryError
    with pytest.raises(AnchorLibraryError, match="anchors.safetensors"):
        load_library_dir(lib_dir, verify_checksums=False)
    tf.write_bytes(data[:5])
    with pytest.raises(AnchorLibraryError, match="anchors.safetensors"):
        load_library_dir(lib_dir, verify_checksums=False)


def test_missing_pieces(lib_dir, tmp_path):
    with pytest.raises(AnchorLibraryError, match="does not exist"):
        load_library_dir(tmp_path / "nope")
    (lib_dir / "spans.json").unlink()
    with pytest.raises(AnchorLibraryError, match="spans.json"):
        load_library_dir(lib_dir)
    (lib_dir / "manifest.json").unlink()
    with pytest.raises(AnchorLibraryError, match="manifest.*missing.*sfcl anchors build"):
        load_library_dir(lib_dir)


def _edit_manifest(lib_dir, **changes):
    mf = lib_dir / "manifest.json"
    m = json.loads(mf.read_text())
    m.update(changes)
    mf.write_text(json.dumps(m))


def test_bad_manifest(lib_dir):
    (lib_dir / "manifest.json").write_text("{not json")
    with pytest.raises(AnchorLibraryError, match="not valid JSON"):
        load_library_dir(lib_dir)


def test_wrong_format_version(lib_dir):
    _edit_manifest(lib_dir, format_version=2)
    with pytest.raises(AnchorLibraryError, match="version 2"):
        load_library_dir(lib_dir)


def test_manifest_shape_inconsistency(lib_dir):
    _edit_manifest(lib_dir, n_anchors=41)
    with pytest.raises(AnchorLibraryError, match="'counts'|'vectors'"):
        load_library_dir(lib_dir)
    _edit_manifest(lib_dir, n_anchors=40, top_k_next=4)
    with pytest.raises(AnchorLibraryError, match="next_ids"):
        load_library_dir(lib_dir)


def test_missing_tensor(tmp_path, lib_dir):
    from safetensors.torch import load_file, save_file
    tf = lib_dir / "anchors.safetensors"
    t = {k: v.clone() for k, v in load_file(str(tf)).items() if k != "decay"}
    save_file(t, str(tf))
    with pytest.raises(AnchorLibraryError, match="'decay' is missing"):
        load_library_dir(lib_dir, verify_checksums=False)


def test_fingerprint_mismatch_names_both(lib_dir):
    with pytest.raises(AnchorLibraryError) as ei:
        load_library_dir(lib_dir, expect_fingerprint="fp-other", expect_model_name="big-llama")
    msg = str(ei.value)
    for s in ("tiny-llama", FP, "big-llama", "fp-other"):
        assert s in msg


def test_hidden_size_mismatch(lib_dir):
    with pytest.raises(AnchorLibraryError, match="hidden size 16.*32"):
        load_library_dir(lib_dir, expect_hidden_size=32)


def test_the_format_imports_nothing_above_it():
    """The format is the bottom layer: versions (roots) and index (search) import it, never the
    reverse (top-level and function-local imports alike)."""
    import ast

    import sfcl.library.store as store

    tree = ast.parse(Path(store.__file__).read_text(encoding="utf-8"))
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not [m for m in names if m.startswith("sfcl")]
