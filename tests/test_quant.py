"""sfcl.model.quant: weight-only INT8 / INT4 / FBGEMM fp16 linears, M-dispatch, model-level drift,
the per-machine weight format (sfcl.model.hardware.choose_weight_format), bad flags."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import contractnli_docs, tiny_llama
from torch import nn

from sfcl.model import decode_kernel, quant
from sfcl.model.quant import (Fp16Linear, QuantLinear, dequantize_int4, fp16_gemm_available, parse_weight_format,
                               quantize_int4, quantize_int8, quantize_weights, weight_bytes)


def _linear(n=96, k=128, bias=False, seed=0) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g))
    return lin


def _x(m, k=128, seed=1):
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_kernel_matches_dequantized_reference(mode, bias):
    lin = _linear(bias=bias)
    q = QuantLinear.from_linear(lin, mode, max_rows=1 << 20)
    w = q.dequantized_weight().float()  # (N, K)
    # the quantized weight is close to the original: within half a quantization step
    step = (lin.weight.float().abs().amax(1, keepdim=True) / 127) if mode == "int8" else \
        (lin.weight.float().view(96, -1, 32).amax(-1) - lin.weight.float().view(96, -1, 32).amin(-1)).repeat_interleave(32, 1) / 15
    assert ((w - lin.weight.float()).abs() <= 0.5 * step + 2e-3).all()
    for m in (1, 3, 16):
        x = _x(m)
        ref = x.float() @ w.T + (lin.bias.float() if bias else 0)
        y = q(x)
        assert y.dtype == torch.bfloat16 and y.shape == (m, 96)
        # bf16 output rounding only (relative 2^-8 of the row's magnitude)
        assert (y.float() - ref).abs().max() <= 1e-2 * ref.abs().max()
    # and it is not simply the bf16 weight: quantization error is visible in the result
    assert not torch.equal(q(_x(1)), lin(_x(1)))


def test_int4_follows_torch_group_convention_and_recovers_q4_1_exactly():
    g = torch.Generator().manual_seed(2)
    n, k = 64, 128
    codes = torch.randint(0, 16, (n, k), generator=g)
    codes.view(n, -1, 32)[..., 0], codes.view(n, -1, 32)[..., 1] = 0, 15  # a Q4_1 block spans 0..15
    d = torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3
    m = -torch.rand(n, k // 32, generator=g) * 0.1
    w = (d.repeat_interleave(32, 1) * codes + m.repeat_interleave(32, 1))  # Q4_1: w = d q + m, fp32
    q, scale, zero = quantize_int4(w)
    assert torch.equal(q.long(), codes)
    torch.testing.assert_close(scale, d, rtol=1e-6, atol=0)
    torch.testing.assert_close(zero, m + 8 * d, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(dequantize_int4(q, scale, zero), w, rtol=0, atol=1e-6)


def test_int4_unpacked_copy_matches_the_kernel_packing():
    lin = _linear(seed=3)
    keep = QuantLinear.from_linear(lin, "int4", 4, dense="keep")
    deq = QuantLinear.from_linear(lin, "int4", 4, dense="dequant")
    # keep recovers W through the kernel (identity input); dequant unpacks our own nibbles
    torch.testing.assert_close(keep.dequantized_weight(), deq.dequantized_weight(), rtol=0, atol=0)


def _int4_packed(q: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The int4 kernel q's packed path runs (``QuantLinear.kernel``, ``quant.int4_kernel``: torch's
    on bf16 activations, or SFCL's int4 x int8 on x as it is), in x's dtype."""
    if q.kernel == "sfcl":
        return torch.ops.sfcl.int4_linear(x.contiguous(), q.q4codes, q.q4sz)
    return torch._weight_int4pack_mm_for_cpu(x.bfloat16(), q.qweight, 32, q.scales_and_zeros).to(x.dtype)


def _int8_packed(q: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The int8 kernel q's packed path runs (``QuantLinear.kernel``, ``quant.int8_kernel``: bf16
    activations, or SFCL's int8 x int8 on x as it is), in x's dtype."""
    if q.kernel == "q8":
        return torch.ops.sfcl.int8_q8_linear(x.contiguous(), q.qweight, q.scales)
    return quant.int8_mm(x.bfloat16(), q.qweight, q.scales).to(x.dtype)


def _q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x (M, K) with every block of 32 rounded as the int8-activation kernels round it (llama.cpp's
    Q8_0: d = max |x| / 127, x8 = round(x / d); torch.round, like nearbyint, rounds half to even),
    as float32 values d * x8."""
    M, K = x.shape
    xb = x.float().view(M, K // 32, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    return (torch.round(xb / d).clamp(-127, 127) * d).view(M, K)


def test_int8_symmetric_per_channel():
    w = torch.tensor([[1.0, -0.5, 0.25], [0.0, 0.0, 2.0]])
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and q.tolist() == [[127, -64, 32], [0, 0, 127]]
    torch.testing.assert_close(s, torch.tensor([1 / 127, 2 / 127]))


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("dense", ["keep", "dequant"])
def test_dispatch_by_rows(mode, dense):
    lin = _linear(seed=4)
    q = QuantLinear.from_linear(lin, mode, max_rows=2, dense=dense)
    packed = (lambda x: _int8_packed(q, x)) if mode == "int8" else (lambda x: _int4_packed(q, x))
    dense_w = q.dense_weight if dense == "keep" else q.dequantized_weight()
    # either way the dense path multiplies by the packed kernel's weights, not the original ones
    torch.testing.assert_close(dense_w.float(), q.dequantized_weight().float(), rtol=0, atol=1e-6)
    assert not torch.equal(dense_w.float(), lin.weight.float())
    x2, x3 = _x(2), _x(3)
    assert torch.equal(q(x2), packed(x2))
    assert torch.equal(q(x3), F.linear(x3, dense_w))
    # rows are counted over all leading dims: (1, 2, K) -> packed, (2, 2, K) -> dense
    assert torch.equal(q(x2.view(1, 2, -1)), packed(x2).view(1, 2, -1))
    x4 = _x(4)
    assert torch.equal(q(x4.view(2, 2, -1)), F.linear(x4, dense_w).view(2, 2, -1))


def test_bad_values_error_cleanly():
    lin = _linear()
    model = nn.Module()
    model.layers, model.lm_head = nn.ModuleList(), lin
    with pytest.raises(ValueError, match="none, fp16, int8, int4"):
        quantize_weights(model, "int3")
    with pytest.raises(ValueError, match="dense"):
        quantize_weights(model, "int8", dense="sometimes")
    with pytest.raises(ValueError, match="multiple of the group size"):
        QuantLinear.from_linear(nn.Linear(100, 8).to(torch.bfloat16), "int4", 4)
    from sfcl.config import ModelConfig

    with pytest.raises(ValueError, match="weight_quant"):
        ModelConfig(weight_quant="int2")
    with pytest.raises(ValueError, match="CPU only"):
        ModelConfig(weight_quant="int4", device="cuda")
    assert quantize_weights(model, "none") is model and model.lm_head is lin


def test_cli_flag_maps_to_model_config(capsys):
    from sfcl.cli import build_parser, main
    from sfcl.cli.flags import configs

    mc, _, _ = configs(build_parser().parse_args(["serve", "--weight-quant", "int4"]))
    assert mc.weight_quant == "int4"
    mc, _, _ = configs(build_parser().parse_args(["generate", "hi"]))
    assert mc.weight_quant == "auto"
    with pytest.raises(SystemExit) as e:
        main(["serve", "--weight-quant", "int3"])
    assert e.value.code == 2 and "invalid choice: 'int3'" in capsys.readouterr().err
    assert main(["serve", "--weight-quant", "int8", "--device", "cuda"]) == 2
    assert capsys.readouterr().err.startswith("sfcl: error: --weight-quant int8 runs on the CPU only")
    from sfcl.config import ModelConfig

    assert ModelConfig(device="cuda").weight_quant == "auto"  # auto is fine anywhere: none off the CPU


@pytest.mark.parametrize("mode,min_top1,min_cos", [("int8", 0.88, 0.99), ("int4", 0.90, 0.995)])
def test_model_level_drift_is_small(lm, mode, min_top1, min_cos):
    """Teacher-forced over 256 NDA tokens, every linear on the packed kernel, against the unquantized
    model in the serving dtype. Measured (2026-11-30, bf16 on AVX-512 BF16): top-1 next-token
    agreement 0.934 (int8) / 0.945 (int4), tap cosine min 0.9966 / 0.9988."""
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import AttnBatch
    from sfcl.model.loader import model_fingerprint

    ids = lm.tokenizer(contractnli_docs(1)[0].text, add_special_tokens=False)["input_ids"][:256]
    dt = lm.model.embed_tokens.weight.dtype  # the serving dtype (--dtype auto: bf16 or fp32 by CPU)

    def run(model):
        kv = KVCache(lm.args, 1, len(ids) + 8, dt)
        o = model(torch.tensor([ids]), AttnBatch(True, torch.tensor([0]), torch.arange(len(ids)), len(ids)), kv, 22,
                  all_positions=True, want_probs=False)
        return o.logits[0], o.tap_hidden[0].float()

    qmodel = quantize_weights(copy.deepcopy(lm.model), mode, max_rows=1 << 20)
    assert sum(isinstance(m, QuantLinear) for m in qmodel.modules()) == 4 * lm.args.n_layers + 1
    assert isinstance(qmodel.embed_tokens, nn.Embedding) and qmodel.embed_tokens.weight.dtype == dt
    assert model_fingerprint(lm.args, qmodel) == lm.fingerprint
    l0, h0 = run(lm.model)
    l1, h1 = run(qmodel)
    top1 = (l1.argmax(-1) == l0.argmax(-1)).float().mean().item()
    assert min_top1 <= top1 < 1.0  # < 1: the quantized weights are really in use
    assert F.cosine_similarity(h1, h0, dim=-1).min().item() >= min_cos


def test_engine_decodes_through_the_packed_kernels(lm, monkeypatch):
    """Served with the real dispatch: a 1-stream decode step takes the packed path (M = 1), a
    prompt's prefill step the dense one; the answer is real text."""
    import dataclasses

    from sfcl.config import EngineConfig
    from sfcl.engine.engine import run_to_completion
    from sfcl.engine.events import TextDelta
    from sfcl.engine.request import SamplingParams
    from sfcl.engine_stack import make_llm_engine

    qlm = dataclasses.replace(lm, model=quantize_weights(copy.deepcopy(lm.model), "int4"))
    calls = {"int4": 0, "int8": 0, "dense_rows": []}
    real4, real8, real_linear = torch._weight_int4pack_mm_for_cpu, quant.int8_mm, F.linear

    def count4(*a):
        calls["int4"] += 1
        return real4(*a)

    def count8(*a):
        calls["int8"] += 1
        return real8(*a)

    def count_linear(x, w, b=None):
        calls["dense_rows"].append(x.shape[0])
        return real_linear(x, w, b)

    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", count4)
    real4q8 = quant.int4_mm

    def count4q8(*a):
        calls["int4"] += 1
        return real4q8(*a)

    monkeypatch.setattr(quant, "int4_mm", count4q8)  # SFCL's int4 x int8 GEMV where quant.int4_kernel picks it
    monkeypatch.setattr(quant, "int8_mm", count8)  # SFCL's int8 GEMV or torch's (test_int8_mm_*)
    real8q8 = quant.int8_q8_mm

    def count8q8(*a):
        calls["int8"] += 1
        return real8q8(*a)

    monkeypatch.setattr(quant, "int8_q8_mm", count8q8)  # SFCL's int8 x int8 GEMV where quant.int8_kernel picks it
    monkeypatch.setattr(F, "linear", count_linear)
    ids = lm.tokenizer("The Recipient shall keep all Confidential Information", add_special_tokens=False)["input_ids"]
    # layers in Python (the fused decode layers call the same kernels from C++, where they cannot be
    # counted; that they pick the same paths is tests/test_decode_stack.py's)
    eng = make_llm_engine(qlm, None, EngineConfig(max_num_seqs=1, prefix_cache_tokens=0, attention_kernel="attention"))
    [ev] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=6, snapshot_mode="off", ignore_eos=True))])
    text = "".join(e.text for e in ev if isinstance(e, TextDelta))
    n = lm.args.n_layers
    # 5 decode steps x 4 block projections on int4, the head (int8) once per decode step
    assert calls["int4"] == 5 * 4 * n and calls["int8"] == 5
    # the prefill chunk: dense weights, M = prompt length, and its one sampled row's head too
    # (quantized without packed_prompts: prompt rows take the dense path, sfcl.model.quant.prompt_rows)
    assert calls["dense_rows"] == [len(ids)] * (4 * n) + [1]
    assert len(text.strip()) > 0


needs_fbgemm = pytest.mark.skipif(not fp16_gemm_available(), reason="this torch build has no FBGEMM fp16 GEMM")


@needs_fbgemm
@pytest.mark.parametrize("bias", [False, True])
def test_fp16_linear_is_the_fp16_rounded_weight_in_fp32_arithmetic(bias):
    g = torch.Generator().manual_seed(5)
    lin = nn.Linear(128, 96, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(96, 128, generator=g) * 0.05)
    f = Fp16Linear(lin.weight.data, lin.bias)
    for shape in ((1, 128), (7, 128), (2, 5, 128)):
        x = torch.randn(*shape, generator=g)
        ref = F.linear(x, lin.weight.half().float(), lin.bias)
        y = f(x)
        assert y.shape == ref.shape and y.dtype == torch.float32
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    # not the fp32 weight: the rounding to fp16 shows
    x = torch.randn(64, 128, generator=g)
    assert not torch.equal(f(x), F.linear(x, lin.weight, lin.bias))
    assert f(x.bfloat16()).dtype == torch.bfloat16  # computed in fp32, returned in x's dtype


@needs_fbgemm
def test_fp16_dense_path_serves_batches_above_max_rows():
    lin = nn.Linear(128, 96)
    q = QuantLinear.from_linear(lin, "int4", max_rows=2, dense="fp16")
    x2, x3 = torch.randn(2, 128), torch.randn(3, 128)
    packed = _int4_packed(q, x2).float() + lin.bias
    assert torch.equal(q(x2), packed)
    # the dense path multiplies by the kernel's weights (codes x bf16 scales), held in fp16
    sz = q.scales_and_zeros
    codes = quantize_int4(lin.weight.data)[0]
    kernel_w = dequantize_int4(codes, sz[..., 0].t(), sz[..., 1].t())
    torch.testing.assert_close(q(x3), F.linear(x3, kernel_w.half().float(), lin.bias), rtol=1e-5, atol=1e-5)
    assert q.dense_weight is None and not hasattr(q, "qnibbles")  # no fp32 copy, no unpacked nibbles


@needs_fbgemm
def test_weight_formats_parse_apply_and_count_their_bytes(lm):
    assert parse_weight_format("int4+fp16/fp16") == ("int4", "fp16", "fp16")
    assert parse_weight_format("fp16") == ("fp16", "keep", None)
    with pytest.raises(ValueError, match="bad weight format"):
        parse_weight_format("int4+fp8")
    a = lm.args
    m = quantize_weights(copy.deepcopy(lm.model), "int4", max_rows=3, dense="fp16", lm_head="fp16")
    blocks = a.n_layers * (a.hidden_size * (a.n_heads + 2 * a.n_kv_heads) * a.head_dim
                           + a.n_heads * a.head_dim * a.hidden_size + 3 * a.hidden_size * a.intermediate_size)
    b = weight_bytes(m)
    assert b["dense"] == 2 * blocks  # the fp16 copies of the block weights
    assert b["packed"] > 2 * a.vocab_size * a.hidden_size + blocks // 2  # fp16 head + int4 codes and scales
    assert isinstance(m.lm_head, Fp16Linear) and isinstance(m.layers[0].mlp.down_proj, QuantLinear)
    f = quantize_weights(copy.deepcopy(lm.model), "fp16")
    assert isinstance(f.layers[3].self_attn.qkv_proj, Fp16Linear) and isinstance(f.lm_head, Fp16Linear)


def test_weight_format_choice_by_machine_kind(monkeypatch):
    from sfcl.model import hardware
    from sfcl.model.hardware import WeightFormat, choose_weight_format

    fake = {"fp32_fbgemm": [WeightFormat("int4", "fp16", "fp16", 3, 0.02, "too lossy"),
                            WeightFormat("fp16", "keep", "fp16", None, 0.001, "holds")],
            "bf16": [WeightFormat("int4", "keep", "int8", 6, None, "not measured")]}
    monkeypatch.setattr(hardware, "WEIGHT_FORMATS", fake)
    monkeypatch.setattr("sfcl.model.quant.fp16_gemm_available", lambda: True)
    c = choose_weight_format("auto", torch.float32)
    assert (c.mode, c.label) == ("fp16", "fp16/fp16") and "holds" in c.reason  # the first within the 1% bar
    assert choose_weight_format("auto", torch.bfloat16).mode == "none"  # no CI measured: not a default
    c = choose_weight_format("int4", torch.float32)  # explicit: the machine's dense path and head
    assert c.label == "int4+fp16/fp16" and c.max_rows == 3
    assert choose_weight_format("int8", torch.float32).label == "int8+fp16"
    assert choose_weight_format("none", torch.float32).mode == "none"
    assert choose_weight_format("auto", torch.float32, "cuda").mode == "none"
    monkeypatch.setattr("sfcl.model.quant.fp16_gemm_available", lambda: False)
    assert choose_weight_format("auto", torch.float32).mode == "none"  # no FBGEMM, nothing measured
    assert choose_weight_format("int4", torch.float32).label == "int4"
    with pytest.raises(ValueError, match="weight_quant"):
        choose_weight_format("int3", torch.float32)


def test_weight_format_choice_follows_the_int4_kernel_that_runs(monkeypatch):
    """A candidate measured with one int4 kernel is chosen only where that kernel runs; its
    lm_head cut travels with it."""
    from sfcl.model import hardware
    from sfcl.model.hardware import WeightFormat, choose_weight_format

    fake = {"fp32_fbgemm": [WeightFormat("int4", "fp16", "int8", 32, 0.006, "sfcl kernel", int4_kernel="sfcl",
                                         head_max_rows=3, packed_prompts=True),
                            WeightFormat("int4", "fp16", "int8", 3, 0.004, "torch kernel")]}
    monkeypatch.setattr(hardware, "WEIGHT_FORMATS", fake)
    monkeypatch.setattr("sfcl.model.quant.fp16_gemm_available", lambda: True)
    monkeypatch.setattr("sfcl.model.quant.int4_kernel", lambda: "sfcl")
    monkeypatch.setattr("sfcl.model.quant.int8_kernel", lambda: "q8")
    c = choose_weight_format("auto", torch.float32)
    assert (c.max_rows, c.head_max_rows, c.packed_prompts) == (32, 3, True) and "sfcl kernel" in c.reason
    assert c.summary(torch.float32) == ("int4 block projections (SFCL's int4 x int8 GEMV) for decode batches of "
                                        "1-32 rows, FBGEMM fp16 weights above, prompt tokens on the same kernels; "
                                        "int8 lm_head (SFCL's int8 x int8 GEMV) for 1-3 rows")
    monkeypatch.setattr("sfcl.model.quant.int8_kernel", lambda: "bf16")  # the log says what runs, not the candidate
    assert "int8 lm_head (int8 GEMV on unquantised activations) for 1-3 rows" in c.summary(torch.float32)
    assert choose_weight_format("int4", torch.float32).max_rows == 32
    assert choose_weight_format("int4", torch.float32).packed_prompts
    monkeypatch.setattr("sfcl.model.quant.int4_kernel", lambda: "torch")
    c = choose_weight_format("auto", torch.float32)
    assert (c.max_rows, c.head_max_rows, c.packed_prompts) == (3, None, False) and "torch kernel" in c.reason
    assert "FBGEMM fp16 weights above and for prompt tokens" in c.summary(torch.float32)


def test_lm_head_takes_its_own_packed_kernel_cut(lm):
    m = quantize_weights(copy.deepcopy(lm.model), "int4", max_rows=32, lm_head="int8", head_max_rows=3)
    assert m.lm_head.max_rows == 3 and m.layers[0].mlp.down_proj.max_rows == 32
    assert m.lm_head.path(4) == "dense" and m.layers[0].mlp.down_proj.path(16) == "packed"
    assert quantize_weights(copy.deepcopy(lm.model), "int8", max_rows=5).lm_head.max_rows == 5  # default: max_rows
    with pytest.raises(ValueError, match="head_max_rows"):
        quantize_weights(copy.deepcopy(lm.model), "int8", head_max_rows=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode, dense", [("int4", "keep"), ("int8", "keep"), ("int4", "fp16")])
def test_dense_path_multiplies_by_the_packed_kernels_weights(dtype, mode, dense):
    """Rows served by the packed kernel (a batch of <= max_rows rows) and the same rows served
    densely (a larger batch, a prompt chunk) agree up to rounding, far closer than the
    quantization error: a token's logits must not depend on how many rows share its step or on
    whether its prompt came from the prefix cache."""
    if dense == "fp16" and not fp16_gemm_available():
        pytest.skip("FBGEMM fp16 GEMM not in this torch build")
    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(576, 384, bias=False)
    lin.weight.data = (torch.randn(384, 576, generator=gen) * 0.05).to(dtype)
    q = QuantLinear.from_linear(lin, mode, max_rows=2, dense=dense)
    x = torch.randn(8, 576, generator=gen).to(dtype)
    packed = torch.cat([q(x[i:i + 2]) for i in range(0, 8, 2)]).float()  # 2 rows a call: the packed kernel
    exact = F.linear(x.float(), lin.weight.float())  # the unquantized weights
    quant_err = (packed - exact).abs().mean()  # what the gap would be with the original weights densely
    # the dense path (8 rows); where the packed kernel quantises activations to int8 (SFCL's int4 and
    # int8 x int8 GEMVs: quant.int4_kernel / int8_kernel), on the activations rounded as it rounds them
    dense_y = q(_q8_rounded(x).to(dtype) if q.kernel in ("sfcl", "q8") else x).float()
    path_gap = (packed - dense_y).abs().mean()  # rounding only (the packed kernels return bf16)
    assert path_gap < quant_err / 3, (float(path_gap), float(quant_err))


def test_prompt_rows_sends_few_rows_to_the_dense_path():
    """What the runner wraps steps that compute prompt tokens in: one row (a prompt's last token
    after a prefix-cache hit) takes the dense path, as the prompt computed whole would."""
    from sfcl.model.quant import prompt_rows

    lin = _linear(seed=5)
    q = QuantLinear.from_linear(lin, "int4", max_rows=2, dense="keep")
    x1 = _x(1)
    packed = _int4_packed(q, x1)
    assert torch.equal(q(x1), packed)
    with prompt_rows():
        assert torch.equal(q(x1), F.linear(x1, q.dense_weight))
        with prompt_rows(False):  # inactive: no change, still dense from the outer one
            assert torch.equal(q(x1), F.linear(x1, q.dense_weight))
    assert torch.equal(q(x1), packed)  # restored on exit


def test_packed_prompts_send_every_prompt_row_to_the_packed_kernel(lm):
    """Quantized with ``packed_prompts`` (where the packed kernel beats the dense weights at a prompt
    chunk's hundreds of rows), the block projections take it for prompt rows of any count, one row
    included, and decode batches keep their max_rows cut; the lm_head keeps its dense prompt path."""
    from sfcl.model.quant import prompt_rows

    m = quantize_weights(copy.deepcopy(lm.model), "int4", max_rows=4, lm_head="int8", head_max_rows=3,
                         packed_prompts=True)
    down, head = m.layers[0].mlp.down_proj, m.lm_head
    assert down.packed_prompts and not head.packed_prompts
    assert (down.path(4), down.path(5), head.path(3), head.path(4)) == ("packed", "dense", "packed", "dense")
    with prompt_rows():
        assert (down.path(1), down.path(512), head.path(1)) == ("packed", "packed", "dense")
        x = torch.randn(300, down.in_features, generator=torch.Generator().manual_seed(2)).to(down.dense_weight.dtype)
        assert torch.equal(down(x), _int4_packed(down, x).to(x.dtype))  # the kernel itself, all 300 rows
    plain = quantize_weights(copy.deepcopy(lm.model), "int4", max_rows=4)
    with prompt_rows():
        assert plain.layers[0].mlp.down_proj.path(1) == "dense"


def test_dense_packed_sends_every_row_to_the_packed_kernel_and_keeps_no_copy(lm):
    """``dense="packed"`` (the block projections where no engine row can reach a dense path): rows
    past max_rows, inside or outside ``prompt_rows``, run the packed kernel, and the layer holds no
    dense weight; ``head_dense`` gives the lm_head its own dense path."""
    from sfcl.model.quant import prompt_rows

    m = quantize_weights(copy.deepcopy(lm.model), "int4", max_rows=4, lm_head="int8", head_max_rows=3,
                         packed_prompts=True, dense="packed", head_dense="keep")
    down, head = m.layers[0].mlp.down_proj, m.lm_head
    assert down.dense_weight is None and down.dense_fp16 is None and not hasattr(down, "qnibbles")
    assert (down.path(4), down.path(5), down.path(512), head.path(4)) == ("packed", "packed", "packed", "dense")
    assert head.dense_weight is not None
    x = torch.randn(40, down.in_features, generator=torch.Generator().manual_seed(3)).to(next(m.parameters()).dtype)
    assert torch.equal(down(x), _int4_packed(down, x).to(x.dtype))  # 40 rows > max_rows: the kernel itself
    with prompt_rows():
        assert down.path(1) == "packed"
    with pytest.raises(ValueError, match="dense must be one of"):
        quantize_weights(copy.deepcopy(lm.model), "int4", head_dense="copy")


@pytest.mark.parametrize("max_decode_rows, blocks", [(16, "packed"), (32, "packed"), (33, "fp16"), (None, "fp16")])
def test_served_weights_drop_block_dense_copies_no_row_can_reach(lm, monkeypatch, capsys, max_decode_rows, blocks):
    """The float32 format whose prompt tokens run on the packed kernel (``packed_prompts``, max_rows 32):
    with decode batches of at most 32 rows (``--max-num-seqs``) the block projections get no FBGEMM fp16
    copy (said on stderr, with the memory not allocated); with more rows, or no bound, they keep it. The
    lm_head keeps its fp16 copy either way (its packed kernel takes 1-3 rows)."""
    import dataclasses

    from sfcl.engine_stack import served_weights
    from sfcl.model import hardware
    from sfcl.model.hardware import WeightFormat

    if not fp16_gemm_available():
        pytest.skip("FBGEMM fp16 GEMM not in this torch build")
    fake = {"fp32_fbgemm": [WeightFormat("int4", "fp16", "int8", 32, 0.005, "test", head_max_rows=3,
                                         packed_prompts=True)]}
    monkeypatch.setattr(hardware, "WEIGHT_FORMATS", fake)
    m = copy.deepcopy(lm.model).float()
    served = dataclasses.replace(lm, model=m)
    wq, _ = served_weights(served, "auto", max_decode_rows=max_decode_rows, pack_dense=False)
    down, head = m.layers[0].mlp.down_proj, m.lm_head
    assert (wq.dense, down.dense, head.dense) == ("fp16", blocks, "fp16")
    assert (down.dense_fp16 is None) == (blocks == "packed") and head.dense_fp16 is not None
    err = capsys.readouterr().err
    if blocks == "packed":
        assert f"block projections without dense copies (202 MiB not allocated): decode batches of at most " \
               f"{max_decode_rows} rows" in err
    else:
        assert "without dense copies" not in err


@pytest.fixture(scope="module")
def kernels():
    if not decode_kernel.load():
        pytest.skip(f"SFCL's native kernels could not be built here: {decode_kernel.why_unavailable()}")


@pytest.mark.parametrize("K", [576, 40, 7])
@pytest.mark.parametrize("M", [1, 3, 6, 17])
def test_int8_linear_computes_the_int8_product(kernels, M, K):
    """torch.ops.sfcl.int8_linear: x W^T with W = codes * row scale, float32 sums rounded once to x's
    dtype: float32 x within float32 summation error of a float64 reference, bf16 x within bf16
    rounding of it and of torch's own kernel (K a multiple of 16 there: its only K; above 2 rows
    the op hands such K to torch's kernel, others it keeps)."""
    g = torch.Generator().manual_seed(M * 100 + K)
    N = 300
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scales = (torch.rand(N, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    x = torch.randn(M, K, generator=g)
    ref = (x.double() @ q.double().T) * scales.double()  # (M, N)
    y32 = torch.ops.sfcl.int8_linear(x, q, scales)
    assert y32.dtype == torch.float32 and y32.shape == (M, N)
    torch.testing.assert_close(y32.double(), ref, atol=1e-4 * float(ref.abs().max()), rtol=1e-5)
    xb = x.to(torch.bfloat16)
    refb = (xb.double() @ q.double().T) * scales.double()
    yb = torch.ops.sfcl.int8_linear(xb, q, scales)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.double(), refb, atol=1e-6, rtol=2 ** -7)  # one bf16 rounding
    if K % quant.INT8_K_MULTIPLE == 0:
        torch.testing.assert_close(yb.float(), torch._weight_int8pack_mm(xb, q, scales).float(), atol=1e-6, rtol=2 ** -6)
    yh = torch.ops.sfcl.int8_linear(x.half(), q, scales)
    assert yh.dtype == torch.float16


def test_int8_mm_runs_sfcls_kernel_once_loaded(kernels, monkeypatch):
    q = torch.randint(-127, 128, (64, 32), dtype=torch.int8)
    s = torch.full((64,), 0.01, dtype=torch.bfloat16)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    used = []
    monkeypatch.setattr(torch.ops.sfcl, "int8_linear", lambda *a: used.append("sfcl") or torch.zeros(2, 64))
    quant.int8_mm(x, q, s)
    monkeypatch.setattr(decode_kernel, "loaded", lambda: False)
    y = quant.int8_mm(x, q, s)
    assert used == ["sfcl"] and torch.equal(y, torch._weight_int8pack_mm(x, q, s))


def test_int8_linear_rejects_bad_arguments(kernels):
    q = torch.randint(-127, 128, (8, 16), dtype=torch.int8)
    s = torch.ones(8)
    x = torch.randn(2, 16)
    for args in [(x, q.float(), s), (x, q[:, :8].contiguous(), s), (x, q, s[:4]), (x[0], q, s),
                 (x.long(), q, s), (x, q.t().contiguous().t(), s), (x, q, s.long())]:
        with pytest.raises(RuntimeError, match="int8_linear"):
            torch.ops.sfcl.int8_linear(*args)
    assert torch.ops.sfcl.int8_linear(x[:0], q, s).shape == (0, 8)


def _q8_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 x8 W^T with x8 the activations rounded per block of 32 (``_q8_rounded``), codes of
    -128 counted as -127, times the row scales."""
    return (_q8_rounded(x).double() @ q.double().clamp(min=-127).T) * scales.double()


@pytest.mark.parametrize("K", [576, 64])
@pytest.mark.parametrize("M", [1, 2, 3, 5])
def test_int8_q8_linear_multiplies_q8_activations(kernels, M, K):
    """torch.ops.sfcl.int8_q8_linear: the int8 weight times the activations quantised per block of 32:
    within float32 summation error of that product in float64, for float32, bf16 and fp16 x (bf16 /
    fp16 results one rounding away), and within the quantisation's error (~5e-3) of the exact x W^T."""
    g = torch.Generator().manual_seed(M * 1000 + K)
    N = 264
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=g)
    scales = (torch.rand(N, generator=g) * 0.02 + 1e-3).to(torch.bfloat16)
    x = torch.randn(M, K, generator=g)
    y = torch.ops.sfcl.int8_q8_linear(x, q, scales)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    ref = _q8_reference(x, q, scales)
    torch.testing.assert_close(y.double(), ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-5)
    exact = (x.double() @ q.double().T) * scales.double()
    assert float((y.double() - exact).norm() / exact.norm()) < 1.5e-2
    for dt, rtol in ((torch.bfloat16, 2 ** -7), (torch.float16, 2 ** -10)):
        yd = torch.ops.sfcl.int8_q8_linear(x.to(dt), q, scales)
        assert yd.dtype == dt
        refd = _q8_reference(x.to(dt), q, scales)
        torch.testing.assert_close(yd.double(), refd, atol=1e-4 * float(refd.abs().max()), rtol=rtol)


def test_int8_q8_linear_edge_values(kernels):
    """A block holding inf or NaN makes its row's outputs NaN (no silent finite answer), an all-zero
    row gives zeros, a weight code of -128 counts as -127, and no rows give (0, N)."""
    q = torch.randint(-127, 128, (16, 64), dtype=torch.int8)
    s = torch.full((16,), 0.01, dtype=torch.bfloat16)
    x = torch.randn(3, 64)
    x[1, 40] = float("inf")
    y = torch.ops.sfcl.int8_q8_linear(x, q, s)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()
    assert torch.equal(torch.ops.sfcl.int8_q8_linear(torch.zeros(1, 64), q, s), torch.zeros(1, 16))
    q128 = q.clone()
    q128[:, 5] = -128
    x1 = torch.randn(1, 64)
    torch.testing.assert_close(torch.ops.sfcl.int8_q8_linear(x1, q128, s),
                               _q8_reference(x1, q128, s).float(), atol=1e-5, rtol=1e-5)
    assert torch.ops.sfcl.int8_q8_linear(x[:0], q, s).shape == (0, 16)


def test_int8_q8_linear_rejects_bad_arguments(kernels):
    q = torch.randint(-127, 128, (8, 64), dtype=torch.int8)
    s = torch.ones(8)
    x = torch.randn(2, 64)
    for args in [(x[:, :48].contiguous(), q[:, :48].contiguous(), s),  # K not a multiple of 32
                 (x, q.float(), s), (x, q[:, :32].contiguous(), s), (x, q, s[:4]), (x[0], q, s),
                 (x.long(), q, s), (x.t().contiguous().t()[:, :64], q, s.long()), (x, q.t().contiguous().t(), s)]:
        with pytest.raises(RuntimeError, match="int8_q8_linear"):
            torch.ops.sfcl.int8_q8_linear(*args)


def test_int8_kernel_follows_the_cpu_and_the_variable(kernels, monkeypatch):
    """``auto``: int8 activations (where ``int4_kernel`` picks SFCL's too) except on AVX-512 code with
    AMX, bf16 ones there; ``$SFCL_INT8_KERNEL`` overrides; another value raises. A QuantLinear's packed
    path runs the chosen kernel on x as it is, and its dense path still multiplies by the same weights."""
    monkeypatch.delenv("SFCL_INT8_KERNEL", raising=False)
    monkeypatch.delenv("SFCL_INT4_KERNEL", raising=False)
    for cap, amx, want in (("AVX2", True, "q8"), ("AVX2", False, "q8"), ("AVX512", True, "bf16"),
                           ("AVX512", False, "q8"), ("DEFAULT", False, "q8")):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=cap: c)
        monkeypatch.setattr(quant, "_cpu_has_amx", lambda a=amx: a)
        assert quant.int8_kernel() == want
        assert quant.int4_kernel() == ("sfcl" if want == "q8" else "torch")
    monkeypatch.setenv("SFCL_INT8_KERNEL", "bf16")
    assert quant.int8_kernel() == "bf16"
    monkeypatch.setenv("SFCL_INT8_KERNEL", "q8")
    lin = torch.nn.Linear(128, 40)
    ql = QuantLinear.from_linear(lin, "int8", max_rows=2, dense="keep")
    assert ql.kernel == "q8"
    x2 = torch.randn(2, 128)
    assert torch.equal(ql(x2), torch.ops.sfcl.int8_q8_linear(x2, ql.qweight, ql.scales) + lin.bias)
    x3 = torch.randn(3, 128)
    torch.testing.assert_close(ql(x3), torch.nn.functional.linear(x3, ql.dense_weight, lin.bias))
    assert QuantLinear.from_linear(torch.nn.Linear(48, 8), "int8", max_rows=2).kernel == "bf16"  # K % 32 != 0
    monkeypatch.setenv("SFCL_INT8_KERNEL", "fast")
    with pytest.raises(ValueError, match="SFCL_INT8_KERNEL"):
        QuantLinear.from_linear(lin, "int8", max_rows=2)


@pytest.mark.skipif(not quant.dense_packing_available(), reason="this torch build does not pack bf16 weights for oneDNN")
def test_dense_weights_packed_for_onednn_give_the_same_products():
    """``pack_dense_weights``: a ``QuantLinear``'s kept bf16 dense weight in oneDNN's packed layout gives
    the products of the plain one (to bf16 rounding: oneDNN may pick another kernel for it; on the
    Intel Xeon with AMX of 2026-12-07 they agreed bit for bit up to 256 rows) at row counts of its dense
    path (and of a prompt chunk, under ``prompt_rows``), with and without a bias; ``dense_matrix``
    still reads the plain weight; the model's weights version moves; other dense modes and float32
    weights stay as they are."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(96, 64, bias=True).to(torch.bfloat16)
    for bias in (True, False):
        if not bias:
            lin.bias = None
        plain = QuantLinear.from_linear(lin, "int4", 4)
        m = torch.nn.Sequential(copy.deepcopy(plain))
        before = quant.weights_version(m)
        assert quant.pack_dense_weights(m) == 1 and quant.weights_version(m) == before + 1
        packed = m[0]
        assert packed.dense_weight.is_mkldnn and packed.path(40) == "dense"
        assert torch.equal(packed.dense_matrix(), plain.dense_weight)
        for rows in (1, 5, 7, 16, 40, 300):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            torch.testing.assert_close(packed(x), plain(x), msg=f"{rows} rows")
            with quant.prompt_rows(True):
                torch.testing.assert_close(packed(x), plain(x), msg=f"{rows} rows")
        x3 = torch.randn(2, 3, 96).to(torch.bfloat16)
        assert packed(x3).shape == (2, 3, 64)
        torch.testing.assert_close(packed(x3), plain(x3))
    copied = copy.deepcopy(m)  # oneDNN's opaque tensor has no storage: copied plain and packed again
    assert copied[0].dense_weight.is_mkldnn and torch.equal(copied[0].dense_matrix(), packed.dense_matrix())
    x = torch.randn(9, 96).to(torch.bfloat16)
    assert torch.equal(copied[0](x), packed(x)) and packed.dense_weight.is_mkldnn
    others = torch.nn.Sequential(QuantLinear.from_linear(lin, "int4", 4, dense="dequant"),
                                 QuantLinear.from_linear(torch.nn.Linear(96, 64).half(), "int4", 4))  # fp16
    assert quant.pack_dense_weights(others) == 0 and not others[1].dense_weight.is_mkldnn


@pytest.mark.skipif(not quant.dense_packing_available(), reason="this torch build does not pack bf16 weights for oneDNN")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plain_linears_become_packed_linears_with_the_same_products(dtype):
    """``pack_dense_weights`` puts a ``PackedLinear`` in place of each plain bf16 / float32 ``nn.Linear``
    child (``--weight-quant none``): the products of the plain layer (to the dtype's rounding: float32's
    ``F.linear`` runs MKL, which sums in another order) at 1-300 rows and on 3-d input, with and
    without a bias; fp16 layers stay; a deepcopy packs again; ``to_linear`` gives the plain layer
    back; an fp16 weight is refused."""
    if not quant.dense_packing_available(dtype):
        pytest.skip(f"this torch build does not pack {dtype} weights for oneDNN")
    torch.manual_seed(0)
    for bias in (True, False):
        lin = torch.nn.Linear(96, 64, bias=bias).to(dtype)
        m = torch.nn.Sequential(copy.deepcopy(lin), torch.nn.Linear(96, 64).half())  # the second stays
        before = quant.weights_version(m)
        assert quant.pack_dense_weights(m) == 1 and quant.weights_version(m) == before + 1
        packed = m[0]
        assert isinstance(packed, quant.PackedLinear) and packed.weight.is_mkldnn
        assert type(m[1]) is torch.nn.Linear
        assert torch.equal(packed.plain_weight(), lin.weight)
        assert not any(t.is_mkldnn for t in m.parameters())  # the packed weight is not a parameter
        for rows in (1, 5, 16, 40, 300):
            x = torch.randn(rows, 96).to(dtype)
            torch.testing.assert_close(packed(x), lin(x), msg=f"{rows} rows")
        x3 = torch.randn(2, 3, 96).to(dtype)
        assert packed(x3).shape == (2, 3, 64)
        torch.testing.assert_close(packed(x3), lin(x3))
        copied = copy.deepcopy(packed)
        assert copied.weight.is_mkldnn and torch.equal(copied(x3), packed(x3))
        back = packed.to_linear()
        assert type(back) is torch.nn.Linear and back.weight.dtype == dtype and torch.equal(back.weight, lin.weight)
    with pytest.raises(ValueError, match="bf16 or float32 CPU"):
        quant.PackedLinear(torch.randn(4, 8).half(), None)


@pytest.mark.skipif(not quant.dense_packing_available(), reason="this torch build does not pack bf16 weights for oneDNN")
def test_quantize_after_packing_quantizes_the_plain_weights():
    """A model packed under ``none`` and then quantized gets the ``QuantLinear``s the plain model would
    (same codes), and ``weight_bytes`` counts a packed bf16 projection like a plain one (an untied
    lm_head here: a tied one gets a packed copy, no longer the embedding's memory)."""
    plain = tiny_llama()[1].to(torch.bfloat16)
    packed = copy.deepcopy(plain)
    assert quant.pack_dense_weights(packed) == 9  # 4 projections x 2 layers and the lm_head
    assert quant.weight_bytes(packed) == quant.weight_bytes(plain)
    quantize_weights(plain, "int8")
    quantize_weights(packed, "int8")
    for a, b in zip(plain.modules(), packed.modules()):
        assert type(a) is type(b)
        if isinstance(a, QuantLinear):
            assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
