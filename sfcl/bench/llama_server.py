"""llama.cpp's native ``llama-server``: the strongest CPU peer for ``sfcl bench`` (continuous
batching over ``-np`` slots, the same GGUF file).

Where the binary comes from, first match wins:
1. ``$SFCL_LLAMA_SERVER`` (a path to a ``llama-server`` executable);
2. the build cache: ``<cache>/llama-server/<version>-<cpu key>/llama-server``;
3. a build from source: the llama-cpp-python sdist on PyPI vendors the llama.cpp sources
   (``vendor/llama.cpp``); ``build_llama_server`` downloads it with pip (``--no-binary``, no
   dependencies), configures it with cmake (Release, static, ``GGML_NATIVE=ON`` so it uses every
   instruction the CPU has, no CURL/OpenSSL) and builds only the ``llama-server`` target. About
   10 minutes on 2 cores; the result is cached. The version is the installed llama-cpp-python's
   (``pip install -e .[bench]``) or, without one, the newest on PyPI. The cache key includes a
   hash of the CPU model and flags: a native build copied to another CPU kind could use
   instructions it lacks, so a different CPU builds its own.

``sfcl llama-server [--version V] [--cache-dir DIR]`` (``sfcl.cli.llama_server``) builds (or finds) it and
prints its path. Needs cmake (>= 3.14) and a C/C++ compiler: the Debian packages ``cmake
build-essential``, or ``pip install cmake``.

Run as a peer (``llama_server_argv``): one server per concurrency level with ``-np`` = the level
and ``-c`` = level x per-slot context (llama-server splits ``-c`` evenly over its slots), ``-t`` /
``-tb`` = the bench's threads, loopback only, ``--no-webui``. Requests use its
OpenAI-compatible ``/v1/chat/completions`` with ``ignore_eos`` (a llama-server sampling field).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Sequence

ENV_BINARY = "SFCL_LLAMA_SERVER"
SDIST = "llama-cpp-python"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DGGML_NATIVE=ON",
               "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF")


class LlamaServerUnavailable(RuntimeError):
    """No llama-server binary could be found or built; the message says why and what to do."""


def cpu_key() -> str:
    """12 hex digits identifying this CPU kind (model name + feature flags): the build cache key."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            k, _, v = line.partition(":")
            if k.strip() == "model name" and not model:
                model = v.strip()
            elif k.strip() in ("flags", "Features") and not flags:
                flags = " ".join(sorted(v.split()))
    except OSError:
        pass
    return hashlib.sha256(f"{platform.machine()}|{model}|{flags}".encode()).hexdigest()[:12]


def installed_version() -> str | None:
    """Version of the installed llama-cpp-python distribution, or None."""
    try:
        return metadata.version(SDIST)
    except metadata.PackageNotFoundError:
        return None


def cached_binary(cache_dir: Path, version: str) -> Path:
    return Path(cache_dir) / "llama-server" / f"{version}-{cpu_key()}" / "llama-server"


def find_llama_server(cache_dir: Path, version: str | None = None) -> Path | None:
    """An existing binary ($SFCL_LLAMA_SERVER, else the cache for ``version`` or the installed
    llama-cpp-python's version), or None. Raises LlamaServerUnavailable when $SFCL_LLAMA_SERVER
    names something that is not an executable file."""
    env = os.environ.get(ENV_BINARY)
    if env:
        p = Path(env).expanduser()
        if not (p.is_file() and os.access(p, os.X_OK)):
            raise LlamaServerUnavailable(f"${ENV_BINARY}={env} is not an executable file")
        return p
    v = version or installed_version()
    if v is None:
        found = sorted((Path(cache_dir) / "llama-server").glob(f"*-{cpu_key()}/llama-server"))
        return found[-1] if found else None
    p = cached_binary(cache_dir, v)
    return p if p.is_file() else None


def _run(argv: Sequence[str], log, cwd: Path | None = None) -> None:
    log.write(f"$ {' '.join(map(str, argv))}\n")
    log.flush()
    r = subprocess.run(list(map(str, argv)), cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise LlamaServerUnavailable(f"`{' '.join(map(str, argv))}` failed (exit {r.returncode}); see {log.name}")


def _cmake() -> str:
    cm = shutil.which("cmake")
    if cm is None:
        raise LlamaServerUnavailable("cmake not found: `apt-get install cmake build-essential` or `pip install cmake`")
    return cm


def build_llama_server(cache_dir: Path, version: str | None = None, jobs: int | None = None,
                       progress: bool = True) -> Path:
    """Download the llama-cpp-python sdist (``version``; default: the installed one, else the
    newest), build ``llama-server`` from its vendored llama.cpp with cmake, and cache it.
    Returns the binary's path. Raises LlamaServerUnavailable (no cmake/compiler, no network to
    PyPI, build failure: the message names the log)."""
    cache_dir = Path(cache_dir).expanduser()
    v = version or installed_version()
    if v is not None and cached_binary(cache_dir, v).is_file():
        return cached_binary(cache_dir, v)
    cmake = _cmake()
    work = Path(tempfile.mkdtemp(prefix="sfcl-llama-server-"))
    log_path = cache_dir / "llama-server" / "build.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(log_path, "w") as log:
            spec = f"{SDIST}=={v}" if v else SDIST
            if progress:
                print(f"[llama-server] downloading the {spec} sdist (vendors llama.cpp)", file=sys.stderr, flush=True)
            _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", work, spec], log)
            sdists = sorted(work.glob("llama_cpp_python-*.tar.gz"))
            if not sdists:
                raise LlamaServerUnavailable(f"pip downloaded no llama-cpp-python sdist into {work}; see {log_path}")
            got = sdists[0].name.removeprefix("llama_cpp_python-").removesuffix(".tar.gz")
            with tarfile.open(sdists[0]) as tf:
                tf.extractall(work, filter="data")
            src = work / f"llama_cpp_python-{got}" / "vendor" / "llama.cpp"
            if not (src / "CMakeLists.txt").is_file():
                raise LlamaServerUnavailable(f"the sdist has no vendor/llama.cpp/CMakeLists.txt ({src})")
            n = jobs or os.cpu_count() or 1
            if progress:
                print(f"[llama-server] building llama.cpp {got} with cmake, {n} jobs (about 10 min on 2 cores; "
                      f"log: {log_path})", file=sys.stderr, flush=True)
            _run([cmake, "-S", src, "-B", work / "build", *CMAKE_FLAGS], log)
            _run([cmake, "--build", work / "build", "--target", "llama-server", "-j", str(n)], log)
            built = work / "build" / "bin" / "llama-server"
            if not built.is_file():
                raise LlamaServerUnavailable(f"the build produced no {built}; see {log_path}")
            dest = cached_binary(cache_dir, got)
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_suffix(".tmp")
            shutil.copy2(built, tmp)
            os.replace(tmp, dest)  # atomic: a concurrent build of the same key leaves one whole binary
            (dest.parent / "BUILD_INFO").write_text(
                f"llama-cpp-python sdist {got} (vendor/llama.cpp)\ncmake {' '.join(CMAKE_FLAGS)}\n"
                f"cpu key {cpu_key()} ({platform.machine()})\n")
            return dest
    finally:
        shutil.rmtree(work, ignore_errors=True)


def llama_server(cache_dir: Path, version: str | None = None, build: bool = True, progress: bool = True) -> Path:
    """The binary to run: found (``find_llama_server``) or, when ``build``, built. Raises
    LlamaServerUnavailable."""
    found = find_llama_server(cache_dir, version)
    if found is not None:
        return found
    if not build:
        raise LlamaServerUnavailable(f"no llama-server binary (set ${ENV_BINARY} or build one: "
                                     "`sfcl llama-server`)")
    return build_llama_server(cache_dir, version, progress=progress)


def llama_server_argv(binary: Path, gguf: str, port: int, *, n_parallel: int, ctx_per_slot: int, threads: int,
                      extra: Sequence[str] = ()) -> list[str]:
    """``llama-server`` on 127.0.0.1:port with ``n_parallel`` slots of ``ctx_per_slot`` tokens each.
    Raises ValueError for n_parallel < 1 or ctx_per_slot < 16."""
    if n_parallel < 1 or ctx_per_slot < 16:
        raise ValueError("n_parallel must be >= 1 and ctx_per_slot >= 16")
    return [str(binary), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-np", str(n_parallel),
            "-c", str(n_parallel * ctx_per_slot), "-t", str(threads), "-tb", str(threads), "--no-webui",
            *extra]
