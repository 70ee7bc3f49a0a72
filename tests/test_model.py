"""Our Llama forward against transformers' reference implementation (fp32), and the taps."""

import json
import subprocess

import pytest
import torch

from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import AttnBatch, LlamaArgs
from sfcl.model.loader import ModelLoadError, load_model, resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fp32(cache_dir):
    return load_model(None, dtype=torch.float32, cache_dir=cache_dir)


def test_matches_transformers_logits_hidden_and_attention(fp32):
    from transformers import AutoModelForCausalLM

    src = resolve_model(None)
    hf = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file, dtype=torch.float32,
                                              attn_implementation="eager")
    ids = fp32.tokenizer("The Receiving Party shall keep the Information confidential for five (5) years.",
                         return_tensors="pt").input_ids
    T = ids.shape[1]
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True, output_attentions=True)
    kv = KVCache(fp32.args, 2, 128, torch.float32)
    layer = 22
    out = fp32.model(ids, AttnBatch(True, torch.tensor([1]), torch.arange(T), T), kv, layer, all_positions=True)
    assert torch.allclose(out.logits[0], ref.logits[0], atol=2e-3)
    assert torch.allclose(out.tap_hidden[0], ref.hidden_states[layer + 1][0], atol=2e-3)
    assert torch.allclose(out.tap_probs[0], ref.attentions[layer][0], atol=1e-4)
    # decode one more token through the cache == full forward over T+1 tokens
    nxt = ref.logits[0, -1].argmax().view(1, 1)
    with torch.no_grad():
        ref2 = hf(torch.cat([ids, nxt], 1), output_attentions=True)
    mask = torch.ones(1, 1, 1, T + 1, dtype=torch.bool)
    o2 = fp32.model(nxt, AttnBatch(False, torch.tensor([1]), torch.tensor([T]), T + 1, mask, (1, 2)), kv, layer)
    assert torch.allclose(o2.logits[0], ref2.logits[0, -1], atol=2e-3)
    assert torch.allclose(o2.tap_probs[0, :, 0], ref2.attentions[layer][0, :, -1], atol=1e-4)


def test_check_positions_allows_the_whole_context_and_names_what_passes_it():
    args = LlamaArgs("llama", 32, 8, 16, 1, 2, 1, 4, 1e-5, max_position_embeddings=16, tie_word_embeddings=True,
                     attention_bias=False, qk_norm=False)
    args.check_positions(16, "a window")  # positions 0..15: the whole context
    with pytest.raises(ValueError, match="^a window: 17 positions, more than the model's context of 16 tokens$"):
        args.check_positions(17, "a window")


def test_model_errors_are_clear(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "w.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        resolve_model(str(tmp_path / "w.bin"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path / "bad.gguf"))


def test_fingerprint_is_dtype_independent(lm, fp32):
    assert lm.fingerprint == fp32.fingerprint and len(lm.fingerprint) == 64


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_local_hf_folder_loads_and_matches_transformers(tmp_path, lm, arch):
    """--model accepts a HF model folder; our forward matches transformers for Llama/Qwen2/Qwen3
    (tiny random weights written here, the bundled tokenizer reused)."""
    import transformers

    common = dict(vocab_size=lm.args.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=False)
    cfg = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[arch](**common, **({"head_dim": 16} if arch == "qwen3" else {}))
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path)
    lm.tokenizer.save_pretrained(tmp_path)
    mine = load_model(str(tmp_path), dtype=torch.float32)
    assert mine.args.model_type == arch and mine.name == tmp_path.name
    ids = torch.tensor([[1, 17, 400, 9000, 23, 5]])
    with torch.no_grad():
        ref = hf(ids).logits[0]
    kv = KVCache(mine.args, 1, 32, torch.float32)
    out = mine.model(ids, AttnBatch(True, torch.tensor([0]), torch.arange(6), 6), kv, 1, all_positions=True)
    assert torch.allclose(out.logits[0], ref, atol=1e-4)


def _tiny_hf_folder(folder, lm) -> None:
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=lm.args.vocab_size, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)


def test_a_first_load_with_a_cache_converts_in_a_child_process(tmp_path, lm, monkeypatch):
    """With a cache directory the checkpoint is read by ``python -m sfcl.model.convert`` (what reading
    it imports and allocates ends with that process) and the caller loads the cache: the same weights,
    bit for bit, as an uncached load that reads the checkpoint in process."""
    from sfcl.model import loader

    _tiny_hf_folder(tmp_path / "m", lm)
    uncached = load_model(str(tmp_path / "m"), dtype=torch.float32)

    def not_here(src):
        raise AssertionError("the checkpoint was read in the calling process")

    monkeypatch.setattr(loader, "read_checkpoint", not_here)
    cached = load_model(str(tmp_path / "m"), dtype=torch.float32, cache_dir=tmp_path / "cache")
    (done,) = (tmp_path / "cache" / "models").glob("*/done")
    assert done.read_text() == "ok"
    a, b = uncached.model.state_dict(), cached.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert cached.fingerprint == uncached.fingerprint and cached.args == uncached.args


def test_a_changed_weights_file_is_converted_again_and_replaces_the_old_conversion(tmp_path, lm):
    """A HF folder whose ``model.safetensors`` is replaced (same size, ``config.json`` untouched):
    the next cached load converts it again and serves the new weights, and the old conversion of
    that folder is removed; another model's conversion in the same cache stays."""
    import shutil

    _tiny_hf_folder(tmp_path / "m", lm)
    _tiny_hf_folder(tmp_path / "other", lm)
    cache = tmp_path / "cache"
    first = load_model(str(tmp_path / "m"), dtype=torch.float32, cache_dir=cache)
    load_model(str(tmp_path / "other"), dtype=torch.float32, cache_dir=cache)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.5)
    hf.save_pretrained(tmp_path / "new")
    assert (tmp_path / "new" / "model.safetensors").stat().st_size == (tmp_path / "m" / "model.safetensors").stat().st_size
    shutil.copy(tmp_path / "new" / "model.safetensors", tmp_path / "m" / "model.safetensors")
    second = load_model(str(tmp_path / "m"), dtype=torch.float32, cache_dir=cache)
    w1, w2 = first.model.layers[0].mlp.down_proj.weight, second.model.layers[0].mlp.down_proj.weight
    assert torch.allclose(w2, w1 * 1.5)
    sources = sorted(json.loads(m.read_text())["source"] for m in (cache / "models").glob("*/meta.json"))
    assert sources == sorted([str(tmp_path / "m"), str(tmp_path / "other")])


def test_the_child_conversion_reports_errors_and_falls_back_in_process(tmp_path, lm):
    """An unreadable checkpoint: the child's ModelLoadError reaches the caller, nothing is cached. A
    cache that cannot be written (a file where its folder would be): the model loads, read in process."""
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ModelLoadError, match="cannot load"):
        load_model(str(tmp_path / "bad.gguf"), cache_dir=tmp_path / "cache")
    gguf = resolve_model(None).path  # the bundled GGUF cut after 1,000 bytes: a reader's struct.error
    (tmp_path / "cut.gguf").write_bytes(gguf.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="cannot load .*cut.gguf"):
        load_model(str(tmp_path / "cut.gguf"), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("models/*/done"))
    _tiny_hf_folder(tmp_path / "m", lm)
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "models").write_text("a file, not a folder")
    got = load_model(str(tmp_path / "m"), dtype=torch.float32, cache_dir=tmp_path / "ro")
    assert got.args.n_layers == 2


def test_a_conversion_lands_whole_or_not_at_all(tmp_path, lm):
    """``convert_to_cache`` renames a finished folder into place: a leftover without ``done`` is
    replaced, and a second conversion into a complete cache keeps the first (two servers starting
    together), leaving no temporary folders behind."""
    from sfcl.model.convert import convert_to_cache
    from sfcl.model.loader import resolve_model as resolve

    _tiny_hf_folder(tmp_path / "m", lm)
    cache = tmp_path / "models" / "key"
    cache.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / "models" / f".key.{dead.pid}.x1").mkdir()  # the folder of a conversion killed while writing
    (cache / "weights.safetensors").write_bytes(b"half written")  # no done: cut short
    convert_to_cache(resolve(str(tmp_path / "m")), cache)
    assert (cache / "done").read_text() == "ok" and (cache / "weights.safetensors").stat().st_size > 1000
    first = (cache / "weights.safetensors").stat().st_ino
    convert_to_cache(resolve(str(tmp_path / "m")), cache)
    assert (cache / "weights.safetensors").stat().st_ino == first
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["key"]


def test_forward_step_equals_separate_decode_and_chunk_forwards(fp32):
    """One flattened step (2 decode rows + 2 prompt chunks of different sequences) gives the
    same logits, tap states and snapshot-layer weights as the per-part forwards (fp32)."""
    from sfcl.model.llama import ChunkSpec, StepBatch

    tok = fp32.tokenizer
    texts = ["The Receiving Party shall keep the Information confidential.",
             "This Agreement is governed by the laws of the State of New York.",
             "Disclosing Party means the party that discloses information.",
             "Either party may terminate this Agreement on thirty days notice."]
    ids = [tok(t).input_ids for t in texts]
    layer, S_max = 5, 64

    def prefill(kv, slot, toks):
        T = len(toks)
        return fp32.model(torch.tensor([toks]), AttnBatch(True, torch.tensor([slot]), torch.arange(T), T), kv, layer)

    # reference: rows 0 and 1 decode one token after their prompts; rows 2 and 3 prefill alone
    ref_kv = KVCache(fp32.args, 4, S_max, torch.float32)
    # the engine's contract: never-written positions read as zeros (torch.empty may hold NaN, and
    # a masked position still multiplies its V by probability 0: 0 * NaN = NaN)
    ref_kv.ensure_initialized(4, S_max)
    for slot in (0, 1):
        prefill(ref_kv, slot, ids[slot][:-1])
    pos = torch.tensor([len(ids[0]) - 1, len(ids[1]) - 1])
    S = int(pos.max()) + 1
    mask = (torch.arange(S)[None, :] <= pos[:, None]).view(2, 1, 1, S)
    dec = AttnBatch(False, torch.arange(2), pos, S, mask, (0, 2))
    ref_dec = fp32.model(torch.tensor([[ids[0][-1]], [ids[1][-1]]]), dec, ref_kv, layer)
    ref_c = [prefill(ref_kv, slot, ids[slot]) for slot in (2, 3)]

    kv = KVCache(fp32.args, 4, S_max, torch.float32)
    kv.ensure_initialized(4, S_max)
    for slot in (0, 1):
        prefill(kv, slot, ids[slot][:-1])
    flat = [ids[0][-1], ids[1][-1]] + ids[2] + ids[3]
    n2, n3 = len(ids[2]), len(ids[3])
    step = StepBatch(positions=torch.cat([pos, torch.arange(n2), torch.arange(n3)]), decode=dec,
                     chunks=[ChunkSpec(slot=2, start=0, offset=2, length=n2, want_probs=True),
                             ChunkSpec(slot=3, start=0, offset=2 + n2, length=n3, want_probs=True)],
                     sample_index=torch.tensor([0, 1, 1 + n2, 1 + n2 + n3]), keep_tap_states=True)
    out = fp32.model.forward_step(torch.tensor([flat]), step, kv, layer)
    want_logits = torch.cat([ref_dec.logits, ref_c[0].logits, ref_c[1].logits])
    assert torch.allclose(out.logits, want_logits, atol=1e-4)
    want_tap = torch.cat([ref_dec.tap_hidden[:, -1], ref_c[0].tap_hidden[:, -1], ref_c[1].tap_hidden[:, -1]])
    assert torch.allclose(out.tap_hidden, want_tap, atol=1e-4)
    assert out.tap_states.shape == (len(flat), fp32.args.hidden_size)
    assert torch.allclose(out.tap_probs[0], ref_dec.tap_probs, atol=1e-5)
    assert torch.allclose(out.tap_probs[1], ref_c[0].tap_probs, atol=1e-5)
    assert torch.allclose(out.tap_probs[2], ref_c[1].tap_probs, atol=1e-5)
    # and the KV it wrote is the KV the separate forwards wrote
    for slot, n in ((0, len(ids[0])), (1, len(ids[1])), (2, n2), (3, n3)):
        k, v = kv.read(layer, slice(slot, slot + 1), n)
        rk, rv = ref_kv.read(layer, slice(slot, slot + 1), n)
        # 1e-4: float32 GEMMs of other row counts round differently on some CPUs (2.3e-5 at |K| ~12
        # on an Intel Xeon with AMX, 2026-12-05); a KV row written to the wrong slot or position is off by ~1
        assert torch.allclose(k, rk, atol=1e-4) and torch.allclose(v, rv, atol=1e-4)


def test_attention_runs_join_only_back_to_back_chunks_of_one_sequence():
    from sfcl.model.llama import ChunkSpec, attention_runs

    c = [ChunkSpec(slot=1, start=96, offset=2, length=32), ChunkSpec(slot=1, start=128, offset=34, length=7, want_probs=True),
         ChunkSpec(slot=2, start=0, offset=41, length=16), ChunkSpec(slot=2, start=16, offset=57, length=8, want_probs=True),
         ChunkSpec(slot=2, start=24, offset=65, length=4),  # follows a chunk that wants probabilities
         ChunkSpec(slot=3, start=10, offset=69, length=4), ChunkSpec(slot=3, start=20, offset=73, length=4)]  # a gap
    assert attention_runs(c, True) == [(0, 2), (2, 2), (4, 1), (5, 1), (6, 1)]
    assert attention_runs(c, False) == [(i, 1) for i in range(7)]
    assert attention_runs([], True) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_of_one_sequence_in_one_attention_call_change_nothing(fp32, monkeypatch, dtype):
    """A step holding two chunks of one prompt after a cached prefix (a prefix-cache hit's blocks, then
    its tail) attends in one call (``attention_runs``): logits, tap state and weights, and the KV written
    are the same bit for bit as with a call per chunk."""
    import copy

    import sfcl.model.llama as llama
    from sfcl.model.llama import ChunkSpec, StepBatch

    model = fp32.model if dtype == torch.float32 else copy.deepcopy(fp32.model).to(dtype)
    ids = fp32.tokenizer("The Receiving Party shall keep the Confidential Information in confidence for five (5) "
                         "years after the Effective Date and shall not disclose it to any third party.").input_ids
    p0, n = 8, len(ids)
    layer = 5
    out, kvs, calls = {}, {}, []
    runs, attn = llama.attention_runs, llama.Attention.prefill_attn
    monkeypatch.setattr(llama.Attention, "prefill_attn", lambda *x, **kw: calls.append(1) or attn(*x, **kw))
    for merge in (False, True):
        monkeypatch.setattr(llama, "attention_runs", lambda chunks, m, merge=merge: runs(chunks, m and merge))
        kv = KVCache(fp32.args, 2, 64, dtype)
        kv.ensure_initialized(2, 64)
        model(torch.tensor([ids[:p0]]), AttnBatch(True, torch.tensor([0]), torch.arange(p0), p0), kv, layer)
        step = StepBatch(positions=torch.arange(p0, n), decode=None,
                         chunks=[ChunkSpec(slot=0, start=p0, offset=0, length=16),
                                 ChunkSpec(slot=0, start=p0 + 16, offset=16, length=n - p0 - 16, want_probs=True)],
                         sample_index=torch.tensor([n - p0 - 1]))
        calls.clear()
        out[merge], kvs[merge] = model.forward_step(torch.tensor([ids[p0:]]), step, kv, layer), kv
        # one call per layer where SFCL's prompt kernels run (no masks built); else per chunk
        native = llama.native_prefill_attention(torch.empty(1, dtype=dtype), fp32.args.head_dim)
        assert len(calls) == fp32.args.n_layers * (1 if merge and native else 2)
    a, b = out[False], out[True]
    assert torch.equal(a.logits, b.logits) and torch.equal(a.tap_hidden, b.tap_hidden)
    assert a.tap_probs[0] is None and b.tap_probs[0] is None and torch.equal(a.tap_probs[1], b.tap_probs[1])
    assert all(torch.equal(x, y) for x, y in zip(kvs[False].k + kvs[False].v, kvs[True].k + kvs[True].v))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_small_decode_attention_in_float32_matches_the_16_bit_path(monkeypatch, kv_dtype):
    """A 16-bit decode step attending to few positions (B x S <= SMALL_ATTN_FP32_POSITIONS) runs
    its attention in float32; both paths give the reference attention, masks and weights included."""
    import sfcl.model.llama as llama
    from sfcl.model.llama import Attention, LlamaArgs

    a = LlamaArgs("llama", 64, 128, 256, 1, 6, 2, 64, 1e-5, 256, False, False, False)
    torch.manual_seed(0)
    attn = Attention(a)
    kv = KVCache(a, 2, 64, torch.bfloat16, kv_dtype=kv_dtype)
    kv.ensure_initialized(2, 64)
    lens = [40, 23]  # row 1 attends to fewer positions: the mask matters
    for slot, n in enumerate(lens):
        kv.write_prefill(0, slot, 0, torch.randn(2, n - 1, 64, dtype=torch.bfloat16),
                         torch.randn(2, n - 1, 64, dtype=torch.bfloat16))
    pos = torch.tensor([n - 1 for n in lens])
    S = max(lens)
    mask = (torch.arange(S)[None, :] <= pos[:, None]).view(2, 1, 1, S)
    batch = AttnBatch(False, torch.arange(2), pos, S, mask, (0, 2))
    q, k, v = (torch.randn(2, h, 64, dtype=torch.bfloat16) for h in (6, 2, 2))

    def run(limit):
        monkeypatch.setattr(llama, "SMALL_ATTN_FP32_POSITIONS", limit)
        return attn.decode_attn(q, k, v, batch, kv, 0, True)

    o32, p32 = run(10_000)  # float32 path
    o16, p16 = run(0)  # 16-bit matmuls
    assert o32.dtype == o16.dtype == torch.bfloat16 and o32.shape == (2, 6 * 64)
    kk, vv = kv.read(0, slice(0, 2), S)  # (2, nkv, S, hd) as both paths read them
    s = torch.einsum("bhgd,bhsd->bhgs", (q.float() * 64 ** -0.5).view(2, 2, 3, 64), kk.float())
    p = s.masked_fill(~mask, float("-inf")).softmax(-1)  # (2, nkv, g, S)
    ref = torch.einsum("bhgs,bhsd->bhgd", p, vv.float()).reshape(2, 6 * 64)
    assert torch.allclose(o32.float(), ref, atol=2e-2) and torch.allclose(o16.float(), ref, atol=5e-2)
    assert torch.allclose(p32, p.view(2, 6, 1, S), atol=1e-5)  # float32 scores: the reference weights
    assert torch.allclose(p16, p.view(2, 6, 1, S), atol=2e-2)
    assert float(p32[1, :, 0, lens[1]:].abs().max()) == 0.0  # masked positions get no weight
