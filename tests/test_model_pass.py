"""sfcl.anchors.model_pass on the real model and a real NDA: the builder's pass equals the model's
own all-positions forward, batching windows changes nothing, and the FLOP model counts the
weights."""

import pytest
import torch
from conftest import contractnli_docs

from sfcl.anchors.model_pass import _equal_runs, add_linear_, flops_per_token, logit_stats, run_windows
from sfcl.model import decode_kernel
from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import AttnBatch
from sfcl.snapshot.triggers import attention_dispersion

pytestmark = pytest.mark.slow
LAYER, K = 22, 8


def reference(lm, w):
    """What the builder computed before: LlamaModel.forward(all_positions=True) and a full
    float32 log-softmax."""
    T = len(w)
    kv = KVCache(lm.args, 1, T, next(lm.model.parameters()).dtype, "cpu")
    fo = lm.model(torch.tensor([w]), AttnBatch(True, torch.tensor([0]), torch.arange(T), T), kv, LAYER,
                  all_positions=True)
    logp = torch.log_softmax(fo.logits[0, :-1].float(), -1)  # (T-1, V)
    sur = -logp.gather(1, torch.tensor(w[1:])[:, None])[:, 0]
    top_p, top_i = logp.exp().topk(K, dim=-1)
    disp = attention_dispersion(fo.tap_probs[0].transpose(0, 1), torch.arange(1, T + 1))
    return fo.tap_hidden[0, :-1].float(), top_i, top_p, sur, disp


@pytest.fixture(scope="module")
def windows(lm):
    ids = lm.tokenizer(contractnli_docs(1)[0].text, add_special_tokens=False)["input_ids"]
    return [ids[:300], ids[300:420], ids[420:422]]  # a 2-token window: one position with a next token


def test_pass_equals_the_models_all_positions_forward(lm_fp32, windows):
    lm = lm_fp32  # float32: bf16 rounding depends on the row count on some CPUs (test_batching_windows_changes_nothing)
    outs = run_windows(lm.model, windows, LAYER, K)
    for w, o in zip(windows, outs):
        h, ti, tp, sur, disp = reference(lm, w)
        T = len(w)
        assert o.hidden.shape == (T - 1, lm.args.hidden_size) and o.dispersion.shape == (T,)
        torch.testing.assert_close(o.hidden, h, atol=2e-3, rtol=2e-3)
        assert (o.top_ids == ti).float().mean() > 0.99  # near-ties may swap places
        torch.testing.assert_close(o.top_probs, tp, atol=1e-3, rtol=0)
        torch.testing.assert_close(o.surprisal, sur, atol=2e-3, rtol=0)
        torch.testing.assert_close(o.dispersion, disp, atol=1e-4, rtol=0)


def test_batching_windows_changes_nothing(lm_fp32, windows):
    """In float32: on an Intel Xeon with AMX (2026-12-05) bf16 GEMMs round differently for
    different row counts, and a window batched with others moved bf16 hidden states by up to 3.0
    (one bf16 step at their magnitude) at 78% of positions."""
    _assert_each_as_alone(lm_fp32, windows)


def _assert_each_as_alone(lm, wins):
    """Each window of one ``run_windows`` call over ``wins`` equals its own call."""
    together = run_windows(lm.model, wins, LAYER, K)
    for w, t in zip(wins, together):
        [alone] = run_windows(lm.model, [w], LAYER, K)
        torch.testing.assert_close(t.hidden, alone.hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(t.surprisal, alone.surprisal, atol=1e-4, rtol=0)
        torch.testing.assert_close(t.top_probs, alone.top_probs, atol=1e-5, rtol=0)
        torch.testing.assert_close(t.dispersion, alone.dispersion, atol=1e-5, rtol=0)


def test_equal_length_windows_share_one_attention_call(lm_fp32, windows):
    """Windows of one length run through causal SDPA as one batch (``_equal_runs``); each comes out
    as it does alone, and a shorter window after them keeps its own call."""
    ids = windows[0]
    wins = [ids[:100], ids[100:200], ids[200:300], ids[:57]]
    assert _equal_runs([len(w) for w in wins]) == [(0, 3, 100), (300, 1, 57)]
    assert _equal_runs([5, 5, 7, 5]) == [(0, 2, 5), (10, 1, 7), (17, 1, 5)]
    _assert_each_as_alone(lm_fp32, wins)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_linear_adds_the_layers_output_in_place(dtype):
    torch.manual_seed(0)
    h0, x = torch.randn(37, 24, dtype=dtype), torch.randn(37, 40, dtype=dtype)
    lin = torch.nn.Linear(40, 24, bias=False).to(dtype)
    h = h0.clone()
    assert add_linear_(h, x, lin) is h
    tol = 1e-5 if dtype == torch.float32 else 0.05  # bf16: one rounding of the sum instead of two
    torch.testing.assert_close(h, h0 + lin(x), atol=tol, rtol=tol)
    biased = torch.nn.Linear(40, 24, bias=True).to(dtype)  # not a bias-free Linear: its output is added
    h = h0.clone()
    add_linear_(h, x, biased)
    torch.testing.assert_close(h, h0 + biased(x), atol=tol, rtol=tol)


def test_bad_windows(lm):
    with pytest.raises(ValueError):
        run_windows(lm.model, [[1]], LAYER, K)
    with pytest.raises(ValueError):
        run_windows(lm.model, [[1, 2]], LAYER, 0)


def test_flops_per_token_counts_every_matmul_weight(lm):
    """2 FLOP per weight of every linear layer (the embedding is a lookup; the tied LM head is a
    matmul), plus attention growing with the attended length."""
    linear = sum(m.weight.numel() for m in lm.model.modules() if isinstance(m, torch.nn.Linear))
    assert flops_per_token(lm.args, 0) == 2 * linear
    a = lm.args
    assert flops_per_token(lm.args, 512) - flops_per_token(lm.args, 0) == 4 * a.n_layers * a.n_heads * a.head_dim * 512


def _torch_stats(logits, nxt, k):
    """The same statistics from torch's operators in float64."""
    x = logits.double()
    lse = torch.logsumexp(x, -1)
    tv, ti = x.topk(k, dim=-1)
    return (tv - lse[:, None]).exp(), ti, lse - x.gather(1, nxt[:, None])[:, 0], lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 8, 37])
def test_logit_stats_kernel_computes_what_torch_does(dtype, k):
    """torch.ops.sfcl.logit_stats over rows of vocabulary size (and a width that is not a multiple
    of 8): logsumexp and surprisal to float32 rounding, top-k probabilities likewise, and the top
    ids a true top-k (their logits are the k largest, in order; ties keep the lower id first)."""
    if not decode_kernel.load():
        pytest.skip(f"SFCL's native kernels could not be built here: {decode_kernel.why_unavailable()}")
    g = torch.Generator().manual_seed(k)
    for V in (49152, 1003):
        x = (torch.randn(9, V, generator=g) * 4).to(dtype)
        x[3, 100:110] = x[3].max() + 1  # a tie at the top: ids 100..109, in order
        nxt = torch.randint(0, V, (9,), generator=g)
        tp, ti, sur, lse = torch.ops.sfcl.logit_stats(x, nxt, k)
        rp, ri, rs, rl = _torch_stats(x, nxt, k)
        assert tp.dtype == sur.dtype == lse.dtype == torch.float32 and ti.dtype == torch.int64 and ti.shape == (9, k)
        torch.testing.assert_close(lse.double(), rl, atol=0, rtol=2e-6)
        torch.testing.assert_close(sur.double(), rs, atol=2e-5, rtol=2e-6)
        torch.testing.assert_close(tp.double(), rp, atol=1e-7, rtol=2e-5)
        vals = x.double().gather(1, ti)
        assert torch.equal(vals, x.double().topk(k, dim=-1).values)  # the k largest, largest first
        assert ti[3, : min(k, 10)].tolist() == list(range(100, 100 + min(k, 10)))


def test_logit_stats_edge_rows_and_bad_arguments():
    """A row holding NaN or +inf gives NaN statistics (the other rows are untouched); bad shapes,
    dtypes, k and next ids raise RuntimeError naming the operator."""
    if not decode_kernel.load():
        pytest.skip(f"SFCL's native kernels could not be built here: {decode_kernel.why_unavailable()}")
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    x[2, 9] = float("inf")
    tp, ti, sur, lse = torch.ops.sfcl.logit_stats(x, torch.zeros(3, dtype=torch.long), 4)
    assert torch.isfinite(lse[0]) and torch.isnan(lse[1:]).all() and torch.isnan(sur[1:]).all()
    assert torch.isnan(tp[1:]).all() and torch.isfinite(tp[0]).all()
    nxt = torch.zeros(3, dtype=torch.long)
    for bad in ((x.double(), nxt, 4), (x.t(), nxt, 4), (x, nxt[:2], 4), (x, nxt.int(), 4), (x, nxt, 0),
                (x, nxt, 65), (x, torch.tensor([0, 64, 1]), 4), (x, torch.tensor([0, -1, 1]), 4), (x[0], nxt, 4)):
        with pytest.raises(RuntimeError, match="logit_stats"):
            torch.ops.sfcl.logit_stats(*bad)


def test_logit_stats_without_the_kernels_is_torchs(monkeypatch):
    """``model_pass.logit_stats`` without SFCL's kernels (or off CPU) takes torch's operators, and
    both paths give the same statistics."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 4000, generator=g).to(torch.bfloat16)
    nxt = torch.randint(0, 4000, (5,), generator=g)
    monkeypatch.setattr(decode_kernel, "loaded", lambda: False)
    p0, i0, s0 = logit_stats(x, nxt, 6)
    rp, ri, rs, _ = _torch_stats(x, nxt, 6)
    torch.testing.assert_close(s0.double(), rs, atol=2e-5, rtol=2e-6)
    torch.testing.assert_close(p0.double(), rp, atol=1e-7, rtol=2e-5)
    assert torch.equal(x.double().gather(1, i0), x.double().topk(6, dim=-1).values)
    monkeypatch.undo()
    if decode_kernel.load():
        p1, i1, s1 = logit_stats(x, nxt, 6)
        torch.testing.assert_close(s1, s0, atol=2e-5, rtol=2e-6)
        torch.testing.assert_close(p1, p0, atol=1e-7, rtol=2e-5)
        assert torch.equal(x.gather(1, i1), x.gather(1, i0))
