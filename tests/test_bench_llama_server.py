"""sfcl.bench.llama_server: finding, building (failure paths) and running llama.cpp's llama-server."""

from __future__ import annotations

import os
import stat

import pytest

from sfcl.bench import llama_server as ls


def _exe(path, text="#!/bin/sh\necho fake\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
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


FAKE_SERVER = """#!{python}
import http.server, os, signal, sys
argv = sys.argv[1:]
if "--no-repack" not in argv:
    os.kill(os.getpid(), signal.SIGSEGV)  # what llama.cpp's AMX matmul did on an Intel Xeon with AMX
port = int(argv[argv.index("--port") + 1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_a_server_killed_by_a_signal_is_started_again_without_repacking(tmp_path):
    import sys

    from sfcl.bench.config import BenchConfig
    from sfcl.bench.run import Results, _start_llama_server

    binary = _exe(tmp_path / "llama-server", FAKE_SERVER.format(python=sys.executable))
    res, extra = Results(), ["--flash-attn", "off"]
    cfg = BenchConfig(ready_timeout=30)
    with _start_llama_server(binary, "/m.gguf", 4, 512, cfg, extra, res, tmp_path) as srv:
        assert srv.proc.poll() is None and srv.argv[-1] == "--no-repack"
    assert extra == ["--flash-attn", "off", "--no-repack"]  # later levels start without repacking at once
    assert len(res.notes) == 1 and "signal 11" in res.notes[0] and "--no-repack" in res.notes[0]
    with _start_llama_server(binary, "/m.gguf", 1, 512, cfg, extra, res, tmp_path) as srv:
        assert srv.argv.count("--no-repack") == 1
    assert len(res.notes) == 1


def test_a_server_that_crashes_without_repacking_too_is_an_error(tmp_path):
    from sfcl.bench.config import BenchConfig
    from sfcl.bench.run import Results, _start_llama_server

    binary = _exe(tmp_path / "llama-server", "#!/bin/sh\nkill -SEGV $$\n")
    res = Results()
    with pytest.raises(RuntimeError, match="exited with code -11"):
        _start_llama_server(binary, "/m.gguf", 1, 512, BenchConfig(ready_timeout=30), [], res, tmp_path)
    assert len(res.notes) == 1  # retried once, with --no-repack, then gave up
