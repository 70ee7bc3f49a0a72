"""Decode attention scores computed as K q^T (``sfcl.model.llama``) equal q K^T, over dtypes,
INT8 KV and non-contiguous rows."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.bfloat16, "auto"), (torch.float32, "auto"),
                                             (torch.bfloat16, "int8")])
@pytest.mark.parametrize("contiguous_rows", [True, False])
def test_decode_scores_k_qT_equal_q_kT(lm, dtype, kv_dtype, contiguous_rows, monkeypatch):
    """decode_attn's scores as (K q^T)^T give the old q K^T figures: B = 3 rows attending to
    different lengths, rows as a slot range (views) or an index (slots 3, 0, 2; slot_range None),
    bf16/fp32 and the INT8 KV cache. The 16-bit matmul path even for this small step (its float32
    path for small steps: tests/test_model.py::test_small_decode_attention_in_float32_matches_the_16_bit_path)."""
    import sfcl.model.llama as llama
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import Attention, AttnBatch

    monkeypatch.setattr(llama, "SMALL_ATTN_FP32_POSITIONS", 0)

    a = lm.args
    attn = Attention(a)
    nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
    gen = torch.Generator().manual_seed(0)
    kv = KVCache(a, 4, 64, dtype, kv_dtype=kv_dtype)
    kv.ensure_initialized(4, 64)
    S, lens = 37, torch.tensor([37, 12, 25])
    slots = torch.tensor([0, 1, 2]) if contiguous_rows else torch.tensor([3, 0, 2])
    for pos in range(S - 1):  # history, one position at a time for every row
        kv.write_decode(0, torch.arange(4), torch.full((4,), pos), torch.randn(4, nkv, hd, generator=gen).to(dtype),
                        torch.randn(4, nkv, hd, generator=gen).to(dtype))
    q = torch.randn(3, nh, hd, generator=gen).to(dtype)
    k, v = (torch.randn(3, nkv, hd, generator=gen).to(dtype) for _ in range(2))
    mask = (torch.arange(S)[None, :] < lens[:, None]).view(3, 1, 1, S)
    batch = AttnBatch(is_prefill=False, slots=slots, positions=lens - 1, kv_len=S, mask=mask,
                      slot_range=(0, 3) if contiguous_rows else None)
    o, p = attn.decode_attn(q, k, v, batch, kv, 0, True)
    kk, vv = kv.read(0, slots, S)  # the old formula on the same cache
    g = nh // nkv
    s_ref = torch.matmul(q.reshape(3, nkv, g, hd), kk.transpose(-1, -2)) * attn.scale
    p_ref = s_ref.float().masked_fill(~mask.view(3, 1, 1, S), float("-inf")).softmax(-1)
    o_ref = torch.matmul(p_ref.to(vv.dtype), vv).view(3, nh * hd)
    torch.testing.assert_close(p, p_ref.view(3, nh, 1, S))
    torch.testing.assert_close(o, o_ref)
    assert (p.view(3, nh, S)[1, :, 12:] == 0).all() and (p.view(3, nh, S)[1, :, :12] > 0).all()
