"""KV cache storage: INT8 block-wise quantization, prefix-cache block copies, row moves, memory
that follows the positions written and released."""

import dataclasses
import os

import pytest
import torch

from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import LlamaArgs

ARGS = LlamaArgs(model_type="llama", vocab_size=32, hidden_size=32, intermediate_size=64, n_layers=2, n_heads=4,
                 n_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position_embeddings=64,
                 tie_word_embeddings=True, attention_bias=False, qk_norm=False)


def kv_pair(T, seed=0, outlier=True):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, T, 8, generator=g)
    if outlier:
        k[:, :, 3] *= 20  # a persistent outlier key channel, as KIVI observes
    return k, torch.randn(2, T, 8, generator=g)


def test_int8_prefill_then_decode_round_trips_within_quantization_error():
    c = KVCache(ARGS, 2, 64, torch.float32, kv_dtype="int8", block_size=4)
    k, v = kv_pair(11)
    c.write_prefill(0, 1, 0, k[:, :6], v[:, :6])  # ends mid-block: the block's keys stay in the residual
    c.write_prefill(0, 1, 6, k[:, 6:9], v[:, 6:9])  # continues inside that block
    for t in (9, 10):  # decode writes, one position each
        c.write_decode(0, torch.tensor([1]), torch.tensor([t]), k[None, :, t], v[None, :, t])
    kk, vv = c.read(0, slice(1, 2), 11)
    assert kk.shape == (1, 2, 11, 8)
    # per-channel key scales: every channel's error is bounded by its own block absmax / 254
    for b in range(3):
        blk = k[:, b * 4:min(11, b * 4 + 4)]
        bound = blk.abs().amax(dim=1, keepdim=True) / 254 * 1.01 + 1e-6
        assert ((kk[0, :, b * 4:b * 4 + blk.shape[1]] - blk).abs() <= bound).all()
    vbound = v.abs().amax(dim=-1, keepdim=True) / 254 * 1.01 + 1e-6
    assert ((vv[0] - v).abs() <= vbound).all()


def test_per_channel_keys_beat_per_token_keys_when_a_channel_is_an_outlier():
    c = KVCache(ARGS, 1, 16, torch.float32, kv_dtype="int8", block_size=8)
    k, v = kv_pair(8)
    c.write_prefill(0, 0, 0, k, v)
    kk, _ = c.read(0, slice(0, 1), 8)
    err_channel = (kk[0] - k).abs()[:, :, [0, 1, 2, 4, 5, 6, 7]].mean()
    per_token_scale = k.abs().amax(-1, keepdim=True) / 127
    err_token = (torch.round(k / per_token_scale) * per_token_scale - k).abs()[:, :, [0, 1, 2, 4, 5, 6, 7]].mean()
    assert err_channel < err_token / 4


def test_int8_memory_per_token_is_at_most_055x_of_bf16():
    import dataclasses

    smollm_heads = dataclasses.replace(ARGS, head_dim=64)  # SmolLM2 / Llama head size
    bf = KVCache(smollm_heads, 1, 16, torch.bfloat16)
    q = KVCache(smollm_heads, 1, 16, torch.bfloat16, kv_dtype="int8", block_size=16)
    assert q.bytes_per_token / bf.bytes_per_token == pytest.approx(138 / 256)
    # measured on the allocated tensors, not the formula: rows of 16 positions
    used = sum(t.numel() * t.element_size() for t in q.k + q.v + q.k_scale + q.v_scale) / (2 * 16)
    used_bf = sum(t.numel() * t.element_size() for t in bf.k + bf.v) / (2 * 16)
    assert used / used_bf <= 0.55
    assert q.k[0].element_size() == 1 and bf.k[0].element_size() == 2


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_pool_save_restore_and_moves_copy_exactly(kv_dtype):
    c = KVCache(ARGS, 3, 32, torch.float32, kv_dtype=kv_dtype, block_size=4, pool_blocks=5)
    k, v = kv_pair(12, seed=1)
    for layer in range(2):
        c.write_prefill(layer, 0, 0, k, v)
    c.save(0, 1, [4, 2])  # blocks 1, 2 (positions 4..12) -> pool blocks 4, 2
    c.restore(2, 1, [4, 2])
    c.move(0, 3, 12)  # into the scratch row
    for layer in range(2):
        a, av = c.read(layer, slice(0, 1), 12)
        b, bv = c.read(layer, slice(2, 3), 12)
        s, sv = c.read(layer, slice(3, 4), 12)
        assert torch.equal(a[:, :, 4:12], b[:, :, 4:12]) and torch.equal(av[:, :, 4:12], bv[:, :, 4:12])
        assert torch.equal(a, s) and torch.equal(av, sv)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("pool_ids", [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12],  # one run: one copy per tensor
                                      [12, 10, 8, 6, 4, 2, 0, 1, 3, 5]])  # 10 runs > MAX_COPY_RUNS: gathered
def test_pool_save_restore_in_runs_or_gathered_copy_every_block(kv_dtype, pool_ids):
    """``save`` / ``restore`` of 10 blocks through a run of consecutive pool ids and through ids in more
    runs than ``kv_cache.MAX_COPY_RUNS`` (one gather per tensor): the restored row holds the saved
    positions (and their INT8 scales) exactly, other pool blocks and positions are untouched."""
    from sfcl.model import kv_cache

    assert len(pool_ids) > kv_cache.MAX_COPY_RUNS
    c = KVCache(ARGS, 3, 64, torch.float32, kv_dtype=kv_dtype, block_size=4, pool_blocks=13)
    k, v = kv_pair(44, seed=2)
    for layer in range(2):
        c.write_prefill(layer, 0, 0, k, v)
    pool_before = [t.clone() for t in c.pool_k + c.pool_v]
    c.save(0, 1, pool_ids)  # blocks 1..10 (positions 4..44) -> the pool
    c.restore(2, 1, pool_ids)
    for layer in range(2):
        a, av = c.read(layer, slice(0, 1), 44)
        b, bv = c.read(layer, slice(2, 3), 44)
        assert torch.equal(a[:, :, 4:44], b[:, :, 4:44]) and torch.equal(av[:, :, 4:44], bv[:, :, 4:44])
        assert not b[:, :, :4].any() and not bv[:, :, :4].any()  # block 0 was not restored
    unused = sorted(set(range(13)) - set(pool_ids))
    for t, t0 in zip(c.pool_k + c.pool_v, pool_before):
        assert torch.equal(t[unused], t0[unused])
    assert c.hwm[2] == 44


def test_bad_arguments():
    with pytest.raises(ValueError, match="kv_dtype"):
        KVCache(ARGS, 1, 8, torch.float32, kv_dtype="fp4")
    with pytest.raises(ValueError):
        KVCache(ARGS, 0, 8, torch.float32)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_rows_are_zeroed_before_decode_reads_past_their_length(kv_dtype):
    """Masked attention weights are 0, but 0 * NaN = NaN: garbage past a row's length must go
    (torch.empty storage, as on CUDA)."""
    c = KVCache(ARGS, 2, 32, torch.float32, kv_dtype=kv_dtype, block_size=4, lazy_pages=False)
    for t in c.k + c.v:
        t.fill_(127 if t.dtype == torch.int8 else float("nan"))
    for t in getattr(c, "k_scale", []) + getattr(c, "v_scale", []):
        t.fill_(float("nan"))
    k, v = kv_pair(5)
    for layer in range(2):
        c.write_prefill(layer, 0, 0, k, v)
    c.ensure_initialized(2, 9)  # decode batch of rows 0, 1 attending to 9 positions
    for layer in range(2):
        kk, vv = c.read(layer, slice(0, 2), 9)
        assert torch.isfinite(kk).all() and torch.isfinite(vv).all()
        assert (kk[1] == 0).all() and (kk[0, :, 5:] == 0).all()
        assert torch.allclose(kk[0, :, :5], k, atol=k.abs().max().item() / 100)  # written values intact


def test_int8_decode_ignores_garbage_in_the_unfilled_part_of_the_residual_block():
    c = KVCache(ARGS, 1, 32, torch.bfloat16, kv_dtype="int8", block_size=4)
    k, v = kv_pair(5)
    k, v = k.bfloat16(), v.bfloat16()
    c.write_prefill(0, 0, 0, k, v)  # positions 0..4: block 1 holds position 4 in the residual
    c.k_res[0][0, :, 2:] = float("nan")  # slots of the block not written yet
    c.write_decode(0, torch.tensor([0]), torch.tensor([5]), k[None, :, 4], v[None, :, 4])
    kk, vv = c.read(0, slice(0, 1), 6)
    assert torch.isfinite(kk).all() and torch.isfinite(vv).all()


def _resident(tensors) -> int:
    """Resident bytes of the memory maps holding ``tensors`` (Linux /proc/self/smaps), including
    any other map the kernel merged with theirs into one VMA."""
    spans = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors]
    total, vma = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                vma = (a, b) if any(x < b and a < y for x, y in spans) else None
            elif vma is not None and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_resident_memory_follows_the_positions_written_and_released(kv_dtype):
    wide = dataclasses.replace(ARGS, head_dim=64, n_layers=4)
    c = KVCache(wide, 4, 4096, torch.float32, kv_dtype=kv_dtype, block_size=16, keep_positions=256)
    assert c.lazy_pages
    expected = 4 * 3072 * c.bytes_per_token  # 4 rows x 3,072 positions
    rows = c.k + c.v + getattr(c, "k_scale", []) + getattr(c, "v_scale", [])

    def resident() -> int:
        return _resident(rows)

    # Figures are differences from ``base``: the kernel merges adjacent anonymous maps with equal
    # flags into one VMA, so a KV cache still alive from an earlier test may share a VMA (and its
    # Rss line) with these rows. That writing 3,072 positions grows Rss by their size shows that
    # nothing of them was resident before.
    base = resident()
    kk, vv = c.read(0, slice(0, 4), 4096)  # never written: zeros, and reading them allocates nothing
    assert float(kk.abs().sum()) == 0 and float(vv.abs().sum()) == 0
    del kk, vv
    assert resident() - base < 0.01 * expected
    g = torch.Generator().manual_seed(0)
    for row in range(4):
        k, v = torch.randn(2, 2, 3072, 64, generator=g)
        for layer in range(4):
            c.write_prefill(layer, row, 0, k, v)
    grown = resident() - base
    assert 0.95 * expected < grown < 1.05 * expected, (grown, expected)
    before = c.read(1, slice(2, 3), 256)
    for row in range(4):
        c.release(row)
    kept = resident() - base
    assert kept < grown * (256 + 64) / 3072, (kept, grown)  # what stays: 256 positions of each row, + pages
    assert all(torch.equal(a, b) for a, b in zip(c.read(1, slice(2, 3), 256), before))  # kept positions intact
    k, v = c.read(1, slice(2, 3), 3072)
    assert float(k[:, :, 320:].abs().sum()) == 0 and float(v[:, :, 320:].abs().sum()) == 0  # released: zeros


def test_release_is_a_no_op_without_lazy_pages_and_for_rows_within_keep_positions():
    c = KVCache(ARGS, 2, 64, torch.float32, lazy_pages=False)
    k, v = kv_pair(40)
    c.write_prefill(0, 0, 0, k, v)
    c.release(0)
    assert torch.equal(c.read(0, slice(0, 1), 40)[0][0], k)
    lazy = KVCache(ARGS, 2, 64, torch.float32, keep_positions=64)
    lazy.write_prefill(0, 0, 0, k, v)
    lazy.release(0)
    assert torch.equal(lazy.read(0, slice(0, 1), 40)[0][0], k)
    with pytest.raises(ValueError, match="lazy_pages"):
        KVCache(ARGS, 1, 8, torch.float32, device="meta", lazy_pages=True)
