"""sfcl.model.llama's rotary embeddings: float32 frequencies and tables in every dtype, on the
weights' device, and values that do not depend on torch's float32 cos (MKL's ``vsCos``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sfcl.model.llama import LlamaArgs, LlamaModel, rope_tables

TINY = LlamaArgs(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128, n_layers=1, n_heads=4,
                 n_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=2048,
                 tie_word_embeddings=False, attention_bias=False, qk_norm=False)
INV = 1.0 / (10000.0 ** (torch.arange(0, TINY.head_dim, 2).float() / TINY.head_dim))  # (8,) float32


def test_rope_tables_are_float64_cos_and_sin_of_float32_angles():
    cos, sin = rope_tables(INV, 1.25, 2048)  # (2048, 8)
    angles = (torch.arange(2048, dtype=torch.float32)[:, None] * INV).double().numpy()  # float32 products
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (2048, 8)
    assert torch.equal(cos, torch.from_numpy(np.cos(angles)).float() * 1.25)
    assert torch.equal(sin, torch.from_numpy(np.sin(angles)).float() * 1.25)
    assert abs(cos[1, 0].item() - 1.25 * 0.5403023058681398) < 1e-6  # cos(1), not MKL's 0.5403335


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_model_keeps_float32_frequencies_and_the_float32_model_rotation(dtype):
    m32 = LlamaModel(TINY, INV)
    m16 = LlamaModel(TINY, INV).to(dtype)
    assert m16.embed_tokens.weight.dtype == dtype
    assert m16.inv_freq.dtype == m16.rope_cos.dtype == m16.rope_sin.dtype == torch.float32
    assert torch.equal(m16.inv_freq, INV)  # bf16 would make 0.5623 into 0.5625
    pos = torch.tensor([0, 1, 1000, 2047])
    c16, s16 = m16.rope(pos, dtype)  # (4, 1, 16)
    c32, s32 = m32.rope(pos, torch.float32)
    assert c16.dtype == dtype and c16.shape == (4, 1, 16)
    assert torch.equal(c16, c32.to(dtype)) and torch.equal(s16, s32.to(dtype))  # same angles, one rounding
    assert torch.equal(m16.float().rope_cos, m32.rope_cos)  # and back: still the float32 tables


def test_rope_layout_and_range():
    m = LlamaModel(TINY, INV)
    cos, sin = m.rope(torch.tensor([[3, 5]]), torch.float32)  # (1, 2, 1, 16)
    assert cos.shape == sin.shape == (1, 2, 1, 16)
    assert torch.equal(cos[0, 1, 0, :8], cos[0, 1, 0, 8:]) and torch.equal(sin[0, 1, 0, :8], -sin[0, 1, 0, 8:])
    assert torch.allclose(cos[0, 0, 0, :8].double(), torch.cos(3 * INV.double()), atol=1e-6)
    with pytest.raises(IndexError):
        m.rope(torch.tensor([TINY.max_position_embeddings]), torch.float32)  # past the model's context


def test_model_built_under_16_bit_defaults_keeps_float32_tables():
    """As scripts/gpu_bench.py builds its model: default dtype bf16 (and the target device)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        m = LlamaModel(TINY, INV)
    finally:
        torch.set_default_dtype(old)
    assert m.embed_tokens.weight.dtype == torch.bfloat16
    assert m.rope_cos.dtype == m.rope_sin.dtype == m.inv_freq.dtype == torch.float32
    assert torch.equal(m.rope_cos, LlamaModel(TINY, INV).rope_cos)


def test_fit_rope_cuts_tables_past_the_slack_grows_them_and_never_cuts_under_an_earlier_need():
    """The engine's max_model_len below the model's context: tables longer by more than the slack
    are cut to it (same rows); a larger need grows them; a later smaller need (a second engine on
    the same model) does not cut under the earlier one; positions past the context are refused,
    naming the caller's what."""
    m = LlamaModel(TINY, INV)
    full = m.rope_cos.clone()
    m.fit_rope(2000)  # 48 rows x 8 x 4 bytes x 2 tables over: within the default slack
    assert m.rope_cos.shape == (2048, 8)
    m = LlamaModel(TINY, INV)
    m.fit_rope(256, slack_bytes=1024)
    assert m.rope_cos.shape == m.rope_sin.shape == (256, 8) and torch.equal(m.rope_cos, full[:256])
    m.fit_rope(1024, slack_bytes=1024)  # longer than the tables: rebuilt
    assert m.rope_cos.shape == (1024, 8) and torch.equal(m.rope_cos, full[:1024])
    m.fit_rope(300, slack_bytes=1024)  # another engine, shorter: the first still needs 1,024
    assert m.rope_cos.shape == (1024, 8)
    m.rope(torch.tensor([1023]), torch.float32)
    with pytest.raises(ValueError, match="^--max-model-len: 2049 positions, more than the model's context of 2048 tokens$"):
        m.fit_rope(2049, "--max-model-len")


def test_the_model_keeps_its_own_copy_of_the_frequencies():
    """The loader's inv_freq is a view into the cached weights file's memory map (safetensors'
    load_file); a model that held it kept the whole map resident (+513 MiB RSS for SmolLM2)."""
    inv = INV.clone()
    m = LlamaModel(TINY, inv)
    assert torch.equal(m.inv_freq, inv) and m.inv_freq.untyped_storage().data_ptr() != inv.untyped_storage().data_ptr()
    m.set_rope(inv, 64)
    assert m.inv_freq.untyped_storage().data_ptr() != inv.untyped_storage().data_ptr()
