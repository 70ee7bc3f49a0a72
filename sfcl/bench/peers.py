"""Peers as subprocesses: start a server on a free loopback port, wait until it answers, watch the
peak resident memory (RSS) of its whole process tree, stop it.

RSS is polled with psutil every ``interval_s`` (default 0.1 s) from a daemon thread: a short spike
between two polls can be missed, so the figure is a lower bound of the true peak. GPU memory per
process comes from NVML (nvidia-ml-py) when a CUDA device is present; otherwise it is None.
Logs of each server go to files in the bench output folder (an unread pipe would block it).
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import httpx

from sfcl.engine.openmp_env import inherited_environ


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree_rss(pid: int) -> int:
    """Resident set size (bytes) of ``pid`` and all its descendants; 0 if it is gone."""
    import psutil  # optional dependency (extra ``bench``), imported only when measuring

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for q in procs:
        try:
            total += q.memory_info().rss
        except psutil.Error:
            pass
    return total


def gpu_memory(pids: Sequence[int]) -> int | None:
    """GPU memory (bytes) used by ``pids`` on all devices via NVML; None without NVML/CUDA."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver / no device: not measurable
        return None
    try:
        want, used = set(pids), 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for pr in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if pr.pid in want and pr.usedGpuMemory:
                    used += int(pr.usedGpuMemory)
        return used
    finally:
        pynvml.nvmlShutdown()


class MemoryMonitor:
    """Polls the RSS (and GPU memory, if any) of a process tree; ``window()`` measures the peak
    during a block::

        with monitor.window() as w:
            ...run a workload...
        w.peak_rss, w.peak_gpu   # bytes (peak_gpu None without NVML)
    """

    def __init__(self, pid: int, interval_s: float = 0.1):
        self.pid, self.interval_s = pid, interval_s
        self._windows: list[_Window] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._gpu_ok = gpu_memory([pid]) is not None
        self._thread = threading.Thread(target=self._loop, daemon=True, name=f"rss-{pid}")
        self._thread.start()

    def _pids(self) -> list[int]:
        import psutil

        try:
            p = psutil.Process(self.pid)
            return [self.pid, *(c.pid for c in p.children(recursive=True))]
        except psutil.Error:
            return [self.pid]

    def sample(self) -> None:
        rss = tree_rss(self.pid)
        gpu = gpu_memory(self._pids()) if self._gpu_ok else None
        with self._lock:
            for w in self._windows:
                w.peak_rss = max(w.peak_rss, rss)
                if gpu is not None:
                    w.peak_gpu = max(w.peak_gpu or 0, gpu)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    @contextmanager
    def window(self) -> Iterator["_Window"]:
        w = _Window()
        with self._lock:
            self._windows.append(w)
        self.sample()
        try:
            yield w
        finally:
            self.sample()
            with self._lock:
                self._windows.remove(w)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)


class _Window:
    __slots__ = ("peak_rss", "peak_gpu")

    def __init__(self) -> None:
        self.peak_rss: int = 0
        self.peak_gpu: int | None = None


class ServerProcess:
    """A server started as a subprocess on 127.0.0.1:port; ``wait_ready`` polls ``ready_path``.

    Use as a context manager: ``__exit__`` sends SIGTERM, waits ``stop_timeout_s``, then kills.
    Raises RuntimeError from ``wait_ready`` if the process exits early or does not answer within
    ``timeout_s`` (the message ends with the tail of its stderr log)."""

    def __init__(self, name: str, argv: Sequence[str], port: int, log_dir: Path, *,
                 ready_path: str = "/v1/models", env: dict[str, str] | None = None, cwd: str | None = None):
        self.name, self.argv, self.port = name, list(argv), port
        self.url = f"http://127.0.0.1:{port}"
        self.ready_path = ready_path
        log_dir.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = log_dir / f"{name}.stdout.log", log_dir / f"{name}.stderr.log"
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self._out, stderr=self._err, cwd=cwd,
                                     env=dict(inherited_environ(), PYTHONUNBUFFERED="1", **(env or {})))
        self.monitor = MemoryMonitor(self.proc.pid)

    def _tail(self, n: int = 2000) -> str:
        try:
            return self.err_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before it was ready "
                                   f"(`{shlex.join(self.argv)}`):\n{self._tail()}")
            try:
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer {self.ready_path} within {timeout_s:.0f} s:\n{self._tail()}")

    def stop(self, stop_timeout_s: float = 20.0) -> None:
        self.monitor.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(stop_timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._out.close()
        self._err.close()

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def sfcl_argv(port: int, *, max_num_seqs: int, model: str | None = None, device: str = "cpu",
              extra: Sequence[str] = ()) -> list[str]:
    """``python -m sfcl.cli serve`` on ``port`` (snapshot mode chosen per request by header), with
    the server's own thread defaults (``sfcl.engine_stack.engine_threads``): run it with
    ``sfcl_env(threads)`` so that they see ``threads`` cores. ``--threads`` in ``extra`` overrides."""
    argv = [sys.executable, "-m", "sfcl.cli", "serve", "--port", str(port),
            "--max-num-seqs", str(max_num_seqs), "--device", device]
    if model:
        argv += ["--model", model]
    return argv + list(extra)


def sfcl_env(threads: int) -> dict[str, str]:
    """Environment of a benchmarked ``sfcl serve`` given ``threads`` CPU threads in all: torch's
    default thread count (which the server reads as its core count) set to ``threads``."""
    return {"OMP_NUM_THREADS": str(threads)}


def llamacpp_argv(port: int, gguf: str, *, threads: int, n_ctx: int, extra: Sequence[str] = ()) -> list[str]:
    """``python -m llama_cpp.server`` on the same GGUF. It serves one request at a time; its default
    ``interrupt_requests=True`` would cut the running stream whenever another request arrives
    (the cut stream just ends, with no finish_reason), so it is turned off: requests queue."""
    return [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1", "--port", str(port),
            "--n_ctx", str(n_ctx), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--interrupt_requests", "False", *extra]


END_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


def gguf_eos_ids(path: str) -> list[int]:
    """End-of-sequence token ids of a GGUF: ``tokenizer.ggml.eos_token_id`` plus the usual chat
    end tokens found in its vocabulary. Used to suppress EOS on servers without ``ignore_eos``
    (llama_cpp.server: ``logit_bias``). Raises OSError/KeyError for an unreadable file."""
    import gguf

    r = gguf.GGUFReader(path)
    ids = set()
    if "tokenizer.ggml.eos_token_id" in r.fields:
        ids.add(int(r.fields["tokenizer.ggml.eos_token_id"].contents()))
    toks = r.fields["tokenizer.ggml.tokens"].contents()
    ids.update(i for i, t in enumerate(toks) if t in END_TOKENS)
    return sorted(ids)


def llamacpp_available() -> str | None:
    """None when ``llama_cpp.server`` imports, else the reason it does not."""
    r = subprocess.run([sys.executable, "-c", "import llama_cpp.server"], capture_output=True, text=True)
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or ["import failed"])[-1]
