"""Thread counts: ``sfcl.engine_stack.engine_threads`` defaults, ``sfcl serve --threads`` errors and
huge values, and the runner switching torch threads per step (prefill vs decode)."""

import pytest
import torch


def test_engine_threads_defaults_and_explicit():
    from sfcl.engine_stack import engine_threads

    assert engine_threads(None, None, cores=2) == (2, 2)  # decode and prefill on all cores
    assert engine_threads(None, None, cores=1) == (1, 1)
    assert engine_threads(3, None, cores=2) == (3, 3)  # prefill never below decode by default
    assert engine_threads(3, None, cores=8) == (3, 8)
    assert engine_threads(1, None, cores=2) == (1, 2)  # --threads wins
    assert engine_threads(1, 4, cores=2) == (1, 4)
    assert engine_threads(4, 1, cores=8) == (4, 1)  # explicit prefill below decode is honoured


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_serve_threads_non_positive_is_a_clear_error(bad):
    """BUG: `sfcl serve --threads -1` loads the model, then dies with a RuntimeError traceback from
    torch.set_num_threads (exit 1); `--threads 0` silently means "default". Expected (like
    --prefill-threads 0): one line `sfcl: error: ...`, exit 2, before loading anything."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "sfcl.cli", "serve", "--threads", bad, "--port", "0",
                        "--model", "/nonexistent/model.gguf"], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "threads" in r.stderr and "Traceback" not in r.stderr, r.stderr[-400:]


@pytest.mark.parametrize("flag", ["--threads", "--prefill-threads"])
def test_serve_huge_thread_count_does_not_segfault(flag):
    """BUG: `sfcl serve --threads 100000` (or --prefill-threads) segfaults (exit 139) inside
    torch.set_num_threads' OpenMP pool. Expected: a clear `sfcl: error:` (exit 2) or a clamp."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "sfcl.cli", "serve", flag, "100000", "--port", "0",
                        "--model", "/nonexistent/model.gguf"], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("sfcl: error:"), (r.returncode, r.stderr[-300:])


def test_runner_switches_threads_per_step():
    """_use_threads: prefill count for >= PREFILL_THREADS_MIN_TOKENS prompt tokens, decode count
    otherwise, nothing when either is unset; restores the caller's count afterwards here."""
    from sfcl.engine.model_runner import PREFILL_THREADS_MIN_TOKENS, ModelRunner

    before = torch.get_num_threads()
    try:
        r = ModelRunner.__new__(ModelRunner)
        r.prefill_threads, r.decode_threads = 2, 1
        r._use_threads(PREFILL_THREADS_MIN_TOKENS)
        assert torch.get_num_threads() == 2
        r._use_threads(PREFILL_THREADS_MIN_TOKENS - 1)
        assert torch.get_num_threads() == 1
        r._use_threads(0)
        assert torch.get_num_threads() == 1
        r.prefill_threads = None
        torch.set_num_threads(2)
        r._use_threads(0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


SPIN = """
import os, sys
at_torch = []  # GOMP_SPINCOUNT when torch (and with it libgomp, which reads it once) is first imported
class Hook:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not at_torch:
            at_torch.append(os.environ.get("GOMP_SPINCOUNT", "-"))
sys.meta_path.insert(0, Hook())
import sfcl.cli
from sfcl.engine.openmp_env import inherited_environ
print(os.environ.get("GOMP_SPINCOUNT"), at_torch[0], inherited_environ().get("GOMP_SPINCOUNT", "-"))
"""


@pytest.mark.parametrize("given, own, peers", [(None, "10000", "-"), ("77", "77", "77")])
def test_sfcl_commands_limit_openmp_spinning_and_peers_keep_the_users_setting(given, own, peers):
    """The ``sfcl`` command sets GOMP_SPINCOUNT=10000 unless the user set it (a spinning libgomp
    worker collapsed a server on a shared machine), and the programs it starts (llama-server, also
    libgomp) get the environment as the user had it."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if given is not None:
        env["GOMP_SPINCOUNT"] = given
    r = subprocess.run([sys.executable, "-c", SPIN], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [own, own, peers]  # set, and set before torch loaded


def test_the_openmp_settings_load_without_torch():
    """``limit_openmp_spinning`` must run before torch loads libgomp, so neither its module nor the
    packages above it may import torch."""
    import subprocess
    import sys

    code = "import sys, sfcl.engine.openmp_env\nprint('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stdout + r.stderr
