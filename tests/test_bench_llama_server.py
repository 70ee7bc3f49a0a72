"""sfcl.bench.llama_server: finding, building (failure paths) and running llama.cpp's llama-server."""

from __future__ import annotations

import os
import stat

import pytest

from sfcl.bench import llama_server as ls


def _exe(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\necho fake\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_argv_gives_every_slot_its_context_and_binds_loopback(tmp_path):
    argv = ls.llama_server_argv(tmp_path / "llama-server", "/m.gguf", 8123, n_parallel=16, ctx_per_slot=4096,
                                threads=2, extra=["--seed", "1"])
    assert argv[argv.index("-np") + 1] == "16" and argv[argv.index("-c") + 1] == str(16 * 4096)
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("-t") + 1] == "2"
    assert argv[argv.index("-tb") + 1] == "2" and argv[-2:] == ["--seed", "1"]
    with pytest.raises(ValueError):
        ls.llama_server_argv(tmp_path, "/m.gguf", 1, n_parallel=0, ctx_per_slot=4096, threads=1)


def test_env_binary_wins_and_a_bad_one_is_named(tmp_path, monkeypatch):
    b = _exe(tmp_path / "bin" / "llama-server")
    monkeypatch.setenv(ls.ENV_BINARY, str(b))
    assert ls.find_llama_server(tmp_path / "cache") == b
    monkeypatch.setenv(ls.ENV_BINARY, str(tmp_path / "nope"))
    with pytest.raises(ls.LlamaServerUnavailable, match="nope is not an executable"):
        ls.find_llama_server(tmp_path / "cache")


def test_cache_is_keyed_by_version_and_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv(ls.ENV_BINARY, raising=False)
    assert ls.find_llama_server(tmp_path, "0.3.36") is None
    b = _exe(ls.cached_binary(tmp_path, "0.3.36"))
    assert ls.cpu_key() in str(b.parent) and len(ls.cpu_key()) == 12
    assert ls.find_llama_server(tmp_path, "0.3.36") == b
    assert ls.find_llama_server(tmp_path, "0.3.37") is None  # another version builds its own
    monkeypatch.setattr(ls, "installed_version", lambda: None)
    assert ls.find_llama_server(tmp_path) == b  # no llama-cpp-python installed: any cached build for this CPU
    assert ls.build_llama_server(tmp_path, "0.3.36") == b  # cached: no download, no cmake


def test_build_without_cmake_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.delenv(ls.ENV_BINARY, raising=False)
    monkeypatch.setattr(ls.shutil, "which", lambda name: None)
    with pytest.raises(ls.LlamaServerUnavailable, match="cmake not found"):
        ls.build_llama_server(tmp_path, "0.0.1")
    with pytest.raises(ls.LlamaServerUnavailable, match="no llama-server binary"):
        ls.llama_server(tmp_path, "0.0.1", build=False)


def test_failed_download_names_the_log(tmp_path, monkeypatch):
    """pip fails (as it would offline or for a version that does not exist): a clear error, the
    temporary build folder removed, nothing cached."""
    monkeypatch.delenv(ls.ENV_BINARY, raising=False)
    monkeypatch.setattr(ls, "_cmake", lambda: "cmake")
    made = []
    real = ls.tempfile.mkdtemp

    def mkdtemp(**kw):
        made.append(real(**kw))
        return made[-1]

    monkeypatch.setattr(ls.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(ls.sys, "executable", "/bin/false")  # `python -m pip download` fails
    with pytest.raises(ls.LlamaServerUnavailable, match="build.log"):
        ls.build_llama_server(tmp_path, "0.0.1", progress=False)
    assert made and not os.path.exists(made[0])
    assert not ls.cached_binary(tmp_path, "0.0.1").exists()
