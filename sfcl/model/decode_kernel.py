"""SFCL's native CPU kernels: build, load, call.

One library from ``csrc/``, a Python extension module (``module``) that also registers torch
operators: ``torch.ops.sfcl.decode_attention`` (``decode_attention.cpp``, called below and by
``Attention.decode_attn``), ``torch.ops.sfcl.decode_layers`` (``decode_layers.cpp``, every decoder
layer of a decode-only step in one call; ``sfcl.model.decode_stack``), ``torch.ops.sfcl.int8_linear``
(``int8_linear.cpp``, the int8 weights' GEMV, which ``sfcl.model.quant.QuantLinear`` runs in place
of torch's once the library is loaded; ``loaded``), ``torch.ops.sfcl.int8_q8_linear`` (the same file,
the int8 weights' GEMV on int8 activations, where ``quant.int8_kernel`` picks it: all CPUs but
AVX-512 ones with AMX), ``torch.ops.sfcl.int4_linear`` (``int4_linear.cpp``, the int4 weights' GEMV on int8
activations, which ``QuantLinear`` runs where ``quant.int4_kernel`` picks it: the same CPUs),
``torch.ops.sfcl.logit_stats`` (``logit_stats.cpp``, the anchor builder's per-row logsumexp, top-k and
surprisal in one pass; ``sfcl.anchors.model_pass``), ``torch.ops.sfcl.rms_norm`` / ``silu_mul`` / ``rope_``
(``elementwise.cpp``, a decoder layer's element-wise steps over many float32 or 16-bit rows, one loop each, for
prompt chunks and the anchor builder; ``sfcl.model.llama``), ``torch.ops.sfcl.causal_softmax_entropy_``
(``attention_entropy.cpp``, the snapshot layer's causal attention weights and their entropy over a
window, for the anchor builder's dispersion; ``sfcl.anchors.model_pass``), ``torch.ops.sfcl.causal_attention``
(``causal_attention.cpp``, bf16 causal attention: the anchor builder's windows at the other layers and
the server's bf16 prompt chunks over their KV cache, on AMX tiles where
``-march`` enables AMX and the OS grants the tile state, ``torch.ops.sfcl.causal_attention_amx()``, else
with AVX-512 BF16's vdpbf16ps; compiled where ``-march`` enables AVX-512 BF16;
``torch.ops.sfcl.causal_attention_ready()`` says whether it runs here;
``sfcl.model.llama.prefill_attention``), ``torch.ops.sfcl.prefill_attention`` (``prefill_attention.cpp``, the causal
attention of a float32 prompt chunk over its KV cache with AVX2 and FMA, for ``Attention.prefill_attn``
and the anchor builder's float32 windows; ``torch.ops.sfcl.prefill_attention_ready()`` says whether it
was built here; ``sfcl.model.llama.native_prefill_attention``), and the module's ``anchor_search`` function and ``AnchorLookup`` class
(``anchor_search.cpp`` bound in ``bindings.cpp``, the snapshot lookup's IVF pass;
``sfcl.library.index``), pybind11 bindings so that they keep the GIL.

``torch.ops.sfcl.decode_attention`` does, per layer and step, what ``Attention.decode_attn``'s
eager path does in ~10 operators (write the new K/V into the cache, read the rows' K/V views,
scores, softmax, weights times V): one pass per (row, KV head) over the cache row in place,
float32 accumulation, work split over torch's intra-op threads. Why: oneDNN's batched matmul
copies the cache's strided K and V views to contiguous memory before multiplying (~11.5 of a
92.5 ms 32-row step, ``docs/performance-journal.md``), and at one stream each of those operators
costs tens of microseconds of fixed overhead for a few microseconds of arithmetic.

The sources are compiled once per machine kind with ``torch.utils.cpp_extension`` (g++, ``-O3
-march=native`` or ``$SFCL_KERNEL_MARCH``; ~1 min on 2 idle cores) into ``<cache dir>/kernels/<name>`` (``cache_root``), where ``<name>``
hashes the sources, the compiler flags, torch's version and the CPU's flags, so a cache copied to
a different CPU is rebuilt rather than run. No C++ compiler, or a failed build: ``load`` returns
False, says why once on stderr, and attention stays on the eager torch path.

Scope: the bf16 / fp16 / fp32 KV cache (not the block-wise INT8 one), CPU, eager (not under
``torch.compile``), head_dim 64 or 128, at most 8 query heads per KV head, decode rows in
consecutive cache rows.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import sys
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

from sfcl.config import default_cache_dir

CSRC = Path(__file__).with_name("csrc")
# one library; see also sfcl.model.decode_stack and sfcl.library.index (anchor_search)
# bindings.cpp first: the slowest to compile (pybind11's headers), so ninja starts it while the others build
SOURCES = tuple(CSRC / f for f in ("bindings.cpp", "decode_attention.cpp", "decode_layers.cpp", "anchor_search.cpp",
                                   "int8_linear.cpp", "int4_linear.cpp", "logit_stats.cpp", "elementwise.cpp",
                                   "attention_entropy.cpp", "causal_attention.cpp", "prefill_attention.cpp"))
HEADERS = (CSRC / "sfcl_kernels.h", CSRC / "elementwise.h")
# -ffp-contract=off: no fused multiply-adds the source did not write. $SFCL_KERNEL_MARCH: the target CPU
# (default native; x86-64-v3 runs on any AVX2 CPU, haswell times the AVX2 paths on an AVX-512 one).
# -fopenmp: at::parallel_for is a header template that splits work over torch's intra-op threads only
# when compiled with OpenMP (ATen/Parallel-inl.h: INTRA_OP_PARALLEL comes from _OPENMP); without it every
# kernel here ran on one thread whatever --threads said (until 2026-12-05: the int8 lm_head took 3.2 ms
# per step on an Intel Xeon, 1.5 ms on two threads). The library's libgomp.so.1 resolves to the copy
# torch has already loaded (same soname), so it shares torch's OpenMP runtime and thread pools.
# -mprefer-vector-width=512: on AVX-512 CPUs the loops the compiler vectorises (elementwise.h) use
# 512-bit vectors instead of g++'s default 256 (SiLU * up over a 4,096 x 1,536 bf16 block: 4.7 vs
# 6.6 ms on one thread of the Intel Xeon with AMX, torch's operators 4.9; a decode step unchanged,
# 5.8-6.3 vs 5.9-6.2 ms, 2026-12-05); without AVX-512 it changes nothing.
# -fno-trapping-math: the loops may compute both sides of a select (no FP exception is ever unmasked
# here, so no value changes): without AVX-512's masks g++ otherwise leaves a loop with a select around
# an FP operation scalar ("control flow in loop"): on AVX2 builds elementwise.h's SiLU * up loop, which
# float32 rows take since the twenty-seventh session, was scalar (-fopt-info-vec-missed).
MARCH = os.environ.get("SFCL_KERNEL_MARCH") or "native"
CFLAGS = ["-O3", f"-march={MARCH}", "-mprefer-vector-width=512", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math"]
LDFLAGS = ["-fopenmp"]
OPS = ("decode_attention", "decode_layers", "int8_linear", "int8_q8_linear", "int4_linear", "logit_stats",
       "rms_norm", "silu_mul", "rope_", "causal_softmax_entropy_", "causal_attention",
       "causal_attention_ready", "causal_attention_amx", "prefill_attention", "prefill_attention_ready")  # the torch operators a loaded library must register
FUNCTIONS = ("anchor_search", "AnchorLookup", "parallel_threads")  # and its module's functions
HEAD_DIMS = (64, 128)
MAX_GROUP = 8  # query heads per KV head the kernel's stack buffers hold

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "why": str, "seconds": float, "module": the loaded module


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


def build_name() -> str:
    """Extension name: hashes what the binary depends on (source, flags, torch, CPU flags)."""
    h = hashlib.sha256()
    parts = [f.read_bytes() for f in (*SOURCES, *HEADERS)]
    for part in (*parts, " ".join(CFLAGS + LDFLAGS).encode(), torch.__version__.encode(), _cpu_flags().encode()):
        h.update(part)
    return f"sfcl_kernels_{h.hexdigest()[:16]}"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where builds go: ``$SFCL_KERNEL_CACHE``, else ``<cache_dir>/kernels`` (the server's
    ``--cache-dir``; default ``$SFCL_CACHE_DIR`` or ~/.cache/sfcl)."""
    if os.environ.get("SFCL_KERNEL_CACHE"):
        return Path(os.environ["SFCL_KERNEL_CACHE"])
    return Path(cache_dir if cache_dir is not None else default_cache_dir()) / "kernels"


def _put_ninja_on_path() -> None:
    """torch's builder runs ``ninja`` from PATH; the ``ninja`` wheel (a dependency) puts it in the
    environment's bin directory, which is not on PATH when ``sfcl`` is run without activating it."""
    if shutil.which("ninja") is None:
        for d in (Path(sys.executable).parent, Path(sysconfig.get_path("scripts"))):
            if (d / "ninja").exists():
                os.environ["PATH"] = f"{d}{os.pathsep}{os.environ.get('PATH', '')}"
                return


def load(verbose: bool = True, cache_dir: str | Path | None = None) -> bool:
    """Load the kernel, building it first if this machine kind has no build yet; True when
    ``torch.ops.sfcl.decode_attention`` is callable. Thread-safe; decided once per process.
    ``SFCL_DECODE_KERNEL=0`` turns it off (torch's operators for decode and the int8 GEMV, the
    torch version of the anchor search). cache_dir: see ``cache_root``.

    A finished build (``<cache_root>/<name>/<name>.so`` whose SHA-256 matches the
    ``<name>.so.sha256`` its build wrote) is loaded as it is, with no lock, no ninja and no write,
    so a read-only cache works and switching ninja versions rebuilds nothing; a library that does
    not match (truncated, overwritten) is rebuilt rather than loaded.
    A build runs in a folder of its own (``<name>.tmp-<pid>-<random>``) and its library is moved
    into place with an atomic rename, so concurrent first starts each build and one wins, and a
    build killed part-way leaves no lock that a later start would wait on forever (torch's own
    builder waits on a stale ``lock`` file without a timeout)."""
    with _lock:
        if "ok" in _state:
            return bool(_state["ok"])
        if os.environ.get("SFCL_DECODE_KERNEL", "1") == "0":
            _state.update(ok=False, why="SFCL_DECODE_KERNEL=0")
            return False
        t0 = time.monotonic()
        try:
            if not re.fullmatch(r"[A-Za-z0-9._+-]+", MARCH):  # one compiler word, not extra flags
                raise ValueError(f"SFCL_KERNEL_MARCH={MARCH!r} is not a -march= value")
            name = build_name()
            final = cache_root(cache_dir) / name / f"{name}.so"
            if _intact(final):
                mod = _import(final, name)
            else:  # absent, or not the file a build wrote (truncated, overwritten): loading could crash
                mod = _build(name, final, verbose)  # also imports it (from the build folder)
            ok = all(hasattr(torch.ops.sfcl, op) for op in OPS) and all(hasattr(mod, f) for f in FUNCTIONS)
            _state.update(ok=ok, why="" if ok else "the library lacks an operator", module=mod,
                          seconds=time.monotonic() - t0)
        except Exception as e:  # no compiler, no ninja, a failed build, an unwritable cache: torch ops still work
            lines = str(e).strip().splitlines()
            errors = [ln.strip() for ln in lines if "error:" in ln]  # the compiler's own words, not ninja's last line
            detail = errors[0] if errors else (lines[-1] if lines else "")
            _state.update(ok=False, why=f"{type(e).__name__}: {detail}", seconds=time.monotonic() - t0)
            if verbose:
                print(f"[ENGINE] fused decode kernels unavailable ({_state['why']}); using torch's operators",
                      file=sys.stderr, flush=True)
        return bool(_state["ok"])


def _digest_path(so: Path) -> Path:
    return so.with_name(so.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(so: Path) -> bool:
    """Whether ``so`` is the library a build wrote: its SHA-256 equals the one the build recorded
    beside it. A truncated library is not merely unloadable: mapping it can kill the process with
    SIGBUS, which no ``except`` catches, so it is checked before it is ever imported."""
    try:
        return so.exists() and _digest_path(so).read_text().strip() == _sha256(so)
    except OSError:
        return False


def _import(so: Path, name: str) -> ModuleType:
    """The built library ``so`` imported as the extension module ``name`` (its ``PyInit_<name>``;
    this also registers its torch operators)."""
    spec = importlib.util.spec_from_file_location(name, so)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {so} as {name}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build(name: str, final: Path, verbose: bool) -> ModuleType:
    """Compile the sources, import the library, and move it to ``final`` (see ``load``); returns the
    module. Raises
    RuntimeError when there is no C++ compiler, and whatever torch's builder raises when the build
    fails."""
    import tempfile

    from torch.utils.cpp_extension import load as cpp_load

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx}) on PATH")
    _put_ninja_on_path()
    final.parent.mkdir(parents=True, exist_ok=True)
    if verbose:
        print("[ENGINE] compiling SFCL's kernels (decode attention, decode layers, int8 and int4 GEMVs, anchor search, "
              f"logit statistics, element-wise steps of prompt rows, attention entropy, bf16 attention of prompt chunks and the anchor build, float32 prompt attention: {len(SOURCES)} files) with the C++ compiler "
              "(once per machine kind, ~1 min on 2 idle cores) ...", file=sys.stderr, flush=True)
    work = Path(tempfile.mkdtemp(prefix=f"{name}.tmp-{os.getpid()}-", dir=final.parent.parent))
    t0 = time.perf_counter()
    done = threading.Event()
    if verbose:
        threading.Thread(target=_report_build, args=(work, done, t0), name="sfcl-kernel-build", daemon=True).start()
    try:
        mod = cpp_load(name=name, sources=[str(f) for f in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                       build_directory=str(work), is_python_module=True, verbose=False)  # builds and imports it from `work`
        built = work / f"{name}.so"
        digest = work / "digest"
        digest.write_text(_sha256(built) + "\n")
        os.replace(digest, _digest_path(final))  # the digest first, then the library: a reader that sees
        os.replace(built, final)  # a pair from two concurrent builds finds a mismatch and builds again
    finally:
        done.set()
        shutil.rmtree(work, ignore_errors=True)
    if verbose:
        print(f"[ENGINE] compiled SFCL's kernels in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return mod


def _report_build(work: Path, done: threading.Event, t0: float, every_s: float = 15.0) -> None:
    """Until ``done``: every ``every_s`` seconds one stderr line with the object files compiled so far
    in ``work`` (ninja's build directory) out of ``SOURCES`` and the seconds since ``t0`` (the build's
    start, ``time.perf_counter``), so a slow build is not taken for a hang."""
    while not done.wait(every_s):
        n = len(list(work.glob("*.o")))
        print(f"[ENGINE] compiling SFCL's kernels: {n}/{len(SOURCES)} files after {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)


def loaded() -> bool:
    """Whether ``load`` has run in this process and the library is loaded (never builds)."""
    return bool(_state.get("ok", False))


def module() -> ModuleType | None:
    """The loaded kernel module (its functions: ``FUNCTIONS``), or None when ``load`` has not run or
    failed (never builds)."""
    return _state.get("module") if loaded() else None  # type: ignore[return-value]


def why_unavailable() -> str:
    """Why ``load`` returned False ("" when it loaded or has not run)."""
    return str(_state.get("why", ""))


def load_seconds() -> float:
    """Seconds the first ``load`` took (build or cache hit); 0 before it ran."""
    return float(_state.get("seconds", 0.0))


def supports(args, kv) -> bool:
    """Whether the kernel applies to this model and KV cache (shapes, dtype, device); says nothing
    of whether it is built."""
    g = args.n_heads // args.n_kv_heads
    return (not kv.int8 and kv.k[0].device.type == "cpu" and args.head_dim in HEAD_DIMS and g <= MAX_GROUP
            and kv.dtype in (torch.bfloat16, torch.float16, torch.float32))


def enable(kv, args, mode: str = "auto", cache_dir: str | Path | None = None, verbose: bool = True) -> str:
    """Turn SFCL's fused kernels on for decode over ``kv`` (a ``KVCache`` of a model with
    ``LlamaArgs`` ``args``) where they apply, building or loading them first: ``kv.fused_decode``
    (the attention kernel) and, for mode ``auto``, ``kv.fused_layers`` (``sfcl.model.decode_stack``).
    mode: ``auto`` | ``attention`` | ``torch`` (``--attention-kernel``; ``torch`` turns nothing on).
    Returns "" when the kernels are on, else why not (for the caller's log line)."""
    if mode == "torch":
        return "--attention-kernel torch"
    if not supports(args, kv):
        return "the kernel does not take this KV cache (INT8) or head shape"
    if not load(verbose=verbose, cache_dir=cache_dir):
        return why_unavailable()
    kv.fused_decode = True
    kv.fused_layers = mode == "auto"
    return ""


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor,
                     v_new: torch.Tensor, pos: torch.Tensor, row0: int, S: int, scale: float,
                     want_probs: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Write each row's new K/V and attend it to its own positions.

    q: (B, nh, hd) new tokens' rotated queries (unit stride on hd); k_cache / v_cache: one layer's
    contiguous (R, nkv, max_len, hd) cache; k_new / v_new: (B, nkv, hd); pos: (B,) int64 position
    of each row's new token (row ``row0 + b`` attends to [0, pos[b]]); S: max(pos) + 1; scale:
    the softmax scale (head_dim ** -0.5). All of q, cache and new K/V share one dtype.
    Returns o (B, nh * hd) in that dtype and, with want_probs, the attention weights float32
    (B, nh, 1, S), zero past each row's own length (else None). Raises RuntimeError on shapes or
    dtypes it does not take."""
    o, p = torch.ops.sfcl.decode_attention(q, k_cache, v_cache, k_new, v_new, pos, row0, S, scale, want_probs)
    return o, (p if want_probs else None)
