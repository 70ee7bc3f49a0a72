"""sfcl.engine.graph_runner (and sfcl.model.cuda_graph) on the CPU: the static-buffer decode path —
padded batch, padded KV length, padded rows' writes sent to the scratch row, tap and dispersion in
the same function — without the capture itself, against the runner's exact-shape eager decode.
Capture and replay on CUDA: tests/gpu/test_cuda.py (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from sfcl.config import EngineConfig
from sfcl.engine.events import Finished, SnapshotEvent, TextDelta
from sfcl.engine.graph_runner import DecodeGraphRunner, default_batch_sizes
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import make_llm_engine
from sfcl.model.cuda_graph import GraphCache
from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import AttnBatch, LlamaArgs, LlamaModel
from sfcl.snapshot.triggers import attention_dispersion

TINY = LlamaArgs(model_type="llama", vocab_size=300, hidden_size=64, intermediate_size=128, n_layers=3, n_heads=4,
                 n_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=4096,
                 tie_word_embeddings=False, attention_bias=False, qk_norm=False)


def tiny_model(seed: int = 0) -> LlamaModel:
    torch.manual_seed(seed)
    inv = 1.0 / (10000.0 ** (torch.arange(0, TINY.head_dim, 2).float() / TINY.head_dim))
    m = LlamaModel(TINY, inv)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.05)
        for mod in m.modules():  # RMSNorm weights near 1
            if type(mod).__name__ == "RMSNorm":
                mod.weight.fill_(1.0)
    return m.eval()


def prefill(model, kv, slot, ids, tap):
    batch = AttnBatch(is_prefill=True, slots=torch.tensor([slot]), positions=torch.arange(len(ids)), kv_len=len(ids))
    model(torch.tensor([ids]), batch, kv, tap)


def eager_decode(model, kv, tap, tokens, positions):
    """The runner's eager decode (exact B and S), as in ModelRunner.execute."""
    B = len(tokens)
    ids = torch.tensor([[t] for t in tokens])
    pos = torch.tensor(positions)
    S = max(positions) + 1
    kv.ensure_initialized(B, S)
    mask = torch.arange(S)[None, :] <= pos[:, None]
    batch = AttnBatch(is_prefill=False, slots=torch.arange(B), positions=pos, kv_len=S, mask=mask.view(B, 1, 1, S),
                      slot_range=(0, B))
    fo = model(ids, batch, kv, tap)
    return fo.logits, fo.tap_hidden[:, -1], attention_dispersion(fo.tap_probs[:, :, -1], pos + 1)


def test_buckets():
    assert default_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert default_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_batch_sizes(3) == [1, 2, 3]
    kv = KVCache(TINY, n_slots=20, max_len=40000, dtype=torch.float32)
    g = DecodeGraphRunner(tiny_model(), kv, 1, capture=False)
    assert [g.batch_bucket(b) for b in (1, 3, 5, 9, 17, 20)] == [1, 4, 8, 16, 20, 20]
    assert [g.kv_len_bucket(s) for s in (1, 256, 257, 2048, 2049, 3000, 4097, 5000, 39999)] == \
        [256, 256, 512, 2048, 2304, 3072, 4608, 5120, kv.max_len]
    for s in range(1, kv.max_len + 1, 97):  # never short, at most 12.5% (or one fine bucket) long
        sp = g.kv_len_bucket(s)
        assert s <= sp <= kv.max_len and (sp - s < 256 or sp <= 1.125 * s)
    with pytest.raises(ValueError):
        g.batch_bucket(21)
    with pytest.raises(ValueError):
        g.run([1], [kv.max_len])  # past the cache
    with pytest.raises(ValueError):
        DecodeGraphRunner(tiny_model(), kv, 1, batch_sizes=[1, 32])
    assert not DecodeGraphRunner(tiny_model(), kv, 1, capture=True).capture  # CPU: never captures


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_static_path_equals_eager_across_batch_and_length_buckets(kv_dtype):
    """Decode rows join (prefilled into the next slot) and leave (the scheduler moves the last row
    into the hole), batches 1..5 padded to 1/2/4/8, lengths crossing 16-position buckets: logits,
    tap hidden and dispersion equal the exact-shape eager decode, rows beyond the batch (a
    prefilling sequence's KV) are untouched, and greedy tokens agree."""
    model = tiny_model()
    tap = 1
    dt = torch.float32
    kvs = [KVCache(TINY, n_slots=8, max_len=128, dtype=dt, kv_dtype=kv_dtype) for _ in range(2)]
    g = DecodeGraphRunner(model, kvs[1], tap, capture=False, batch_sizes=[1, 2, 4, 8], kv_bucket=16)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 300, (n,), generator=gen).tolist() for n in (5, 14, 3, 20, 9, 30)]
    # a "prefilling" sequence sits in slot 7 throughout: padded rows read it but must never write it
    for kv in kvs:
        prefill(model, kv, 7, prompts[5], tap)
    before = [kvs[1].k[i][7, :, :30].clone() for i in range(TINY.n_layers)]
    rows: list[list[int]] = []  # per decode row: its tokens so far (row i lives in slot i)
    # INT8 KV: each path quantizes its own cache, so a ~1e-7 difference in a K or V value can flip one
    # int8 rounding step for good: on AVX2 code paths with SFCL's float32 element-wise kernels that moved
    # the logits by 1.2-1.9e-4 from step 27 on (a red CI run, 2026-12-07); 1e-3 is 0.25% of the logits'
    # spread (std ~0.41), far below what a padded row or a wrong bucket does
    tol = dict(rtol=1e-5, atol=1e-5) if kv_dtype == "auto" else dict(rtol=1e-3, atol=1e-3)
    schedule = {0: "join", 1: "join", 4: "join", 6: "join", 9: "join", 12: "leave0", 15: "join", 20: "leave2",
                24: "leave0"}
    nxt = iter(prompts[:5] * 2)
    for step in range(30):
        ev = schedule.get(step, "")
        if ev == "join":
            p = next(nxt)
            for kv in kvs:
                prefill(model, kv, len(rows), p, tap)
            rows.append(list(p))
        elif ev.startswith("leave"):  # the last row moves into the leaver's slot, as _layout does
            i = int(ev[-1])
            last = len(rows) - 1
            if i != last:
                for kv in kvs:
                    kv.move(last, i, len(rows[last]) - 1)
                rows[i] = rows[last]
            rows.pop()
        tokens = [r[-1] for r in rows]
        positions = [len(r) - 1 for r in rows]
        want = eager_decode(model, kvs[0], tap, tokens, positions)
        got = g.run(tokens, positions)
        torch.testing.assert_close(got.logits, want[0], **tol)
        torch.testing.assert_close(got.hidden, want[1], **tol)
        torch.testing.assert_close(got.dispersion, want[2], **tol)
        assert got.logits.shape[0] == len(rows)
        for r, t in zip(rows, want[0].argmax(-1).tolist()):
            r.append(t)
    assert all(torch.equal(b, kvs[1].k[i][7, :, :30]) for i, b in enumerate(before))
    keys = set(g.graphs._entries)
    assert {b for b, _ in keys} >= {1, 2, 4, 8} and len({s for _, s in keys}) >= 2  # padding and length buckets used
    assert g.graphs.eager_runs == 30 and g.graphs.replays == 0 and g.graphs.captured == []


def test_graph_cache_runs_fn_on_the_same_static_buffers():
    cache = GraphCache("cpu", capture=True)
    assert not cache.capture
    made = []

    def make():
        made.append(torch.zeros(3))
        return {"x": made[-1]}

    def fill(inp):
        inp["x"].add_(1)

    out, replayed = cache.run("k", make, fill, lambda inp: {"y": inp["x"] * 2})
    out2, _ = cache.run("k", make, fill, lambda inp: {"y": inp["x"] * 2})
    assert not replayed and len(made) == 1 and out2["y"].tolist() == [4.0, 4.0, 4.0] and out["y"].tolist() == [2.0] * 3


@pytest.fixture(scope="module")
def fp32(cache_dir):
    from sfcl.model.loader import load_model

    return load_model(None, dtype=torch.float32, cache_dir=cache_dir)


def _drive(eng, prompts, joins):
    """Add prompt i at step joins[i]; record every sampled row's results per step."""
    seen: list[dict] = []
    orig = eng.runner.execute

    def spy(plan):
        out = orig(plan)
        seen.append({rid: (r.token_id, r.logprob, r.entropy, r.dispersion, r.snapshot and r.snapshot.anchor_ids)
                     for rid, r in out.results.items()})
        return out

    eng.runner.execute = spy
    events: dict[str, list] = {}
    step = 0
    while step <= max(joins) or eng.has_work():
        for i, j in enumerate(joins):
            if j == step:
                ids, params = prompts[i]
                rid = f"r{i}"
                events[rid] = [e for _, e in eng.add_request(rid, ids, params)]
        for rid, e in eng.step():
            events[rid].append(e)
        step += 1
    return seen, events


def test_engine_with_static_decode_path_equals_eager(fp32, nda_library):
    """The real bundled model (fp32) in the engine: requests join and leave at different steps;
    with the static-buffer decode (capture off, small buckets so lengths cross them) every step's
    tokens, logprobs, entropies, dispersions and snapshot anchors equal the eager runner's."""
    tok = fp32.tokenizer

    def chat(text):
        t = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return tok(t, add_special_tokens=False)["input_ids"]

    qs = ["List three colours.", "What is a non-disclosure agreement? Answer briefly.", "Say hello.",
          "Count from one to ten in words."]
    prompts = [(chat(q), SamplingParams(max_tokens=n, ignore_eos=True, snapshot_mode="always" if i % 2 else "off"))
               for i, (q, n) in enumerate(zip(qs, (14, 22, 6, 18)))]
    joins = [0, 2, 5, 9]
    runs = {}
    for graphs in (False, True):
        eng = make_llm_engine(fp32, nda_library, EngineConfig(max_num_seqs=4, prefix_cache_tokens=0))
        if graphs:
            eng.runner.graphs = DecodeGraphRunner(fp32.model, eng.runner.kv, eng.runner.tap_layer, capture=False,
                                                  batch_sizes=[1, 2, 4], kv_bucket=16)
        runs[graphs] = _drive(eng, prompts, joins)
        if graphs:
            gc = eng.runner.graphs.graphs
            assert gc.eager_runs >= 20 and len({s for _, s in gc._entries}) >= 2
            assert any(b == 4 for b, _ in gc._entries) and any(b == 2 for b, _ in gc._entries)
    (s_e, ev_e), (s_g, ev_g) = runs[False], runs[True]
    assert len(s_e) == len(s_g)
    for a, b in zip(s_e, s_g):
        assert a.keys() == b.keys()
        for rid in a:
            assert a[rid][0] == b[rid][0] and a[rid][4] == b[rid][4]
            assert a[rid][1:4] == pytest.approx(b[rid][1:4], abs=2e-4)
    for rid in ev_e:
        text = ["".join(e.text for e in ev[rid] if isinstance(e, TextDelta)) for ev in (ev_e, ev_g)]
        assert text[0] == text[1] and text[0]
        assert isinstance(ev_g[rid][-1], Finished)
    assert not any(isinstance(e, SnapshotEvent) for e in ev_e["r0"])  # off: none; r1/r3: always
    assert sum(isinstance(e, SnapshotEvent) for e in ev_g["r1"]) == 22


def test_enforce_eager_flag_and_cpu_defaults(lm):
    from sfcl.cli import build_parser
    from sfcl.cli.flags import configs

    a = build_parser().parse_args(["serve", "--enforce-eager"])
    assert configs(a)[1].enforce_eager is True
    assert configs(build_parser().parse_args(["serve"]))[1].enforce_eager is False
    eng = make_llm_engine(lm, None, EngineConfig(max_num_seqs=2))  # CPU: always eager, unfused
    assert eng.runner.graphs is None and eng.runner.fused_lookup is False
