"""sfcl.model.decode_stack (``torch.ops.sfcl.decode_layers``, ``csrc/decode_layers.cpp``): a
decode-only step's layers in one C++ call, against ``LlamaModel.forward_step``'s Python forward."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from sfcl.model import decode_kernel, decode_stack, quant
from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import AttnBatch, LlamaArgs, LlamaModel, StepBatch
from sfcl.model.quant import QuantLinear, quantize_weights

PROMPTS = ["The term of this Agreement shall be three (3) years from the Effective Date.",
           "Confidential Information means any information disclosed by either party",
           "1. Definitions. In this Agreement:", "The Receiving Party shall not disclose"]


@pytest.fixture(scope="module")
def kernel():
    if not decode_kernel.load():
        pytest.skip(f"the kernels could not be built here: {decode_kernel.why_unavailable()}")
    return decode_kernel


def _prefilled(model, args, dtype, prompts: list[list[int]], tap: int) -> KVCache:
    """A KV cache whose rows [0, B) hold the prompts, computed by the Python forward."""
    kv = KVCache(args, len(prompts) + 1, 128, dtype)
    kv.ensure_initialized(len(prompts), 128)
    for slot, ids in enumerate(prompts):
        T = len(ids)
        model(torch.tensor([ids]), AttnBatch(is_prefill=True, slots=torch.tensor([slot]), positions=torch.arange(T),
                                             kv_len=T), kv, tap)
    return kv


def _decode_step(prompts: list[list[int]]) -> StepBatch:
    """One decode row per prompt, each at the position after its prompt."""
    B = len(prompts)
    pos = torch.tensor([len(p) for p in prompts])
    S = int(pos.max()) + 1
    mask = (torch.arange(S)[None, :] <= pos[:, None]).view(B, 1, 1, S)
    return StepBatch(positions=pos.clone(), chunks=[], sample_index=torch.arange(B),
                     decode=AttnBatch(is_prefill=False, slots=torch.arange(B), positions=pos, kv_len=S, mask=mask,
                                      slot_range=(0, B)))


def _both_ways(model, args, dtype, prompts, next_ids, tap):
    """forward_step of one decode step with the layers in Python and in decode_layers, each on its
    own prefilled cache: {fused: (StepOut, kv)}."""
    out = {}
    for fused in (False, True):
        kv = _prefilled(model, args, dtype, prompts, tap)  # the Python forward both times: the same cache
        kv.fused_decode, kv.fused_layers = True, fused
        so = model.forward_step(torch.tensor([next_ids]), _decode_step(prompts), kv, tap)
        out[fused] = (so, kv)
    return out


@pytest.mark.parametrize("weights, B", [
    (w, b) for w in ["none", "int4/torch", "int4/sfcl", "int8/bf16", "int8/q8"] for b in [1, 3, 8]  # 8 > max_rows: dense
] + [("int4/sfcl@32", 12)])  # the AVX2 default's cut: 12 rows on SFCL's int4 kernel (more rows than its 8 registers)
def test_decode_layers_match_the_python_forward(kernel, lm, lm_fp32, weights, B, monkeypatch):
    """Same logits, tap hidden state, snapshot-layer weights and K/V writes as the Python forward,
    on the bundled model over real prompts: bit for bit in float32 (also where the packed kernels
    round activations to bf16), to rounding in the CPU's dtype where that is bf16. int4 with either
    int4 GEMV (``quant.int4_kernel``: torch's, or SFCL's int4 x int8), int8 with either int8 GEMV
    (``quant.int8_kernel``: bf16 activations, or SFCL's int8 x int8); ``@N``: max_rows N."""
    weights, _, cut = weights.partition("@")
    mode, _, gemv = weights.partition("/")
    if gemv:
        monkeypatch.setenv("SFCL_INT4_KERNEL" if mode == "int4" else "SFCL_INT8_KERNEL", gemv)
    # @N and int8/q8: the float32 model of AVX2 CPUs, where they are the defaults (on a bf16 model int8
    # activations turn a last-bit difference of the 16-bit path into a different code now and then)
    models = [lm_fp32] if cut or gemv == "q8" else {id(lm): lm, id(lm_fp32): lm_fp32}.values()
    for m in models:
        model = copy.deepcopy(m.model)
        quantize_weights(model, mode, int(cut) if cut else None)
        if cut:
            assert decode_stack.layer_args(model, B).kinds[:4] == [decode_stack.KIND_INT4_Q8] * 4
        if gemv:
            assert all(q.kernel == gemv for q in model.modules() if isinstance(q, QuantLinear) and q.mode == mode)
        if gemv == "q8" and B <= quant.DEFAULT_MAX_ROWS["int8"]:
            assert decode_stack.layer_args(model, B).kinds[:4] == [decode_stack.KIND_INT8_Q8] * 4
        dtype = next(model.parameters()).dtype
        prompts = [m.tokenizer(PROMPTS[i % 4], add_special_tokens=False)["input_ids"][: 6 + 3 * i] for i in range(B)]
        nxt = [p[-1] for p in prompts]
        tap = 22
        r = _both_ways(model, m.args, dtype, prompts, nxt, tap)
        (s0, kv0), (s1, kv1) = r[False], r[True]
        assert s1.logits.shape == s0.logits.shape == (B, m.args.vocab_size) and s1.logits.dtype == torch.float32
        assert s1.tap_hidden.shape == (B, m.args.hidden_size) and s1.tap_hidden.dtype == dtype
        assert len(s1.tap_probs) == 1 and s1.tap_probs[0].shape == s0.tap_probs[0].shape
        if dtype == torch.float32:  # RMSNorm and SiLU from torch's own operators: the same numbers
            assert torch.equal(s1.logits, s0.logits) and torch.equal(s1.tap_hidden, s0.tap_hidden)
            assert torch.equal(s1.tap_probs[0], s0.tap_probs[0])
            assert all(torch.equal(a, b) for a, b in zip(kv1.k + kv1.v, kv0.k + kv0.v))
            continue
        # 16-bit: the sums of RMSNorm and the exp of SiLU round differently from torch's operators (the
        # other element-wise steps round as they do), and a last-bit difference can flip a bf16 rounding
        # that the layers carry forward.
        # A flipped rounding moves a few logits by a fraction of their spread (seen: up to 7% with the
        # kernels built for AVX2, whose loops sum in another order); a wrong step moves all of them.
        d = (s1.logits - s0.logits).abs()
        diff, spread = float(d.max()), float(s0.logits.std())
        assert diff <= 0.15 * spread and float(d.mean()) <= 0.02 * spread, (diff, float(d.mean()), spread)
        top2 = s0.logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * diff  # rows whose greedy token no rounding could change
        assert torch.equal(s1.logits.argmax(-1)[clear], s0.logits.argmax(-1)[clear])
        torch.testing.assert_close(s1.tap_probs[0], s0.tap_probs[0], atol=0.02, rtol=0.05)
        torch.testing.assert_close(s1.tap_hidden.float(), s0.tap_hidden.float(), atol=0.1 * float(s0.tap_hidden.float().std()), rtol=0.05)
        for layer in (0, 15, m.args.n_layers - 1):  # the new tokens' K/V were written at their positions
            for c0, c1 in ((kv0.k[layer], kv1.k[layer]), (kv0.v[layer], kv1.v[layer])):
                torch.testing.assert_close(c1[:B, :, :40].float(), c0[:B, :, :40].float(), atol=0.1, rtol=0.05)
            assert torch.equal(kv1.k[layer][:B, :, 0], kv0.k[layer][:B, :, 0])  # prompt positions untouched


def _tiny(attention_bias: bool, qk_norm: bool = False, seed: int = 0) -> LlamaModel:
    a = LlamaArgs(model_type="qwen2" if attention_bias else "llama", vocab_size=200, hidden_size=128,
                  intermediate_size=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, rms_norm_eps=1e-6,
                  max_position_embeddings=512, tie_word_embeddings=False, attention_bias=attention_bias,
                  qk_norm=qk_norm)
    torch.manual_seed(seed)
    inv = 1.0 / (10000.0 ** (torch.arange(0, a.head_dim, 2).float() / a.head_dim))
    m = LlamaModel(a, inv)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(0, 0.05) if "norm" not in name else p.uniform_(0.8, 1.2)
    return m.eval()


@pytest.mark.parametrize("weights", ["none", "int4"])
def test_projection_biases_are_added(kernel, weights):
    """Qwen2-style q/k/v biases (large here, so that dropping one would show)."""
    m = _tiny(attention_bias=True)
    with torch.no_grad():
        for blk in m.layers:
            blk.self_attn.qkv_proj.bias.normal_(0, 1.0)
    quantize_weights(m, weights)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    r = _both_ways(m, m.a, torch.float32, prompts, [1, 2], 1)
    torch.testing.assert_close(r[True][0].logits, r[False][0].logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r[True][0].tap_hidden, r[False][0].tap_hidden, atol=1e-4, rtol=1e-4)


def test_models_and_weights_it_does_not_take_run_the_python_forward(kernel):
    """Per-head q/k norms (Qwen3) and FBGEMM fp16 projections: layer_args is None and forward_step
    computes the step the Python way, with the same results as with the fused layers off."""
    qwen3 = _tiny(attention_bias=False, qk_norm=True)
    assert decode_stack.layer_args(qwen3, 1) is None
    fp16 = _tiny(attention_bias=False)
    assert decode_stack.layer_args(fp16, 1) is not None
    quantize_weights(fp16, "fp16")  # bumps the weights version: the cached entry is not reused
    assert decode_stack.layer_args(fp16, 1) is None
    for m in (qwen3, fp16):
        r = _both_ways(m, m.a, torch.float32, [[3, 4, 5]], [6], 0)
        assert torch.equal(r[True][0].logits, r[False][0].logits)


def test_cached_arguments_follow_a_weight_swap(kernel):
    m = _tiny(attention_bias=False)
    before = decode_stack.layer_args(m, 1)
    assert before.kinds == [decode_stack.KIND_DENSE] * 8
    quantize_weights(m, "int4")
    after = decode_stack.layer_args(m, 1)
    sfcl_int4 = m.layers[0].mlp.down_proj.kernel == "sfcl"  # quant.int4_kernel: SFCL's GEMV but on AVX-512 with AMX
    assert after.kinds == [decode_stack.KIND_INT4_Q8 if sfcl_int4 else decode_stack.KIND_INT4] * 8
    assert decode_stack.layer_args(m, 7).kinds == [decode_stack.KIND_DENSE] * 8  # above max_rows: the dense copies
    assert decode_stack.layer_args(copy.deepcopy(m), 1) is not after  # a copy gets its own tensors


def test_a_weight_swap_frees_the_weights_the_cache_held(kernel):
    """A first ``sfcl serve`` decodes with the plain weights (the default library's calibration), then
    quantizes and packs them: the cached arguments must not keep the replaced tensors alive (they did,
    +~330 MiB RSS for the life of that server). Checked with weak references to the replaced storages:
    they die at the swap itself, before the cache is read again."""
    m = _tiny(attention_bias=False)
    assert decode_stack.layer_args(m, 1).kinds == [decode_stack.KIND_DENSE] * 8
    assert decode_stack.layer_args(m, 4) is not None  # a second cached row count
    old = [weakref.ref(blk.mlp.down_proj.weight) for blk in m.layers]
    quantize_weights(m, "int8")
    gc.collect()
    assert [r() for r in old] == [None, None]
    if quant.dense_packing_available():  # the packing drops the plain bf16 dense copies the cache held
        mb = _tiny(attention_bias=False).to(torch.bfloat16)
        quantize_weights(mb, "int4")
        assert decode_stack.layer_args(mb, 8).kinds == [decode_stack.KIND_DENSE] * 8  # 8 rows: the dense copies
        dense = [weakref.ref(blk.mlp.down_proj.dense_weight) for blk in mb.layers]
        assert quant.pack_dense_weights(mb) > 0
        gc.collect()
        assert [r() for r in dense] == [None, None]


@pytest.mark.skipif(not quant.dense_packing_available(), reason="this torch build does not pack bf16 weights for oneDNN")
@pytest.mark.parametrize("weights,dtype", [("int4", torch.bfloat16), ("none", torch.bfloat16), ("none", torch.float32)])
@pytest.mark.parametrize("B", [1, 8])  # 8 > max_rows: int4's dense weights
def test_dense_weights_packed_for_onednn_change_no_step(kernel, B, weights, dtype):
    """``quant.pack_dense_weights``: a bf16 (and, under ``none``, a float32) decode step gives the logits,
    tap state and K/V of the plain dense weights, in the fused layers (``decode_layers``' boxed call of ``mkldnn::_linear_pointwise``)
    and in the Python forward: to the dtype's rounding (oneDNN may pick another kernel for the packed
    weight; in bf16 on the Intel Xeon with AMX of 2026-12-07 they agreed bit for bit). Under ``none`` the
    plain ``nn.Linear`` projections and lm_head become ``PackedLinear``s, which ``decode_layers`` takes
    as dense weights."""
    if not quant.dense_packing_available(dtype):
        pytest.skip(f"this torch build does not pack {dtype} weights for oneDNN")
    plain = _tiny(attention_bias=True).to(dtype)
    quantize_weights(plain, weights)
    packed = copy.deepcopy(plain)
    assert decode_stack.layer_args(packed, B) is not None  # cached before the packing: must not be reused
    assert quant.pack_dense_weights(packed) == 9  # 4 projections x 2 layers and the lm_head (int8 under int4)
    if weights == "none":
        assert all(isinstance(blk.mlp.down_proj, quant.PackedLinear) for blk in packed.layers)
        assert isinstance(packed.lm_head, quant.PackedLinear)
        la = decode_stack.layer_args(packed, B)
        assert la.kinds == [decode_stack.KIND_DENSE] * 8 and all(w.is_mkldnn for w in la.weights)
        assert quant.pack_dense_weights(packed) == 0  # nothing left to pack
    else:
        assert all(q.dense_weight.is_mkldnn for q in packed.modules() if isinstance(q, QuantLinear) and q.mode == "int4")
        kinds = decode_stack.layer_args(packed, B).kinds
        assert kinds == ([decode_stack.KIND_DENSE] * 8 if B > quant.DEFAULT_MAX_ROWS["int4"] else kinds)
    prompts = [[5 + i, 6, 7, 8 + i, 9][: 3 + i % 3] for i in range(B)]
    nxt = [1 + i for i in range(B)]
    ref, got = _both_ways(plain, plain.a, dtype, prompts, nxt, 1), _both_ways(packed, packed.a, dtype, prompts, nxt, 1)
    tol = {} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}  # float32: MKL and oneDNN sum apart
    for fused in (False, True):
        (s0, kv0), (s1, kv1) = ref[fused], got[fused]
        spread = float(s0.logits.std())
        torch.testing.assert_close(s1.logits, s0.logits, rtol=0.02, atol=0.02 * spread)
        torch.testing.assert_close(s1.tap_hidden, s0.tap_hidden, **tol)
        for a, b in zip(kv1.k + kv1.v, kv0.k + kv0.v):
            torch.testing.assert_close(a, b, **tol)


def test_steps_with_prompt_chunks_or_groups_do_not_apply():
    from sfcl.model.llama import ChunkSpec, RowGroup

    kv = KVCache(_tiny(False).a, 2, 32, torch.float32)
    kv.fused_layers = True
    step = _decode_step([[1, 2], [3]])
    assert decode_stack.applies(step, kv)
    step.chunks = [ChunkSpec(slot=1, start=0, offset=2, length=3)]
    assert not decode_stack.applies(step, kv)
    step = _decode_step([[1, 2], [3]])
    step.decode.groups = [RowGroup(rows=torch.arange(2), span=slice(0, 2), source=0, shared=0)]
    assert not decode_stack.applies(step, kv)
    kv.fused_layers = False
    assert not decode_stack.applies(_decode_step([[1, 2]]), kv)


def test_decode_layers_rejects_inconsistent_arguments(kernel):
    m = _tiny(attention_bias=False)
    a = m.a
    kv = KVCache(a, 2, 32, torch.float32)
    kv.ensure_initialized(2, 32)
    la = decode_stack.layer_args(m, 1)
    h = torch.randn(1, a.hidden_size)
    cos, sin = torch.ones(1, a.head_dim), torch.zeros(1, a.head_dim)
    pos = torch.tensor([3])

    def call(**kw):
        args = dict(h=h, cos=cos, sin=sin, norms=la.norms, weights=la.weights, scales=la.scales, biases=la.biases,
                    kinds=la.kinds, k_cache=kv.k, v_cache=kv.v, pos=pos, row0=0, S=4, scale=0.125,
                    eps=a.rms_norm_eps, n_heads=a.n_heads, tap_layer=1, want_probs=True)
        args.update(kw)
        return torch.ops.sfcl.decode_layers(*args.values())

    h_out, tap_h, tap_p = call()
    assert h_out.shape == (1, a.hidden_size) and tap_p.shape == (1, a.n_heads, 1, 4)
    with pytest.raises(RuntimeError, match="4 per layer"):
        call(weights=la.weights[:-1])
    with pytest.raises(RuntimeError, match="kinds: 0 dense"):
        call(kinds=[7] * len(la.kinds))
    with pytest.raises(RuntimeError, match="cos, sin"):
        call(cos=torch.ones(2, a.head_dim))
    with pytest.raises(RuntimeError, match="dtype"):
        call(h=h.double(), cos=cos.double(), sin=sin.double())
    with pytest.raises(RuntimeError, match="positions must lie"):
        call(pos=torch.tensor([9]))
    with pytest.raises(RuntimeError, match="no rows"):
        call(h=h[:0], cos=cos[:0], sin=sin[:0], pos=pos[:0])
    with pytest.raises(RuntimeError, match="k_cache, v_cache"):
        call(k_cache=[c[0] for c in kv.k])  # 3-D
    with pytest.raises(RuntimeError, match="tap_layer"):
        call(tap_layer=-1)
    with pytest.raises(RuntimeError, match="eps"):
        call(eps=float("nan"))
    # projection weights of the wrong width: an error naming the layer, never a read past the output
    # (found by a break-it pass: the residual adds read B x hidden values of whatever came back)
    narrow_o = list(la.weights)
    narrow_o[1] = torch.randn(a.hidden_size // 2, a.n_heads * a.head_dim)
    with pytest.raises(RuntimeError, match="layer 0: the output projection"):
        call(weights=narrow_o)
    wide_down = list(la.weights)
    wide_down[7] = torch.randn(4 * a.hidden_size, a.intermediate_size)
    with pytest.raises(RuntimeError, match="layer 1: the down projection"):
        call(weights=wide_down)
    odd_gu = list(la.weights)
    odd_gu[2] = torch.randn(2 * a.intermediate_size + 1, a.hidden_size)
    with pytest.raises(RuntimeError, match="gate/up"):
        call(weights=odd_gu)
