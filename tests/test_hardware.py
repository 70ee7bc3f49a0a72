"""sfcl.model.hardware: the dtype ``--dtype auto`` picks from the CPU flags and the GEMM probe."""

from __future__ import annotations

import pytest
import torch

from sfcl.model import hardware


@pytest.fixture
def fresh(monkeypatch):
    """choose_dtype's per-process cache and the log-once set, emptied for this test."""
    hardware._choose.cache_clear()
    monkeypatch.setattr(hardware, "_logged", set())
    yield
    hardware._choose.cache_clear()


def _fake(monkeypatch, flags: set[str], fp32: float, bf16: float):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(hardware, "gemm_gflops", lambda dt, *a, **k: {torch.float32: fp32, torch.bfloat16: bf16}[dt])


@pytest.mark.parametrize("flags,fp32,bf16,want", [
    ({"avx2", "fma"}, 50.0, 1.5, torch.float32),  # AVX2-only EPYC: bf16 emulated
    ({"avx2", "avx512f", "avx512_bf16"}, 60.0, 110.0, torch.bfloat16),  # native and faster
    ({"avx2", "avx512f", "avx512_bf16"}, 60.0, 20.0, torch.float32),  # flags say native, the probe disagrees
    ({"avx2", "amx_bf16", "amx_tile"}, 150.0, 125.0, torch.bfloat16),  # native, level at the decode shape
    (set(), 150.0, 125.0, torch.float32),  # flags unknown: bf16 must measure as fast
    ({"avx2", "amx_bf16", "amx_tile"}, 60.0, 300.0, torch.bfloat16),
    ({"avx2"}, 50.0, 80.0, torch.float32),  # no native flag: never bf16, whatever one probe said
    (set(), 50.0, 80.0, torch.bfloat16),  # flags unknown: the probe decides
    (set(), 50.0, 2.0, torch.float32),
])
def test_auto_takes_bf16_only_where_native_and_not_much_slower(fresh, monkeypatch, flags, fp32, bf16, want):
    _fake(monkeypatch, flags, fp32, bf16)
    c = hardware.choose_dtype("cpu")
    assert c.dtype is want
    assert c.gflops == {"float32": fp32, "bfloat16": bf16}
    assert f"{fp32:.1f}" in c.reason and f"{bf16:.1f}" in c.reason


def test_a_slow_bf16_probe_on_a_native_cpu_is_probed_again(fresh, monkeypatch):
    """One probe that read bf16 far below fp32 (a preempted call) once made an AMX Xeon serve in
    float32; the probe now runs again, each dtype's best kept, and only a CPU below
    NATIVE_BF16_MIN_RATIO every time gets float32."""
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    reads = iter([{"float32": 170.0, "bfloat16": 60.0}, {"float32": 160.0, "bfloat16": 220.0}])
    calls = []
    monkeypatch.setattr(hardware, "_probe_one_thread", lambda dts: calls.append(1) or next(reads))
    c = hardware.choose_dtype("cpu")
    assert c.dtype is torch.bfloat16 and c.gflops == {"float32": 170.0, "bfloat16": 220.0} and len(calls) == 2
    hardware._choose.cache_clear()
    calls.clear()
    monkeypatch.setattr(hardware, "_probe_one_thread", lambda dts: calls.append(1) or {"float32": 170.0, "bfloat16": 60.0})
    assert hardware.choose_dtype("cpu").dtype is torch.float32 and len(calls) == 1 + hardware.PROBE_RETRIES
    hardware._choose.cache_clear()
    calls.clear()
    monkeypatch.setattr(hardware, "cpu_flags", lambda: frozenset({"avx2"}))  # no native flag: one probe only
    assert hardware.choose_dtype("cpu").dtype is torch.float32 and len(calls) == 1


def test_resolve_logs_the_choice_once_on_stderr(fresh, monkeypatch, capsys):
    _fake(monkeypatch, {"avx2"}, 50.0, 1.5)
    assert hardware.resolve_dtype("auto") is torch.float32
    assert hardware.resolve_dtype(None, "cpu:0") is torch.float32
    err = capsys.readouterr().err
    assert err.count("[DTYPE] auto -> float32") == 1 and "no native bf16" in err


def test_resolve_names_and_dtypes_without_probing(fresh, monkeypatch):
    monkeypatch.setattr(hardware, "gemm_gflops", lambda *a, **k: pytest.fail("explicit dtypes must not probe"))
    assert hardware.resolve_dtype("bfloat16") is torch.bfloat16
    assert hardware.resolve_dtype("float32") is torch.float32
    assert hardware.resolve_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="auto, bfloat16, float32, float16"):
        hardware.resolve_dtype("fp8")


def test_probe_measures_a_positive_rate_and_the_flags_parse():
    assert hardware.gemm_gflops(torch.float32, (4, 32, 32), budget_s=0.001) > 0
    flags = hardware.cpu_flags()
    assert isinstance(flags, frozenset)
    native = hardware.has_native_bf16(flags)
    assert native is None if not flags else native == any(f in flags for f in hardware.NATIVE_BF16_FLAGS)


def test_dtype_flag_defaults_to_auto_and_config_validates():
    from sfcl.cli import build_parser
    from sfcl.config import ModelConfig

    a = build_parser().parse_args(["serve"])
    assert a.dtype == "auto" and ModelConfig().dtype == "auto"
    with pytest.raises(ValueError, match="dtype must be one of auto"):
        ModelConfig(dtype="int8")


def test_packed_kernels_run_in_an_fp32_model():
    """An fp32 model's activations enter the packed int8/int4 kernels as bf16 and leave as fp32."""
    from torch import nn

    from sfcl.model.quant import QuantLinear

    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 32, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 64, generator=g) * 0.05)
    x = torch.randn(3, 64, generator=g)
    for mode in ("int8", "int4"):
        q = QuantLinear.from_linear(lin, mode, max_rows=8)
        y = q(x)
        assert y.dtype == torch.float32 and y.shape == (3, 32)
        ref = x @ q.dequantized_weight().float().T + lin.bias
        assert (y - ref).abs().max() < 0.02 * ref.abs().max()  # bf16 rounding of x and y only


def test_cpu_summary_names_the_model_and_the_simd_flags_present():
    from sfcl.model.hardware import cpu_flags, cpu_summary

    avx512 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 avx512_vnni\n"
    avx2 = "model name\t: AMD EPYC\nflags\t\t: fpu sse avx2 fma\n"
    cap = torch.backends.cpu.get_cpu_capability()
    assert cpu_summary(avx512) == f"AMD EPYC (avx2 avx512f avx512_vnni avx512_bf16; torch {cap})"
    assert cpu_summary(avx2) == f"AMD EPYC (avx2; torch {cap})"
    assert cpu_flags(avx2) == {"fpu", "sse", "avx2", "fma"} and cpu_flags("") == frozenset()
    assert "none of avx2" in cpu_summary("model name : Old CPU\nflags : fpu sse\n")
