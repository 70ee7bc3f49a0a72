"""What this machine computes fast: the serving dtype that ``--dtype auto`` picks, from the CPU's
flags and a start-up GEMM probe of a few milliseconds, and the weight format that
``--weight-quant auto`` picks for that dtype (``choose_weight_format``).

Why it matters: bf16 halves weight and KV memory, and on a CPU with AVX-512 BF16 or AMX its GEMMs
run about twice as fast as fp32. On a CPU without them (AVX2 only, e.g. the AMD EPYC this project
also runs on) torch emulates bf16 and a bf16 GEMM of the decode shape [16 x 576] . [576 x 1536]
ran at 1.2 GFLOP/s against 37-57 GFLOP/s in fp32 (one thread, torch 2.13): 30-47x slower. So
``auto`` takes bf16 only where the CPU has native bf16 *and* the probe agrees (bf16 at least half
fp32's rate at the decode shape, where native bf16 and fp32 run level); everything else runs fp32.
On CUDA it takes bf16 where the device supports it, else fp16.

Who calls it: ``sfcl.model.loader.load_model`` (``dtype="auto"``), and through it serving, the
anchor builder, calibration, eval, bench and the tests; ``fast_float_dtype()`` also picks the
dtype of CPU-side GEMMs that are not the model's (k-means assignment, the anchor search copy).
The choice is printed once per process on stderr (``[DTYPE] ...``) with the measured rates.
Nothing here keeps state but a per-process cache of the probe.
"""

from __future__ import annotations

import functools
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sfcl.config import DTYPE_CHOICES

DTYPE_NAMES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
# x86 flags that mean hardware bf16 dot products (oneDNN/MKL then run bf16 GEMMs natively);
# "bf16" is the aarch64 /proc/cpuinfo feature of the same meaning (Armv8.6 BF16).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
PROBE_SHAPE = (16, 576, 576)  # (M, K, N): a decode-batch GEMM of SmolLM2-135M's width
PROBE_BUDGET_S = 0.012  # per dtype: repeat the GEMM until this much time has passed (at least 2 calls)
# Where the flags show native bf16, bf16 is taken unless the probe reads it below this fraction of
# fp32. At the decode shape native bf16 and fp32 run level (the Intel Xeon with AMX: 122-151 vs
# 142-152 GFLOP/s, 2026-12-06), so "bf16 >= fp32" was a coin toss there: 2 of 3 starts during a test
# run took float32 and ran the model pass ~4x slower. Emulated bf16 reads 1/30-1/47 of fp32.
NATIVE_BF16_MIN_RATIO = 0.5
# Probes again (each dtype's best kept) while a CPU whose flags show native bf16 measures bf16 below
# that fraction (a preempted call), before it settles on float32.
PROBE_RETRIES = 2


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The outcome of ``choose_dtype``: what ``auto`` resolved to, and why."""

    dtype: torch.dtype
    reason: str  # one line for logs
    gflops: dict[str, float] = field(default_factory=dict)  # probe rate per dtype name, GFLOP/s, one thread
    native_bf16: bool | None = None  # CPU flags say native bf16 (None: flags unknown / not a CPU)

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return ""


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo`` ``flags`` or ``Features``; cpuinfo: that file's
    text, read when None); empty where unknown."""
    for line in (_cpuinfo() if cpuinfo is None else cpuinfo).splitlines():
        key, _, val = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(val.split())
    return frozenset()


# The flags that decide which kernels run fast here (reports name those present).
SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "bf16")


def cpu_summary(cpuinfo: str | None = None) -> str:
    """Which CPU kind a figure came from, for reports: ``"AMD EPYC (avx2 avx512f avx512_vnni
    avx512_bf16; torch AVX512)"`` - the model name, the ``SIMD_FLAGS`` present, and
    ``torch.backends.cpu.get_cpu_capability()``. cpuinfo: ``/proc/cpuinfo``'s text (read when None)."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    name = next((line.partition(":")[2].strip() for line in text.splitlines()
                 if line.partition(":")[0].strip() == "model name"), "") or platform.processor() or "unknown CPU"
    flags = cpu_flags(text)
    simd = " ".join(f for f in SIMD_FLAGS if f in flags) or "none of " + "/".join(SIMD_FLAGS)
    return f"{name} ({simd}; torch {torch.backends.cpu.get_cpu_capability()})"


def has_native_bf16(flags: frozenset[str] | None = None) -> bool | None:
    """True/False from the CPU flags, None when they cannot be read (then the probe decides)."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return None
    return any(f in flags for f in NATIVE_BF16_FLAGS)


def gemm_gflops(dtype: torch.dtype, shape: tuple[int, int, int] = PROBE_SHAPE,
                budget_s: float = PROBE_BUDGET_S) -> float:
    """GFLOP/s of ``x @ w`` (x (M, K), w (K, N), ``dtype``) on the calling thread's torch threads,
    from a warm-up call and then as many calls as fit in ``budget_s`` (at least 2; the best
    call's time counts, which resists a preempted call on a shared machine)."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(k, n, generator=g).to(dtype)
    torch.matmul(x, w)  # warm-up: kernel selection, page faults
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 2 or spent < budget_s:
        t0 = time.perf_counter()
        torch.matmul(x, w)
        dt = time.perf_counter() - t0
        best, spent, calls = min(best, dt), spent + dt, calls + 1
    return 2.0 * m * k * n / best / 1e9


def _probe_one_thread(dtypes: tuple[torch.dtype, ...]) -> dict[str, float]:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # per-thread rates: comparable across machines and not disturbed by other jobs
        return {str(dt).removeprefix("torch."): gemm_gflops(dt) for dt in dtypes}
    finally:
        torch.set_num_threads(before)


def choose_dtype(device: str = "cpu") -> DtypeChoice:
    """The serving dtype for ``--dtype auto`` on ``device`` (cached per process).

    CPU: bfloat16 when the CPU flags show native bf16 (``NATIVE_BF16_FLAGS``) and the probe
    measures bf16 at ``NATIVE_BF16_MIN_RATIO`` of fp32 or more (probed up to ``PROBE_RETRIES`` more
    times before it says otherwise), or when the flags are unknown and bf16 measures at least as
    fast as fp32; float32 otherwise.
    CUDA: bfloat16 if ``torch.cuda.is_bf16_supported()``, else float16. Other devices: float32.
    """
    return _choose(torch.device(device).type)


@functools.cache
def _choose(device_type: str) -> DtypeChoice:
    dev = torch.device(device_type)
    if dev.type == "cuda":
        ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return DtypeChoice(torch.bfloat16 if ok else torch.float16,
                           "CUDA device " + ("supports bf16" if ok else "without bf16: float16"))
    if dev.type != "cpu":
        return DtypeChoice(torch.float32, f"device {dev.type}: float32")
    native = has_native_bf16()
    need = NATIVE_BF16_MIN_RATIO if native else 1.0  # flags unknown: bf16 must measure as fast
    rates = _probe_one_thread((torch.float32, torch.bfloat16))
    for _ in range(PROBE_RETRIES):  # flags say native, the probe says much slower: probe again, keep each best
        if native is False or rates["bfloat16"] >= need * rates["float32"]:
            break
        again = _probe_one_thread((torch.float32, torch.bfloat16))
        rates = {k: max(v, again[k]) for k, v in rates.items()}
    fp32, bf16 = rates["float32"], rates["bfloat16"]
    cap = torch.backends.cpu.get_cpu_capability()
    what = {True: "native bf16 (" + "/".join(f for f in NATIVE_BF16_FLAGS if f in cpu_flags()) + ")",
            False: "no native bf16", None: "CPU flags unknown"}[native]
    cpu = f"{platform.machine()} {cap}, {what}"
    probe = "GFLOP/s (1 thread, a {}x{}x{} decode-shape GEMM)".format(*PROBE_SHAPE)
    if native is not False and bf16 >= need * fp32:
        rel = ">=" if bf16 >= fp32 else f">= {need:g} x"
        return DtypeChoice(torch.bfloat16, f"{cpu}: bf16 GEMM {bf16:.1f} {rel} fp32 {fp32:.1f} {probe}", rates, native)
    slower = f": bf16 below {need:g} x fp32 here despite the flags" if native else ""
    return DtypeChoice(torch.float32, f"{cpu}: fp32 GEMM {fp32:.1f} vs bf16 {bf16:.1f} {probe}{slower}", rates, native)


_logged: set[str] = set()


def resolve_dtype(spec: str | torch.dtype | None, device: str = "cpu", log: bool = True) -> torch.dtype:
    """``--dtype`` value -> torch dtype. ``"auto"`` / None run ``choose_dtype(device)`` and, the first
    time per device in a process, print the choice on stderr as ``[DTYPE] auto -> float32: ...``.
    Raises ValueError for an unknown name."""
    if isinstance(spec, torch.dtype):
        return spec
    if spec in (None, "auto"):
        kind = torch.device(device).type
        choice = choose_dtype(kind)
        if log and kind not in _logged:
            _logged.add(kind)
            print(f"[DTYPE] auto -> {choice.name}: {choice.reason}", file=sys.stderr, flush=True)
        return choice.dtype
    if spec not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {spec!r}")
    return DTYPE_NAMES[spec]


def fast_float_dtype() -> torch.dtype:
    """The dtype for bulk CPU GEMMs outside the model (k-means assignment, anchor search copies):
    what ``auto`` picks on this CPU (bf16 only with native support)."""
    return choose_dtype("cpu").dtype


# -- weight format (--weight-quant) ----------------------------------------------------------------
QUALITY_BAR = 0.01  # a weight format is used by default only if NDA perplexity changes by at most 1%


@dataclass(frozen=True, slots=True)
class WeightChoice:
    """The weight format for ``sfcl.model.quant.quantize_weights`` and why it was chosen."""

    mode: str  # none | fp16 | int8 | int4
    dense: str  # keep | dequant | fp16: weights of batches above max_rows (int8 / int4)
    lm_head: str | None  # none | fp16 | int8 | int4 (None: quant.DEFAULT_LM_HEAD[mode])
    max_rows: int | None  # largest batch (rows) on the packed int8 / int4 kernels (None: quant's default)
    reason: str  # one line for logs
    head_max_rows: int | None = None  # the same for a quantized lm_head (None: max_rows)
    packed_prompts: bool = False  # prompt rows of the block projections on the packed kernel too

    @property
    def label(self) -> str:
        """``MODE[+DENSE][/HEAD]``, the form ``sfcl.model.quant.parse_weight_format`` reads."""
        if self.mode == "none":
            return "none"
        dense = f"+{self.dense}" if self.mode in ("int8", "int4") and self.dense != "keep" else ""
        return f"{self.mode}{dense}" + (f"/{self.lm_head}" if self.lm_head else "")

    def summary(self, dtype: torch.dtype) -> str:
        """The format in words, for the log line: which kernels take which batches, and which GEMV
        the packed int4 / int8 weights run on (``quant.int4_kernel`` / ``int8_kernel``: SFCL's on
        int8 activations, or one on the activations as they are). Raises ValueError for a bad
        ``$SFCL_INT4_KERNEL`` / ``$SFCL_INT8_KERNEL``."""
        from sfcl.model.quant import int4_kernel, int8_kernel, resolved_cuts

        if self.mode == "none":
            return "weights as loaded"
        if self.mode == "fp16":
            return "FBGEMM fp16 weights"
        head, rows, head_rows = resolved_cuts(self.mode, self.lm_head, self.max_rows, self.head_max_rows)
        above = {"keep": f"{str(dtype).removeprefix('torch.')} weights", "fp16": "FBGEMM fp16 weights",
                 "dequant": "weights dequantized per call"}[self.dense]
        above += " above, prompt tokens on the same kernels" if self.packed_prompts else " above and for prompt tokens"
        gemv = {"int4": "SFCL's int4 x int8 GEMV" if int4_kernel() == "sfcl" else "torch's int4 GEMV",
                "int8": "SFCL's int8 x int8 GEMV" if int8_kernel() == "q8" else "int8 GEMV on unquantised activations"}
        head_part = f"{head} lm_head" + (f" ({gemv[head]}) for 1-{head_rows} rows" if head in gemv else "")
        blocks = f"{self.mode} block projections" + (f" ({gemv[self.mode]})" if self.mode in gemv else "")
        return f"{blocks} for decode batches of 1-{rows} rows, {above}; {head_part}"


def choose_weight_format(requested: str, dtype: torch.dtype, device: str = "cpu") -> WeightChoice:
    """``--weight-quant`` value -> the format to load, for a model in ``dtype`` on ``device``.

    ``auto``: the fastest format whose quality holds on this machine kind (``WEIGHT_FORMATS``:
    measured speed order and NDA perplexity change; used only within ``QUALITY_BAR``). An explicit
    mode keeps that mode and takes this machine's dense path and lm_head. Not a CPU: ``none``
    (the packed and FBGEMM kernels are CPU kernels; ``sfcl.config.ModelConfig`` refuses explicit
    modes there). Raises ValueError for an unknown mode."""
    from sfcl.model.quant import WEIGHT_QUANT_MODES, fp16_gemm_available

    if requested != "auto" and requested not in WEIGHT_QUANT_MODES:
        raise ValueError(f"weight_quant must be auto or one of {', '.join(WEIGHT_QUANT_MODES)}, got {requested!r}")
    if torch.device(device).type != "cpu":
        return WeightChoice("none", "keep", None, None, f"device {device}: weights as loaded")
    kind = "fp32_fbgemm" if dtype == torch.float32 and fp16_gemm_available() else \
        "fp32" if dtype == torch.float32 else "bf16" if dtype == torch.bfloat16 else "other"
    formats = [f for f in WEIGHT_FORMATS.get(kind, []) if f.applies()]
    if requested == "auto":
        for f in formats:
            if f.ppl_change_ci_hi is not None and f.ppl_change_ci_hi <= QUALITY_BAR:
                return WeightChoice(f.mode, f.dense, f.lm_head, f.max_rows, f"{kind}: {f.why}", f.head_max_rows,
                                    f.packed_prompts)
        return WeightChoice("none", "keep", None, None, f"{kind}: no measured faster format; weights as loaded")
    if requested == "none":
        return WeightChoice("none", "keep", None, None, "requested")
    same = [f for f in formats if f.mode == requested]
    if same:
        f = same[0]
        return WeightChoice(f.mode, f.dense, f.lm_head, f.max_rows, f"requested; {kind}: {f.why}", f.head_max_rows,
                            f.packed_prompts)
    dense = "fp16" if kind == "fp32_fbgemm" else "keep"
    return WeightChoice(requested, dense, None, None, f"requested; {kind}: dense path {dense}")


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """One measured candidate of ``choose_weight_format``."""

    mode: str
    dense: str
    lm_head: str | None
    max_rows: int | None
    ppl_change_ci_hi: float | None  # upper end of the 95% CI of the NDA perplexity change (None: not measured)
    why: str  # the measurement, with the command that reproduces it
    int4_kernel: str | None = None  # the candidate applies only where quant.int4_kernel() is this (None: any)
    head_max_rows: int | None = None  # largest batch on a quantized lm_head's packed kernel (None: max_rows)
    packed_prompts: bool = False  # the block projections' prompt rows on the packed kernel (quantize_weights)

    def applies(self) -> bool:
        """Whether this machine runs the int4 kernel the candidate was measured with."""
        if self.int4_kernel is None:
            return True
        from sfcl.model.quant import int4_kernel
        return int4_kernel() == self.int4_kernel


# Candidates per machine kind, fastest first (``choose_weight_format`` takes the first within
# QUALITY_BAR). Kinds: "fp32_fbgemm" = a float32 model (no native bf16) with FBGEMM's fp16 GEMM
# (x86 torch builds), "fp32" = without it, "bf16" = a bfloat16 model (native bf16 CPU).
#
# fp32_fbgemm, measured on the AVX2-only AMD EPYC (2 cores, shared: thread CPU time, 1 thread):
# - int4 blocks (+ int8 lm_head) against fp32 weights: NDA perplexity +0.33% [95% CI +0.26, +0.38]
#   (8 ContractNLI NDAs x 512 tokens, documents resampled; `python scripts/weight_quant_quality.py
#   --docs 8 --tokens 512 --prompts 0 --modes int4`); int8 +0.55% [+0.16, +0.88].
# - engine step (`python scripts/profile_weight_formats.py`), against fp32 weights: fp16 0.66 /
#   0.41 / 0.61x at batch 1 / 4 / 16 and 0.82x for a 256-token prompt chunk; int4 + fp16 above 3
#   rows 0.56 / 0.42 / 0.58 / 0.82x; int8 + fp16 0.68 / 0.47 / 0.61 / 0.81x. int4 against fp16 alone:
#   0.84 / 0.83 / 0.93 / 0.98 / 1.21x at 1 / 2 / 3 / 4 / 6 rows, hence max_rows 3 with torch's int4 kernel.
# - With SFCL's int4 x int8 kernel (quant.int4_kernel() "sfcl", the default below AVX-512), measured
#   2026-12-05 on AVX2 code paths of an Intel Xeon (scripts/avx2_emulated_bench.sh's environment; an
#   estimate: FBGEMM still ran AVX-512 code there, which favours the fp16 side), 2 threads, the fused
#   decode layers on (`python scripts/profile_weight_formats.py --formats fp16,int4+fp16/int8,none
#   --batches 1,4,8,16,24,32 --prefill 0 --threads 2 --max-rows 32 --kernels`): int4 blocks against
#   fp16 weights 0.44 / 0.56 / 0.64 / 0.74-0.76 / 0.88 / 0.93x at 1 / 4 / 8 / 16 / 24 / 32 rows (fp32
#   weights 1.32-1.35x at 16 / 32); an int8 lm_head above 3 rows was slower than the fp16 one here
#   (not checked on a real AVX2 CPU, so it keeps the measured cut of 3). Perplexity +0.35% [+0.13,
#   +0.60] (docs/benchmarks.md, fifteenth session). With the int8 lm_head on int8 activations too
#   (quant.int8_kernel() "q8", the same rule; seventeenth session), over all 61 NDAs x 512 tokens
#   (`python scripts/weight_quant_quality.py --docs 61 --tokens 512 --prompts 8 --modes int4`,
#   SFCL_INT8_KERNEL = each in turn): +0.42% [+0.31, +0.54] against +0.39% [+0.30, +0.50] with bf16
#   activations for the head.
# - Prompt tokens on the int4 kernel too (packed_prompts; 2026-12-07, thirty-sixth session, AVX2 code
#   paths of an AMD EPYC Zen 4 with FBGEMM held to AVX2 as well, FBGEMM_ENABLE_INSTRUCTIONS=AVX2, which
#   the earlier measurements lacked): after SFCL's int4 kernel lost its per-row stack copy of the
#   activations and gained row tiles, one 576 x 1,536 / 1,536 x 576 / 576 x 960 product at 512 rows ran
#   1.19-1.37x faster than FBGEMM's fp16 GEMM (/tmp script, 2 threads), a 512-token prompt chunk's step
#   0.82x (`python scripts/profile_weight_formats.py --formats int4+fp16/int8@32:3,int4+fp16/int8@4096:3
#   --batches 16 --prefill 512 --threads 2 --kernels`) and a cold 3,600-token prefill 6.5-7.0 s against
#   7.3-8.5 (`python scripts/profile_prefill.py --tokens 3600 --prompts 2`, alternating). The perplexity
#   above was measured with every row on the packed kernels, prompts included. An int8 lm_head above 3
#   rows stayed slower than the fp16 one with FBGEMM on AVX2 too (1.06-1.11x the step at 4-32 rows).
#
# bf16, measured 2026-12-04 on an AMD EPYC with AVX-512 BF16 (2 cores, 1 thread; quiet machine):
# - int4 blocks (+ int8 lm_head) against bf16 weights: NDA perplexity +0.07% [95% CI -0.10, +0.23]
#   (12 NDAs x 512 tokens; `python scripts/weight_quant_quality.py --docs 12 --tokens 512 --prompts 8
#   --modes int4,int8 --threads 1`); int8 +0.39% [+0.04, +0.72]; an int4 lm_head is +5.8% (quant.py).
#   Over all 61 NDAs x 512 tokens (2026-12-07, the same command with --docs 61 --prompts 8 --modes int4,
#   torch's kernels): int4 +0.16% [+0.08, +0.25], the figure the candidate quotes.
# - engine step (`python scripts/profile_weight_formats.py --batches 1,2,4,6,8,16 --prefill 256
#   --formats none,int4,int8,int4/int4 --threads 1 --reps 8`), against bf16 weights: int4 0.46 / 0.52 /
#   0.59 / 0.79 / 0.98 / 0.99x at 1 / 2 / 4 / 6 / 8 / 16 rows (the bf16 weights kept for batches above
#   6 rows), 1.02x for a 256-token prompt chunk; int8 0.63 / 0.75 / 0.79 / 0.98x at 1 / 2 / 4 / 6 rows.
# - With SFCL's int4 x int8 and int8 x int8 kernels (quant.int4_kernel() "sfcl": every CPU but AVX-512
#   ones with AMX), measured 2026-12-07 on an AMD EPYC Zen 4 (AVX-512 BF16 and VNNI, no AMX), 2 threads,
#   fused decode layers, the kept bf16 weights packed for oneDNN as served (`python
#   scripts/profile_weight_formats.py --formats int4/int8@0,int4/int8@16 --gemvs torch,sfcl --batches
#   1,4,6,7,8,10,12,16 --prefill 0 --threads 2 --kernels --pack-dense`), against the packed bf16 weights:
#   0.33 / 0.64 / 0.81 / 0.83 / 0.92 / 1.05 / 1.09x at 1 / 4 / 6 / 7 / 8 / 10 / 12 rows (torch's kernels
#   0.37 / 0.68 / 1.22 / 1.06 / 1.08x at 1 / 4 / 6 / 7 / 8: its 6-row cut was measured before the
#   packing), hence 8 rows. NDA perplexity over all 61 NDAs x 512 tokens (`python
#   scripts/weight_quant_quality.py --docs 61 --tokens 512 --prompts 8 --modes int4`, $SFCL_INT4_KERNEL /
#   $SFCL_INT8_KERNEL set each way): +0.52% [+0.37, +0.66] against +0.16% [+0.08, +0.25] with torch's
#   kernels; the nearest anchor agreed on 96.5% of tokens against 98.0%.
WEIGHT_FORMATS: dict[str, list[WeightFormat]] = {
    "bf16": [
        WeightFormat("int4", "keep", "int8", 8, 0.0066,
                     "SFCL's int4 x int8 kernels for 1-8-row decode batches (the int8 lm_head on int8 activations "
                     "too), bf16 weights above and for prompts (step 0.33x / 0.92x of the packed bf16 weights at "
                     "batch 1 / 8, 1.05x at 10); NDA perplexity +0.52% [95% CI +0.37, +0.66] (recorded on an AMD "
                     "EPYC Zen 4 with AVX-512 BF16, no AMX, with scripts/weight_quant_quality.py and "
                     "scripts/profile_weight_formats.py --gemvs torch,sfcl, not measured at start-up)",
                     int4_kernel="sfcl"),
        WeightFormat("int4", "keep", "int8", 6, 0.0025,
                     "int4 kernels for 1-6-row batches, bf16 weights above (step 0.46x / 0.79x of bf16 at batch 1 / 6, "
                     "1.0x at 8+); NDA perplexity +0.16% [95% CI +0.08, +0.25] over 61 NDAs (recorded on an AMD EPYC "
                     "with AVX-512 BF16 with scripts/weight_quant_quality.py and scripts/profile_weight_formats.py, "
                     "not measured at start-up)"),
    ],
    "fp32_fbgemm": [
        WeightFormat("int4", "fp16", "int8", 32, 0.0054,
                     "SFCL's int4 x int8 kernels for 1-32-row decode batches and for prompt tokens (the int8 lm_head "
                     "for 1-3 rows), FBGEMM fp16 weights above (step 0.44x / 0.65x of fp16 weights at batch 1 / 16, a "
                     "512-token prompt chunk 0.82x); NDA perplexity +0.42% [95% CI +0.31, +0.54] with every row on the "
                     "int4 and int8 kernels (recorded on AVX2 code paths of an Intel Xeon with "
                     "scripts/weight_quant_quality.py and scripts/profile_weight_formats.py --kernels, the prompt "
                     "chunk on an AMD EPYC's, not measured at start-up)",
                     int4_kernel="sfcl", head_max_rows=3, packed_prompts=True),
        WeightFormat("int4", "fp16", "int8", 3, 0.0038,
                     "int4 kernels for 1-3-row batches, FBGEMM fp16 weights above (step 0.56x / 0.58x of fp32 at "
                     "batch 1 / 16); NDA perplexity +0.33% [95% CI +0.26, +0.38] (recorded on an AVX2-only AMD EPYC with "
                     "scripts/weight_quant_quality.py and scripts/profile_weight_formats.py, not measured at start-up)"),
    ],
}

_logged_weights: set[tuple] = set()


def resolve_weight_format(requested: str, dtype: torch.dtype, device: str = "cpu", log: bool = True) -> WeightChoice:
    """``choose_weight_format``, printed once per process and setting as
    ``[WEIGHTS] auto -> int4+fp16/int8 (the format in words); why: ...`` on stderr."""
    choice = choose_weight_format(requested, dtype, device)
    key = (requested, dtype, torch.device(device).type)
    if log and key not in _logged_weights:
        _logged_weights.add(key)
        print(f"[WEIGHTS] {requested} -> {choice.label} ({choice.summary(dtype)}); why: {choice.reason}",
              file=sys.stderr, flush=True)
    return choice
