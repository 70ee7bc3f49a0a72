"""sfcl.engine_stack: anchor loading at start-up (the first-start build and --anchor-timeout)."""

import time

import pytest

from sfcl.config import SnapshotConfig
from sfcl.library.store import AnchorLibraryError


def test_first_start_build_is_not_under_the_load_timeout(lm, nda_library, monkeypatch, tmp_path):
    """A default-library build slower than --anchor-timeout still starts the server, built once."""
    import sfcl.engine_stack as stack

    calls = []

    def slow_build(lm_, scfg, progress):
        calls.append(1)
        time.sleep(0.5)  # "building": longer than the 0.2 s load timeout below
        return nda_library.path

    monkeypatch.setattr(stack, "ensure_default_library", slow_build)
    lib = stack.load_anchors(lm, SnapshotConfig(anchor_timeout_s=0.2, anchor_retry=3, cache_dir=tmp_path), False)
    assert lib is not None and lib.n_anchors == nda_library.n_anchors
    assert calls == [1]
    lib.close()


def test_a_failed_first_start_build_is_reported_once(lm, monkeypatch, tmp_path):
    import sfcl.engine_stack as stack

    calls = []

    def broken_build(lm_, scfg, progress):
        calls.append(1)
        raise OSError("disk full")

    monkeypatch.setattr(stack, "ensure_default_library", broken_build)
    with pytest.raises(AnchorLibraryError, match="building the default anchor library failed: disk full"):
        stack.load_anchors(lm, SnapshotConfig(anchor_retry=3, cache_dir=tmp_path), False)
    assert calls == [1]  # no retry rebuilds
    scfg = SnapshotConfig(anchor_retry=3, anchor_optional=True, cache_dir=tmp_path)
    assert stack.load_anchors(lm, scfg, False) is None  # --anchor-optional: start without snapshots


def test_build_engine_loads_the_kernels_from_its_cache_dir_before_the_library(monkeypatch, tmp_path):
    """The native kernels come from (or are built into) ``--cache-dir`` before the library loads or
    builds and before the weight format is chosen: both load the kernels too, with no cache dir of
    their own (the default one, ~/.cache/sfcl, would then get the build)."""
    import sfcl.engine_stack as stack
    from sfcl.config import EngineConfig, ModelConfig

    calls = []
    monkeypatch.setattr(stack, "load_model", lambda *a, **k: object())
    monkeypatch.setattr(stack.decode_kernel, "load", lambda verbose=True, cache_dir=None: calls.append(cache_dir) or True)

    def stop(*a, **k):
        calls.append("anchors")
        raise AnchorLibraryError("stop here")

    monkeypatch.setattr(stack, "load_anchors", stop)
    with pytest.raises(AnchorLibraryError, match="stop here"):
        stack.build_engine(ModelConfig(device="cpu"), EngineConfig(), SnapshotConfig(cache_dir=tmp_path), progress=False)
    assert calls == [tmp_path, "anchors"]


@pytest.mark.parametrize("variable", ["SFCL_INT4_KERNEL", "SFCL_INT8_KERNEL"])
def test_build_engine_refuses_a_bad_kernel_variable_before_loading(monkeypatch, tmp_path, variable):
    """A bad ``$SFCL_INT4_KERNEL`` / ``$SFCL_INT8_KERNEL`` stops the start with a ValueError naming the
    variable before the model loads (it used to surface after the model and library had loaded);
    values are read case-insensitively."""
    import sfcl.engine_stack as stack
    from sfcl.config import EngineConfig, ModelConfig

    loaded = []
    monkeypatch.setattr(stack, "load_model", lambda *a, **k: loaded.append(1) or (_ for _ in ()).throw(RuntimeError("loaded")))
    monkeypatch.setenv(variable, "fast")
    with pytest.raises(ValueError, match=variable):
        stack.build_engine(ModelConfig(device="cpu"), EngineConfig(), SnapshotConfig(cache_dir=tmp_path), progress=False)
    assert loaded == []
    monkeypatch.setenv(variable, " AUTO ")
    with pytest.raises(RuntimeError, match="loaded"):  # accepted: the start goes on to the model
        stack.build_engine(ModelConfig(device="cpu"), EngineConfig(), SnapshotConfig(cache_dir=tmp_path), progress=False)
