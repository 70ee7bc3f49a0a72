"""Weight-only quantized linear layers for ``sfcl.model.llama.LlamaModel`` (CPU).

``quantize_weights(model, mode)`` swaps the four projection modules of every block (``qkv_proj``,
``o_proj``, ``gate_up_proj``, ``down_proj``) and ``lm_head`` for quantized ones, in place, after
loading; ``llama.py`` is untouched and the embedding (and therefore the model fingerprint that
anchor libraries are tied to) stays in the serving dtype.

Modes (weights quantized, activations stay bf16/fp32 — "W8A16"/"W4A16", as in gpt-fast's
``quantize.py``):

- ``int8``: per-output-channel symmetric, ``w ~= s[n] * q[n, k]`` with q in -128..127 and
  ``s = max|w[n]| / 127``; matmul by ``torch._weight_int8pack_mm(x, q, s)``.
- ``int4``: group-wise asymmetric along the input dimension, groups of 32, q in 0..15,
  ``w ~= (q - 8) * scale + zero`` per (row, group) — the convention of
  ``torch._weight_int4pack_mm_for_cpu`` (see torch ``testing/_internal/common_quantization.py``
  ``_group_quantize_tensor``: ``scale = (max - min) / 15``, ``zero = min + 8 * scale``); weights
  packed by ``torch._convert_weight_to_int4pack_for_cpu``. This is the GGUF Q4_1 block format
  (``w = d * q + m``, blocks of 32 along the row) with ``scale = d``, ``zero = m + 8 d``, so a Q4_1
  checkpoint re-quantizes onto its own grid: on the bundled SmolLM2 Q4_1 GGUF every group of the
  210 block matrices spans codes 0..15, the codes recovered from the bf16 weights equal those from
  the fp32 dequantized GGUF (0 of 106,168,320 differ), and the re-quantized fp32 weights equal the
  GGUF's exactly; only the kernel's bf16 scale/zero round (max |error| vs the fp32 GGUF weights
  0.033, against 0.014 for the bf16 weights themselves). ``lm_head`` stays int8 (see
  ``DEFAULT_LM_HEAD``). Where torch's CPU capability is below AVX-512, or the CPU has no AMX, the
  packed path is SFCL's int4 x int8 GEMV instead (``int4_kernel``, ``int4_q8_layout``, ``csrc/int4_linear.cpp``): the
  same codes and bf16 scales in its own layout, activations quantised to int8 per block of 32
  ("W4A8" on that path; NDA perplexity +0.35% against +0.26% with torch's kernel, AVX2 code paths),
  and an int8 ``lm_head`` runs SFCL's int8 x int8 GEMV (``int8_kernel``, ``int8_q8_linear`` in
  ``csrc/int8_linear.cpp``: the same codes and row scales, activations quantised the same way).

Dispatch by the number of input rows M (= decode batch rows, or prompt tokens in a prefill chunk):
the packed kernels are memory-bound GEMVs that beat a bf16 GEMM only while M is small (measured on
the 2-core AVX-512 CPU, one thread, synthetic weights of all SmolLM2-135M linears of one decode
step, lm_head in the same mode: bf16 / int8 / int4
= 11.4 / 4.6 / 4.1 ms at M=1, 15.6 / 13.4 / 11.4 at M=6, 13.7 / 14.8 / 13.0 at M=8, 20.6 / 29.5 /
26.1 at M=16, 403 / 1259 / 970 at M=512). Rows M <= ``max_rows`` use the packed kernel (except
inside ``prompt_rows``, the engine's steps that compute prompt tokens, where every row takes the
packed kernel if the layer was quantized with ``packed_prompts`` and the dense path otherwise);
larger M use a dense matmul whose weight comes from

- ``dense="keep"`` (default): a copy in the model dtype of the weight the packed kernel
  multiplies by (its codes times its scales; +2 bytes/parameter in bf16, including a tied
  ``lm_head``), so that both paths compute with the same weights, or
- ``dense="fp16"``: the same weight as an FBGEMM fp16 matrix (``Fp16Linear``), or
- ``dense="dequant"``: dequantized on every call (no bf16 copy; int8 dequantizes the kernel's own
  int8 weight, 1 byte/param in all; int4 on torch's kernel keeps an unpacked nibble copy next to the
  kernel's packed one, 0.5 + 0.5 byte/param; SFCL's layout gives its codes back). Measured 4.5x (int8) / 12x (int4) slower than ``keep`` for a batch-16 decode step, 1.2x / 1.7x for a 512-token
  prefill chunk: only for a model that does not fit twice, or
- ``dense="packed"``: none; every row takes the packed kernel, whatever M (no copy, no dense path).
  For the engine when no row can reach the dense path: prompt rows on the packed kernel
  (``packed_prompts``) and decode batches of at most ``max_rows`` rows (``--max-num-seqs``), where
  a dense copy is memory that nothing reads (``sfcl.engine_stack.served_weights``). A row outside
  the engine's steps past ``max_rows`` (a CAD side prompt, ``sfcl.snapshot.cad``) then runs the packed
  kernel too; on the AVX2 code paths of an AMD EPYC (Zen 4), SFCL's int4 x int8 kernel beat FBGEMM's fp16
  weights held to AVX2 at every M from 16 to 256 for each block projection shape of SmolLM2-135M
  (e.g. 0.74 vs 0.90 ms for the fused q/k/v projection at M = 128, 2 threads, 2026-12-07).

CPU only: these are CPU kernels (CUDA's ``_weight_int4pack_mm`` uses another packing and there is
no CUDA ``_weight_int8pack_mm``); ``quantize_weights`` raises ValueError for a model on another
device.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from sfcl.model import decode_kernel

WEIGHT_QUANT_MODES = ("none", "fp16", "int8", "int4")
DENSE_MODES = ("keep", "dequant", "fp16", "packed")
INT4_GROUP = 32
Q8_BLOCK = 32  # activations quantised to int8 per block of this many (csrc/sfcl_kernels.h's kQ8Block)
INT8_K_MULTIPLE = 16  # the packed int8 kernel's input size must be a multiple of this
# Largest M that uses the packed kernel, per mode (crossovers measured as in the module docstring).
DEFAULT_MAX_ROWS = {"int8": 6, "int4": 6}
# lm_head (tied to the embedding in SmolLM2, which the GGUF stores as Q8_0, not Q4_1) stays int8 in
# int4 mode: teacher-forced perplexity on 1,022 ContractNLI tokens, all bf16 20.648; int4 head alone
# 21.842 (+5.8%), int8 head alone 20.706 (+0.28%), int4 blocks alone 20.632 (-0.08%: the Q4_1 grid),
# int4 blocks + int8 head 20.672 (+0.12%). bf16 / int8 / int4 head GEMV at M=1: 7.4 / 1.8 / 0.95 ms
# on one thread.
DEFAULT_LM_HEAD = {"fp16": "fp16", "int8": "int8", "int4": "int8"}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Activations enter the packed kernels in bf16, also in a float32 model (cast in, cast back out): the
# kernels' vectorised paths are the bf16 ones. On the AVX2-only EPYC (one thread, [M x 576] . [576 x
# 1536]) int8 took 0.22 / 0.30 / 1.07 ms at M = 1 / 4 / 16 with bf16 input against 1.50 / 8.87 / 34.0
# ms with float32 input; int4 0.18 / 0.30 / 1.15 against 2.40 / 9.19 / 34.0.
KERNEL_DTYPE = torch.bfloat16


_prompt_rows = 0  # > 0 inside ``prompt_rows``: every QuantLinear takes its prompt path


@contextlib.contextmanager
def prompt_rows(active: bool = True):
    """Within (when ``active``): every ``QuantLinear`` takes its prompt path, whatever its row count:
    its dense weights, or the packed kernel where it was quantized with ``packed_prompts``.

    ``sfcl.engine.model_runner`` wraps the forwards that compute prompt tokens, so that a prompt's
    KV and first token come from the same kernels whether the prompt was computed whole (a chunk
    of hundreds of rows) or restored from the prefix cache with only its last token left to
    compute (one row, which would otherwise take the decode rows' path): the same request then
    answers the same when asked again. Decode rows of such a step take the prompt path too (one
    step per admitted prompt). Not thread-safe: the thread that owns the model sets it."""
    global _prompt_rows
    if not active:
        yield
        return
    _prompt_rows += 1
    try:
        yield
    finally:
        _prompt_rows -= 1


# Callbacks run with the model whenever ``quantize_weights`` or ``pack_dense_weights`` swap its weights:
# caches that hold references to the old weights drop them there (``on_new_weights``).
_new_weights_listeners: list = []


def weights_version(model: nn.Module) -> int:
    """How many times ``quantize_weights`` or ``pack_dense_weights`` swapped ``model``'s projection
    weights (0: never). Caches of references to the weights drop them through ``on_new_weights``."""
    return model.__dict__.get("_sfcl_weights_version", 0)


def on_new_weights(fn):
    """Register ``fn(model)``, called each time ``model``'s weights are swapped (after the version is
    bumped): a cache of references to the weights drops them there, so that the replaced tensors are
    freed at once rather than when the cache is next read. Returns ``fn`` (usable as a decorator)."""
    _new_weights_listeners.append(fn)
    return fn


def _new_weights(model: nn.Module) -> None:
    model.__dict__["_sfcl_weights_version"] = weights_version(model) + 1
    for fn in _new_weights_listeners:
        fn(model)


def in_prompt_rows() -> bool:
    """Whether the caller is inside ``prompt_rows`` (every ``QuantLinear`` takes its prompt path)."""
    return _prompt_rows > 0


@functools.cache
def fp16_gemm_available() -> bool:
    """Whether this torch build has FBGEMM's fp16-weight GEMM (x86 CPU wheels do; ARM builds do
    not). Probed once per process on a tiny matrix."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(8, 16), None)
        return bool(torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 16), packed).sum() == 128)
    except (RuntimeError, AttributeError):  # op missing or not compiled in
        return False


class Fp16Linear(nn.Module):
    """``y = x W^T (+ b)`` with W held in fp16 inside FBGEMM's packed layout, x and y float32:
    ``torch.ops.quantized.linear_dynamic_fp16`` (torch's "dynamic fp16" linear; FBGEMM's
    ``PackedGemmMatrixFP16``, AVX2 + F16C and AVX-512). The weight rounds to fp16 once (relative
    error <= 2^-11); products accumulate in fp32. Half the bytes of an fp32 weight, and on the
    AVX2-only EPYC faster than torch's fp32 ``F.linear`` at every batch size measured (one thread,
    [M x 576] . [576 x 1536], thread CPU time under load: 0.23 / 0.30 / 0.72 / 2.70 ms at
    M = 1 / 4 / 16 / 64 against 0.32 / 0.85 / 1.78 / 3.84 ms; ``python scripts/profile_linear.py``).

    x (..., K) any float dtype (computed in fp32, returned in x's dtype) -> y (..., N).
    Raises RuntimeError where FBGEMM is missing (see ``fp16_gemm_available``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        b = None if bias is None else bias.detach().float()
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # (M, K)
        y = torch.ops.quantized.linear_dynamic_fp16(x2 if x2.dtype == torch.float32 else x2.float(), self.packed)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=fp16 (FBGEMM)"


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric INT8. w (N, K) float -> q (N, K) int8, scales (N,) float32;
    w ~= scales[:, None] * q."""
    wf = w.detach().float()
    s = wf.abs().amax(1).clamp(min=1e-12) / 127.0  # (N,)
    q = torch.round(wf / s[:, None]).clamp_(-127, 127).to(torch.int8)  # (N, K)
    return q, s


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric INT4 along K, torch's ``_group_quantize_tensor`` convention.

    w (N, K) float, K % group == 0 -> q (N, K) uint8 in 0..15, scale (N, K//group) float32,
    zero (N, K//group) float32, with w ~= (q - 8) * scale + zero per group. Raises ValueError if
    K is not a multiple of ``group``."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"int4 needs in_features ({K}) to be a multiple of the group size {group}")
    g = w.detach().float().reshape(N, K // group, group)  # (N, G, group)
    lo, hi = g.amin(-1), g.amax(-1)  # (N, G)
    scale = (hi - lo).clamp(min=1e-6) / 15.0
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)  # (N, G, group)
    return q.reshape(N, K), scale, lo + 8.0 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_int4``: q (N, K) uint8, scale/zero (N, G) -> w (N, K) ``dtype``."""
    N, K = q.shape
    G = scale.shape[1]
    w = (q.reshape(N, G, K // G).to(dtype) - 8) * scale[..., None].to(dtype) + zero[..., None].to(dtype)
    return w.reshape(N, K)


def _int8_kernel_weight(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What ``torch._weight_int8pack_mm`` multiplies by: q (N, K) int8 x scales (N,) -> (N, K) float32."""
    return q.float() * scales.float()[:, None]


def _int4_kernel_weight(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """What ``torch._weight_int4pack_mm_for_cpu`` multiplies by: codes q (N, K) uint8 and the
    kernel's (K/group, N, 2) scales and zeros -> (N, K) float32."""
    return dequantize_int4(q, scales_and_zeros[..., 0].t(), scales_and_zeros[..., 1].t())


INT4_KERNELS = ("auto", "sfcl", "torch")
INT8_KERNELS = ("auto", "q8", "bf16")


@functools.cache
def _cpu_has_amx() -> bool:
    """Whether the CPU has AMX bf16 tiles (``/proc/cpuinfo`` ``amx_bf16``; False where unknown)."""
    from sfcl.model.hardware import cpu_flags

    return "amx_bf16" in cpu_flags()


def _integer_activations() -> bool:
    """The ``auto`` rule of ``int4_kernel`` and ``int8_kernel``: quantise activations to int8 (SFCL's
    integer GEMVs) where SFCL's native kernels load, unless torch runs AVX-512 code on a CPU with AMX.

    Measured on the 120 block projections of the default model, 2 threads
    (``scripts/profile_int4_linear.py``), and on whole decode steps (``scripts/profile_weight_formats.py
    --gemvs torch,sfcl``):
    - AVX2 code paths (Intel Xeon, 2026-12-05): SFCL's int4 GEMV 4.26 ms against torch's 6.21 at one
      row, its int8 head 1.13 against 1.49 ms;
    - AMD EPYC Zen 4 (AVX-512 BF16 and VNNI, no AMX; 2026-12-07): int4 2.92 / 3.73 / 5.47 / 7.80 ms
      against torch's 3.77 / 4.70 / 6.41 / 11.52 at 1 / 2 / 4 / 6 rows; the int8 head level at 1-2 rows
      and 1.5 against 2.6-2.8 ms at 3-4 (``scripts/profile_int8_linear.py``); the decode step with
      both 0.91 / 0.94 / 0.66x of torch's at 1 / 4 / 6 rows;
    - Intel Xeon with AMX, AVX-512 code (2026-12-05): int4 level (4.29 against 4.35 ms), the int8
      head slower (1.53 against 1.37 ms at one row, more at 3-4), so torch's kernels stay there.
    AMX stands in for the microarchitecture here: two AVX-512 CPUs were measured, one with AMX."""
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512") and _cpu_has_amx():
        return False
    return decode_kernel.load()


KERNEL_VARIABLES = {"SFCL_INT4_KERNEL": INT4_KERNELS, "SFCL_INT8_KERNEL": INT8_KERNELS}


def kernel_variable(variable: str) -> str:
    """``$SFCL_INT4_KERNEL`` or ``$SFCL_INT8_KERNEL`` as a value of ``KERNEL_VARIABLES[variable]``: read
    case-insensitively and stripped, ``auto`` when unset or empty. Raises ValueError for another value
    (``check_kernel_variables`` raises it before a model loads)."""
    want = os.environ.get(variable, "").strip().lower() or "auto"
    if want not in KERNEL_VARIABLES[variable]:
        raise ValueError(f"{variable} must be one of {', '.join(KERNEL_VARIABLES[variable])}, "
                         f"got {os.environ[variable]!r}")
    return want


def check_kernel_variables() -> None:
    """Raise ValueError now for a bad ``$SFCL_INT4_KERNEL`` / ``$SFCL_INT8_KERNEL``, rather than when the
    first weights are quantized (after the model and the anchor library have loaded)."""
    for variable in KERNEL_VARIABLES:
        kernel_variable(variable)


def _gemv_choice(variable: str, integer: str, other: str) -> str:
    """``$variable`` (``kernel_variable``) -> ``integer`` (SFCL's kernel on int8 activations: asked for,
    or ``auto`` and ``_integer_activations``, and the kernels load) or ``other``. Raises ValueError for
    a value the variable does not take."""
    want = kernel_variable(variable)
    if want == other or (want == "auto" and not _integer_activations()):
        return other
    return integer if decode_kernel.load() else other


def int4_kernel() -> str:
    """Which GEMV an int4 ``QuantLinear``'s packed path runs: ``"sfcl"`` (``torch.ops.sfcl.int4_linear``,
    int8 activations, SFCL's layout; ``csrc/int4_linear.cpp``) or ``"torch"``
    (``torch._weight_int4pack_mm_for_cpu``, bf16 activations). ``$SFCL_INT4_KERNEL`` = ``auto``
    (default): SFCL's where SFCL's native kernels load, except on AVX-512 code with AMX
    (``_integer_activations``: the measurements), else torch's. Raises ValueError for another value
    of the variable."""
    return _gemv_choice("SFCL_INT4_KERNEL", "sfcl", "torch")


def int8_kernel() -> str:
    """Which GEMV an int8 ``QuantLinear``'s packed path runs: ``"q8"`` (``torch.ops.sfcl.int8_q8_linear``,
    activations quantised to int8 per block of 32; ``csrc/int8_linear.cpp``) or ``"bf16"``
    (``int8_mm``: bf16 activations). ``$SFCL_INT8_KERNEL`` = ``auto`` (default): ``q8`` by
    ``int4_kernel``'s rule (``_integer_activations``: all but AVX-512 code with AMX; on AVX2 converting
    the codes to float made the lm_head's GEMV compute-bound, 1.49 against 1.13 ms after a 96 MB copy,
    ``scripts/profile_int8_linear.py``), else ``bf16``. Raises ValueError for another value of the
    variable."""
    return _gemv_choice("SFCL_INT8_KERNEL", "q8", "bf16")


def int4_q8_layout(q: torch.Tensor, scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SFCL's own layout of an int4 weight for ``torch.ops.sfcl.int4_linear`` (``csrc/int4_linear.cpp``):
    codes q (N, K) uint8 in 0..15 and torch's kernel's (K/32, N, 2) scales and zeros (bf16) ->
    codes (N/8, K/32, 128) uint8 (per block of 8 rows and group, 4 chunks of 32 bytes: in chunk i,
    bytes 4r..4r+3 hold row r's codes of k-quad 2i in their low nibbles and of k-quad 2i+1 in their
    high ones) and sz (N/8, K/32, 16) bf16 (the 8 rows' scales, then their zeros).
    Raises ValueError when N is not a multiple of 8 or K of 32."""
    N, K = q.shape
    if N % 8 or K % INT4_GROUP:
        raise ValueError(f"int4_q8_layout needs N % 8 == 0 and K % {INT4_GROUP} == 0, got ({N}, {K})")
    if tuple(scales_and_zeros.shape) != (K // INT4_GROUP, N, 2):
        raise ValueError(f"scales_and_zeros must be ({K // INT4_GROUP}, {N}, 2), got {tuple(scales_and_zeros.shape)}")
    if q.numel() and int(q.max()) > 15:
        raise ValueError("int4 codes must be in 0..15")
    NB, G = N // 8, K // INT4_GROUP
    qq = q.to(torch.uint8).reshape(NB, 8, G, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # (rb, g, chunk i, nibble h, row r, t)
    codes = (qq[:, :, :, 0] | (qq[:, :, :, 1] << 4)).reshape(NB, G, 4 * INT4_GROUP)  # k = 32 g + 4 (2 i + h) + t
    sz = scales_and_zeros.to(torch.bfloat16).reshape(G, NB, 8, 2).permute(1, 0, 3, 2).reshape(NB, G, 16)
    return codes.contiguous(), sz.contiguous()


def int4_q8_codes(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of ``int4_q8_layout`` for the codes: (N/8, K/32, 128) uint8 -> q (N, K) uint8."""
    NB, G, _ = codes.shape
    c = codes.reshape(NB, G, 4, 8, 4)  # (rb, g, chunk i, row r, t)
    q = torch.stack([c & 15, c >> 4], 3)  # (rb, g, i, h, r, t)
    return q.permute(0, 4, 1, 2, 3, 5).reshape(NB * 8, G * INT4_GROUP)


def int4_mm(x: torch.Tensor, codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 / bf16 times the int4 weight in SFCL's layout (``int4_q8_layout``) -> (M, N)
    in x's dtype: ``torch.ops.sfcl.int4_linear`` (int8 activations per block of 32)."""
    return torch.ops.sfcl.int4_linear(x, codes, sz)


def int8_q8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) float32 / bf16 / fp16 times the int8 weight q (N, K) with row scales (N,) -> (M, N) in
    x's dtype: ``torch.ops.sfcl.int8_q8_linear`` (int8 activations per block of 32; K % 32 == 0)."""
    return torch.ops.sfcl.int8_q8_linear(x, q, scales)


def int8_mm(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x (M, K) bf16 times the int8 weight q (N, K) int8 with scales (N,) bf16 -> (M, N) bf16: SFCL's
    ``torch.ops.sfcl.int8_linear`` once its native library is loaded (``sfcl.model.decode_kernel``;
    the fused decode layers call the same kernel), else ``torch._weight_int8pack_mm``. Same
    products, summed in another order; ours reads the weight at about twice torch 2.13's rate."""
    if decode_kernel.loaded():
        return torch.ops.sfcl.int8_linear(x, q, scales)
    return torch._weight_int8pack_mm(x, q, scales)


class QuantLinear(nn.Module):
    """``y = x W^T (+ b)`` with W stored quantized; see the module docstring for modes and dispatch.

    x (..., K) in the model dtype -> y (..., N) in the same dtype. Built by ``from_linear``.
    """

    def __init__(self, mode: str, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int, dense: str,
                 packed_prompts: bool = False):
        super().__init__()
        if mode not in ("int8", "int4"):
            raise ValueError(f"QuantLinear mode must be int8 or int4, got {mode!r}")
        if dense not in DENSE_MODES:
            raise ValueError(f"dense must be one of {', '.join(DENSE_MODES)}, got {dense!r}")
        self.mode, self.max_rows, self.dense = mode, int(max_rows), dense
        self.packed_prompts = bool(packed_prompts)  # prompt rows (``prompt_rows``) on the packed kernel too
        self.out_features, self.in_features = weight.shape
        if mode == "int8" and self.in_features % INT8_K_MULTIPLE:
            # torch._weight_int8pack_mm's bf16 kernel segfaults for other K (found by a test)
            raise ValueError(f"int8 needs in_features ({self.in_features}) to be a multiple of {INT8_K_MULTIPLE}")
        dt = KERNEL_DTYPE  # the packed kernels' activation and scale dtype, whatever the model's
        self.bias = bias  # shared with the source module (nn.Parameter or None)
        self.kernel: str  # int4: "sfcl" or "torch" (``int4_kernel``); int8: "q8" or "bf16" (``int8_kernel``)
        if mode == "int8":
            self.kernel = int8_kernel() if self.in_features % Q8_BLOCK == 0 else "bf16"
            q, s = quantize_int8(weight)
            self.register_buffer("qweight", q)  # (N, K) int8
            self.register_buffer("scales", s.to(dt))  # (N,)
            kernel_w = (lambda: _int8_kernel_weight(q, self.scales)) if dense != "dequant" else None
        else:
            q, scale, zero = quantize_int4(weight)
            N, K = q.shape
            # (K/group, N, 2): [..., 0] = scale, [..., 1] = zero, torch's kernel's layout (the weights either kernel
            # multiplies by: codes times these bf16 values)
            self.register_buffer("scales_and_zeros", torch.stack([scale.t(), zero.t()], -1).to(dt).contiguous())
            self.kernel = int4_kernel() if N % 8 == 0 else "torch"
            if self.kernel == "sfcl":  # SFCL's layout only: (N/8, K/32, 128) uint8 codes, (N/8, K/32, 16) bf16
                codes, sz = int4_q8_layout(q, self.scales_and_zeros)
                self.register_buffer("q4codes", codes)
                self.register_buffer("q4sz", sz)
                self.qweight = None
            else:
                self.register_buffer("qweight", torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))  # (N, K/2) uint8, kernel layout
            if dense == "dequant" and self.kernel != "sfcl":  # SFCL's layout gives q back (int4_q8_codes)
                self.register_buffer("qnibbles", (q[:, ::2] | (q[:, 1::2] << 4)).contiguous())  # (N, K/2) uint8, ours
            kernel_w = (lambda: _int4_kernel_weight(q, self.scales_and_zeros)) if dense != "dequant" else None
        # The dense path multiplies by the weights the packed kernel multiplies by (dequantized from
        # its codes and bf16 scales, (N, K) float32 before the copy's dtype), not by the original
        # ones: a token then gets the same logits, up to rounding, whether its row ran on the packed
        # kernel (a decode batch of <= max_rows rows, prompt rows with ``packed_prompts``) or densely
        # (a larger batch, prompt rows without it). With the original weights the two paths
        # differed by the quantization error, and greedy answers changed with load and cache state.
        # The rounding is not small where the packed kernel quantises the activations to int8
        # (``int4_kernel`` "sfcl", ``int8_kernel`` "q8"): ~0.6% relative error between the paths on a
        # 1,536 x 576 layer against ~0.25% with bf16 activations (the thirty-fourth session's tester),
        # so a near tie still goes either way with the batch a row lands in.
        self.dense_weight = kernel_w().to(weight.dtype) if dense == "keep" else None
        self.dense_fp16 = Fp16Linear(kernel_w(), None) if dense == "fp16" else None  # bias added below

    @classmethod
    def from_linear(cls, lin: nn.Linear, mode: str, max_rows: int, dense: str = "keep",
                    packed_prompts: bool = False) -> "QuantLinear":
        return cls(mode, lin.weight.data, lin.bias, max_rows, dense, packed_prompts)

    def __getstate__(self) -> dict:
        """For copy.deepcopy and pickle: a dense weight packed by ``pack_dense_weights`` (oneDNN's opaque
        tensor, which has no storage to copy) travels plain and is packed again by ``__setstate__``."""
        state = self.__dict__.copy()
        w = state.get("dense_weight")
        if w is not None and w.is_mkldnn:
            state["dense_weight"], state["_dense_packed"] = w.to_dense(), True
        return state

    def __setstate__(self, state: dict) -> None:
        repack = state.pop("_dense_packed", False)
        super().__setstate__(state)
        if repack:
            self.dense_weight = packed_weight(self.dense_weight)

    def dense_matrix(self) -> torch.Tensor | None:
        """The kept dense weight (``dense="keep"``) as a plain (N, K) tensor in the model dtype, also
        after ``pack_dense_weights`` (a copy then); None for the other dense modes."""
        w = self.dense_weight
        return w.to_dense() if w is not None and w.is_mkldnn else w

    def dequantized_weight(self) -> torch.Tensor:
        """The weight the packed kernel multiplies by, (N, K) in ``KERNEL_DTYPE``."""
        dt = self.scales.dtype if self.mode == "int8" else self.scales_and_zeros.dtype
        if self.mode == "int8":
            return _int8_kernel_weight(self.qweight, self.scales).to(dt)
        if self.kernel == "sfcl":
            q = int4_q8_codes(self.q4codes)
        elif self.dense == "dequant":
            q = torch.stack([self.qnibbles & 15, self.qnibbles >> 4], -1).reshape(self.out_features, self.in_features)
        else:  # recover q through the kernel itself: rows of the identity pick columns of W^T
            eye = torch.eye(self.in_features, dtype=dt, device=self.qweight.device)
            return torch._weight_int4pack_mm_for_cpu(eye, self.qweight, INT4_GROUP, self.scales_and_zeros).t().contiguous()
        return _int4_kernel_weight(q, self.scales_and_zeros).to(dt)  # fp32 math, one rounding, like the kernel

    def path(self, rows: int) -> str:
        """Which multiplication ``forward`` runs for ``rows`` input rows: ``packed`` (the int8 / int4
        kernel: decode batches of <= max_rows rows, within ``prompt_rows`` every row where the
        layer was quantized with ``packed_prompts``, and every row with ``dense="packed"``), ``fp16``
        (the ``Fp16Linear`` copy), ``dense`` (``F.linear`` with the kept copy) or ``dequant``
        (``F.linear`` with the weight dequantized for the call)."""
        if self.dense == "packed" or (self.packed_prompts if _prompt_rows else rows <= self.max_rows):
            return "packed"
        if self.dense_fp16 is not None:
            return "fp16"
        return "dense" if self.dense_weight is not None else "dequant"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x if x.dim() == 2 else x.reshape(-1, self.in_features)  # (M, K)
        path = self.path(x2.shape[0])
        if path == "packed":
            if self.kernel == "sfcl":  # int8 activations from x as it is (float32, bf16 or fp16): no bf16 cast
                y = int4_mm(x2.contiguous(), self.q4codes, self.q4sz)  # (M, N)
            elif self.kernel == "q8":  # the same for the int8 weight
                y = int8_q8_mm(x2.contiguous(), self.qweight, self.scales)  # (M, N)
            else:
                xk = x2.to(KERNEL_DTYPE).contiguous()  # torch's packed kernels (and SFCL's int8 GEMV) take bf16
                if self.mode == "int8":
                    y = int8_mm(xk, self.qweight, self.scales)  # (M, N)
                else:
                    y = torch._weight_int4pack_mm_for_cpu(xk, self.qweight, INT4_GROUP, self.scales_and_zeros)
            y = y.to(x.dtype)
            if self.bias is not None:
                y = y + self.bias
        elif path == "fp16":
            y = self.dense_fp16(x2)
            if self.bias is not None:
                y = y + self.bias
        elif self.dense_weight is not None and self.dense_weight.is_mkldnn:  # packed by pack_dense_weights
            y = packed_linear(x2, self.dense_weight, self.bias)
        else:
            w = self.dense_weight if self.dense_weight is not None else self.dequantized_weight().to(x.dtype)
            y = F.linear(x2, w, self.bias)
        return y if x.dim() == 2 else y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, mode={self.mode}, "
                f"max_rows={self.max_rows}, dense={self.dense}, packed_prompts={self.packed_prompts}")


def resolved_cuts(mode: str, lm_head: str | None = None, max_rows: int | None = None,
                  head_max_rows: int | None = None) -> tuple[str, int, int]:
    """(lm_head format, max_rows of the block projections, max_rows of the lm_head) that
    ``quantize_weights`` applies for these arguments (None: the defaults)."""
    head = DEFAULT_LM_HEAD[mode] if lm_head is None else lm_head
    rows = DEFAULT_MAX_ROWS.get(mode, 0) if max_rows is None else int(max_rows)
    return head, rows, rows if head_max_rows is None else int(head_max_rows)


def quantize_weights(model: nn.Module, mode: str, max_rows: int | None = None, dense: str = "keep",
                     lm_head: str | None = None, head_max_rows: int | None = None,
                     packed_prompts: bool = False, head_dense: str | None = None) -> nn.Module:
    """Swap the linear layers of a ``LlamaModel`` for ``QuantLinear`` / ``Fp16Linear`` in place;
    returns ``model``.

    mode: ``none`` (no-op), ``fp16`` (every projection an ``Fp16Linear``), ``int8`` or ``int4``
    (the block projections ``QuantLinear``). max_rows: largest input row count served by the
    packed kernel (default ``DEFAULT_MAX_ROWS[mode]``). dense: ``keep`` | ``dequant`` | ``fp16``
    (weights of the M > max_rows path; ``fp16``: an ``Fp16Linear`` copy, 2 bytes/parameter).
    lm_head: ``none`` | ``fp16`` | ``int8`` | ``int4`` (default ``DEFAULT_LM_HEAD[mode]``: int8
    for both integer modes, see below; fp16 for fp16). The embedding is not touched (a tied
    ``lm_head`` quantizes a copy of its values; its dense weight, like every dense weight, is the
    packed kernel's weight, so it no longer shares the embedding's memory). head_max_rows: max_rows
    of a quantized ``lm_head`` (default: max_rows). packed_prompts: the block projections take the
    packed kernel for prompt rows too (``prompt_rows``; the lm_head keeps its dense path there), where
    that kernel is faster than the dense weights at a prompt chunk's hundreds of rows. head_dense:
    ``dense`` of a quantized lm_head (default: ``dense``).

    Raises ValueError for an unknown mode / dense value, a model not on the CPU, fp16 without
    FBGEMM (``fp16_gemm_available``), or a layer whose in_features is not a multiple of 32 (int4)
    or 16 (int8).
    """
    if mode not in WEIGHT_QUANT_MODES:
        raise ValueError(f"weight quantization must be one of {', '.join(WEIGHT_QUANT_MODES)}, got {mode!r}")
    if mode == "none":
        return model
    head_dense = dense if head_dense is None else head_dense
    for d in (dense, head_dense):
        if d not in DENSE_MODES:
            raise ValueError(f"dense must be one of {', '.join(DENSE_MODES)}, got {d!r}")
    head, rows, head_rows = resolved_cuts(mode, lm_head, max_rows, head_max_rows)
    if head not in WEIGHT_QUANT_MODES:
        raise ValueError(f"lm_head quantization must be one of {', '.join(WEIGHT_QUANT_MODES)}, got {head!r}")
    dev = next(model.parameters()).device
    if dev.type != "cpu":
        raise ValueError(f"--weight-quant {mode} runs on the CPU only (torch's packed int8/int4 and FBGEMM fp16 "
                         f"kernels used here are CPU kernels); the model is on {dev}: use --weight-quant none there")
    if "fp16" in (mode, dense, head, head_dense) and not fp16_gemm_available():
        raise ValueError("fp16 weights need FBGEMM's fp16 GEMM, which this torch build lacks (x86 builds have it); "
                         "use --weight-quant int8, int4 or none")
    if min(rows, head_rows) < 0:
        raise ValueError("max_rows and head_max_rows must be >= 0")

    def swap(lin: nn.Linear, kind: str, cut: int, dense_mode: str, prompts: bool) -> nn.Module:
        if kind == "fp16":
            return Fp16Linear(lin.weight.data, lin.bias)
        return QuantLinear.from_linear(lin, kind, cut, dense_mode, prompts)

    def plain(lin: nn.Module | None) -> nn.Linear | None:  # a PackedLinear (pack_dense_weights) as it was
        return lin.to_linear() if isinstance(lin, PackedLinear) else lin if isinstance(lin, nn.Linear) else None

    for blk in model.layers:
        for parent in (blk.self_attn, blk.mlp):
            for name in PROJECTIONS:
                lin = plain(getattr(parent, name, None))
                if lin is not None:
                    setattr(parent, name, swap(lin, mode, rows, dense, packed_prompts))
    if head != "none" and (lin := plain(model.lm_head)) is not None:
        model.lm_head = swap(lin, head, head_rows, head_dense, False)
    _new_weights(model)
    return model


# The batch-size hint oneDNN packs a dense weight for (``torch.ops.mkldnn._reorder_linear_weight``): any
# batch runs on the packed weight. Packed with this hint, the model's products equalled ``F.linear``'s bit
# for bit at 1-256 rows; from ~300 rows the 576-column ones (q, o, down) rounded differently in ~0.01% of
# their elements (bf16, torch 2.13, Intel Xeon with AMX, 2026-12-07; a hint of 1 gave other roundings from
# 40 rows). On an AMD EPYC without AMX (Zen 4, AVX-512 BF16) they were equal bit for bit at 7-512 rows.
PACK_BATCH_HINT = 512
PACKED_DTYPES = (torch.bfloat16, torch.float32)  # the weight dtypes pack_dense_weights packs


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    """w (N, K) bf16 or float32 CPU -> the same weight in oneDNN's packed layout (an opaque MkldnnCPU tensor),
    for ``packed_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, K) @ w^T (+ bias) for a weight from ``packed_weight``: (M, N) in x's dtype
    (``torch.ops.mkldnn._linear_pointwise``, no post-op)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, bias, "none", [], "")


@functools.cache
def dense_packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch build packs linear weights of ``dtype`` (bf16 or float32) for oneDNN
    (``torch.ops.mkldnn``'s ``_reorder_linear_weight`` and ``_linear_pointwise``; x86 CPU wheels with
    oneDNN have them) and the packed product is ``F.linear``'s here (probed once on a small matrix):
    bit for bit in bf16, where ``F.linear`` runs oneDNN too; in float32, where ``F.linear`` runs MKL's
    sgemm and oneDNN sums in another order, within 1e-5 relative."""
    if dtype not in PACKED_DTYPES or not torch._C._has_mkldnn or not torch.backends.mkldnn.is_available():
        return False
    try:
        g = torch.Generator().manual_seed(0)
        w = torch.randn(64, 96, generator=g).to(dtype)
        x = torch.randn(24, 96, generator=g).to(dtype)
        got, want = packed_linear(x, packed_weight(w)), F.linear(x, w)
        if dtype == torch.bfloat16:
            return bool(torch.equal(got, want))
        return bool(torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())))
    except (RuntimeError, AttributeError):
        return False


class PackedLinear(nn.Module):
    """``y = x W^T (+ b)`` with a bf16 or float32 W held in oneDNN's packed layout (``packed_weight``):
    what ``pack_dense_weights`` puts in place of a plain ``nn.Linear`` (every projection under
    ``--weight-quant none``, a ``lm_head`` left unquantized). ``weight`` is the opaque MkldnnCPU
    tensor (not a parameter: it has no storage, so ``state_dict`` and ``parameters`` leave it out);
    ``plain_weight`` reads it back. ``sfcl.model.decode_stack`` hands it to ``decode_layers`` as a
    dense weight; code that needs a plain ``nn.Linear`` (the anchor model pass's fused ``addmm_``)
    takes the module's ``forward`` instead.

    x (..., K) -> y (..., N), both in the weight's dtype (``packed_linear``:
    ``torch.ops.mkldnn._linear_pointwise``). Raises ValueError for a weight that is not bf16 or float32
    on the CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if weight.dtype not in PACKED_DTYPES or weight.device.type != "cpu":
            raise ValueError(f"PackedLinear packs bf16 or float32 CPU weights, got {weight.dtype} on {weight.device}")
        self.out_features, self.in_features = weight.shape
        self.weight = packed_weight(weight.detach())  # (N, K), oneDNN's blocked layout
        self.bias = bias  # shared with the source module (nn.Parameter or None)

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> "PackedLinear":
        return cls(lin.weight.data, lin.bias)

    def plain_weight(self) -> torch.Tensor:
        """The weight as a plain (N, K) tensor in its dtype (a copy)."""
        return self.weight.to_dense()

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` with this module's weight (a copy) and bias (shared)."""
        lin = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                        dtype=self.weight.dtype, device="meta")
        lin.weight = nn.Parameter(self.plain_weight(), requires_grad=False)
        if self.bias is not None:
            lin.bias = self.bias
        return lin

    def __getstate__(self) -> dict:
        """For copy.deepcopy and pickle: the packed weight (no storage to copy) travels plain."""
        state = self.__dict__.copy()
        state["weight"] = self.plain_weight()
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self.weight = packed_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return packed_linear(x, self.weight, self.bias)  # (M, N)
        y = packed_linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, packed=oneDNN"


def _packable(w: torch.Tensor | None) -> bool:
    """Whether ``pack_dense_weights`` packs ``w``: a plain CPU tensor of a dtype oneDNN packs here."""
    return w is not None and not w.is_mkldnn and w.device.type == "cpu" and dense_packing_available(w.dtype)


def pack_dense_weights(model: nn.Module) -> int:
    """Hold every ``QuantLinear``'s kept bf16 / float32 dense weight (the path of batches above ``max_rows``
    and of prompt chunks) in oneDNN's packed layout, in place of the plain copy (no extra memory), and put
    a ``PackedLinear`` in place of every plain bf16 / float32 ``nn.Linear`` child (``--weight-quant
    none``'s projections, an unquantized ``lm_head``; a ``lm_head`` tied to the embedding then holds a
    packed copy of it, +V x H x 2 or 4 bytes), so that a product no longer re-packs the weight first:
    torch's ``F.linear`` in bf16 reorders the whole weight into oneDNN's blocked layout on every call,
    which at a few dozen rows costs more than the product.
    The 4 x 30 block projections of SmolLM2-135M took 17.9 / 18.4 / 23.4 / 33.9 / 52-54 ms at 7 / 16 /
    40 / 128 / 256 rows with ``F.linear`` and 11.9 / 12.3 / 15.2 / 24.1 / 46-47 ms packed, the same products
    bit for bit; at 512 rows 69 against 93-96 ms, some rounded differently (``python
    scripts/profile_dense_packing.py``, 2 threads, Intel Xeon with AMX, 2026-12-07). In the model the
    512-row prompt chunks did not slow down: a cold 3,117-token prefill took 1,137-1,146 ms packed and
    1,145-1,153 ms plain, while a decode step of 16 rows went from 27.0-27.4 to 19.9 ms (``python
    scripts/profile_repeated_prefill.py [--plain-weights]``, ``python scripts/profile_decode.py --eager
    --batch 16 --length 300 --threads 2 [--pack-dense]``). Not for a model run under ``torch.compile``
    (Dynamo does not take oneDNN's opaque tensors: ``sfcl serve --compile`` leaves the weights plain).
    float32 (``--dtype auto`` on AVX2 CPUs): torch's ``F.linear`` runs MKL's sgemm, which does not re-pack,
    but oneDNN's packed product was faster still: a ``none`` decode step of 1 / 16 rows took 47.1-47.7 /
    84-86 ms plain and 26.6-29.8 / 51-53 ms packed (AVX2 code paths of an AMD EPYC Zen 4, ``python
    scripts/profile_decode.py --eager --weight-quant none --threads 2 --batch B [--pack-dense]``), its
    products within float32 rounding of MKL's (another summation order); a row's product changed
    with the batch's size (1-16 rows against 32) less often than with MKL's, but still for the
    1,536-column ``down_proj`` between one row and 32.
    Returns how many weights were packed (0 where ``dense_packing_available`` is false for their dtype)."""
    n = 0
    for m in list(model.modules()):
        if isinstance(m, QuantLinear) and _packable(m.dense_weight):
            m.dense_weight = packed_weight(m.dense_weight)
            n += 1
        for name, child in list(m.named_children()):
            if type(child) is nn.Linear and _packable(child.weight):
                setattr(m, name, PackedLinear.from_linear(child))
                n += 1
    if n:
        _new_weights(model)
    return n


def parse_weight_format(spec: str) -> tuple[str, str, str | None]:
    """A weight format written ``MODE[+DENSE][/HEAD]`` (as logged by ``sfcl.model.hardware`` and
    taken by the profiling scripts) -> (mode, dense, lm_head or None) for ``quantize_weights``:
    ``int4+fp16/fp16`` = int4 packed kernels up to max_rows, fp16 weights above, fp16 lm_head.
    Raises ValueError for an unknown part."""
    body, _, head = spec.partition("/")
    mode, _, dense = body.partition("+")
    dense, head = dense or "keep", head or None
    if mode not in WEIGHT_QUANT_MODES or dense not in DENSE_MODES or (head is not None and head not in WEIGHT_QUANT_MODES):
        raise ValueError(f"bad weight format {spec!r}: MODE[+DENSE][/HEAD] with MODE and HEAD in "
                         f"{', '.join(WEIGHT_QUANT_MODES)} and DENSE in {', '.join(DENSE_MODES)}")
    return mode, dense, head


def weight_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes held by the linear layers: ``packed`` (kernel weights + scales; fp16 weights of an
    ``Fp16Linear``) and ``dense`` (copies kept for the M > max_rows path, excluding a dense weight
    shared with the embedding). An FBGEMM fp16 matrix counts 2 bytes per weight (its padding is
    not visible from Python; a weight packed for oneDNN, ``pack_dense_weights``, counts its logical size)."""
    emb = model.embed_tokens.weight.data_ptr()

    def shared(w: torch.Tensor) -> bool:  # the embedding itself (a packed copy never is)
        return not w.is_mkldnn and w.data_ptr() == emb

    out = {"packed": 0, "dense": 0}
    fp16_dense = {id(m.dense_fp16) for m in model.modules() if isinstance(m, QuantLinear) and m.dense_fp16 is not None}
    for m in model.modules():
        if isinstance(m, Fp16Linear):
            out["dense" if id(m) in fp16_dense else "packed"] += 2 * m.in_features * m.out_features
        elif isinstance(m, QuantLinear):
            out["packed"] += sum(b.numel() * b.element_size() for b in m.buffers())
            if m.dense_weight is not None and not shared(m.dense_weight):
                out["dense"] += m.dense_weight.numel() * m.dense_weight.element_size()
        elif isinstance(m, (nn.Linear, PackedLinear)) and not shared(m.weight):
            out["dense"] += m.weight.numel() * m.weight.element_size()
    return out
