"""sfcl.anchors.model_pass on the real model and a real NDA: the builder's pass equals the model's
own all-positions forward, batching windows changes nothing, and the FLOP model counts the
weights."""

import pytest
import torch
from conftest import contractnli_docs

from sfcl.anchors.model_pass import flops_per_token, run_windows
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
    lm = lm_fp32
    together = run_windows(lm.model, windows, LAYER, K)
    for w, t in zip(windows, together):
        [alone] = run_windows(lm.model, [w], LAYER, K)
        torch.testing.assert_close(t.hidden, alone.hidden, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(t.surprisal, alone.surprisal, atol=1e-4, rtol=0)
        torch.testing.assert_close(t.dispersion, alone.dispersion, atol=1e-5, rtol=0)


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
