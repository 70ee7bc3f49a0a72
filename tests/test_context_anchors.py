"""Context anchors (sfcl.snapshot.context) and the prefill tap they are captured from."""

from __future__ import annotations

import pytest
import torch
from conftest import contractnli_docs

from sfcl.config import EngineConfig
from sfcl.engine.engine import run_to_completion
from sfcl.engine.events import SnapshotEvent
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import make_llm_engine
from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import AttnBatch
from sfcl.snapshot.context import ContextAnchors


def states(T, H=8, seed=0):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


def test_capture_keeps_every_position_with_a_next_token():
    ids = list(range(100, 110))  # 10 prompt tokens
    h = states(10)
    ca = ContextAnchors()
    ca.add("r", 0, h, ids)
    assert ca.count("r") == 9  # the last position has no next prompt token
    sc, pos, nxt = ca.search("r", h[4], k=2)
    assert pos[0].item() == 4 and nxt[0].item() == ids[5] and sc[0].item() == pytest.approx(1.0, abs=1e-3)


def test_chunked_capture_equals_one_pass_and_is_capped_with_a_stride():
    ids = list(range(50))
    h = states(50)
    one, chunked = ContextAnchors(max_positions=10), ContextAnchors(max_positions=10)
    one.add("r", 0, h, ids)
    for a, b in ((0, 7), (7, 23), (23, 50)):
        chunked.add("r", a, h[a:b], ids)
    v1, p1, n1 = one.requests["r"].cat()
    v2, p2, n2 = chunked.requests["r"].cat()
    assert p1.tolist() == p2.tolist() == list(range(0, 49, 5))  # stride ceil(49 / 10) = 5, <= 10 kept
    assert torch.equal(v1, v2) and n1.tolist() == n2.tolist() == [ids[p + 1] for p in p1.tolist()]
    with pytest.raises(ValueError):
        chunked.add("r", 45, h[:10], ids)  # runs past the prompt


def test_prefix_lru_restores_a_shared_prefix_only():
    ids = list(range(30))
    h = states(30)
    ca = ContextAnchors()
    ca.add("a", 0, h[:12], ids)
    ca.add("a", 12, h[12:], ids)
    ca.release("a")
    assert not ca.has("a")
    same = ids[:12] + [999] * 18  # shares the first chunk, not the second
    assert ca.restore("b", same, upto=12) == 12
    assert ca.requests["b"].cat()[1].tolist() == list(range(12))  # position 11's next token is known
    assert ca.requests["b"].cat()[2][-1].item() == 999
    # nothing further to restore; a different prompt gets nothing
    assert ca.restore("b", same, upto=30) == 0
    assert ca.restore("c", [7] + ids[1:], upto=12) == 0
    # the whole prompt again: both chunks come back, then the rest is computed and added
    assert ca.restore("d", ids, upto=30) == 30 and ca.count("d") == 29


def test_lru_is_bounded():
    ca = ContextAnchors(lru_chunks=2)
    for i in range(5):
        ca.add(f"r{i}", 0, states(4, seed=i), [i, 1, 2, 3])
    assert len(ca.lru) == 2


def test_tap_all_returns_every_prefill_position_without_all_logits(lm):
    ids = lm.tokenizer("The term of this Agreement is five years.", add_special_tokens=False)["input_ids"]
    T = len(ids)
    dtype = next(lm.model.parameters()).dtype
    outs = []
    for kw in ({"tap_all": True}, {"all_positions": True}, {}):
        kv = KVCache(lm.args, 1, T + 1, dtype, "cpu")
        batch = AttnBatch(is_prefill=True, slots=torch.tensor([0]), positions=torch.arange(T), kv_len=T)
        outs.append(lm.model(torch.tensor([ids]), batch, kv, 22, **kw))
    tap, full, plain = outs
    assert tap.tap_hidden.shape == (1, T, lm.args.hidden_size)
    assert tap.logits.shape == (1, lm.args.vocab_size)  # last position only
    assert torch.equal(tap.logits, plain.logits) and torch.equal(tap.tap_hidden[:, -1:], plain.tap_hidden)
    # all_positions computes attention weights for every query (another kernel): equal up to bf16
    cos = torch.nn.functional.cosine_similarity(tap.tap_hidden[0].float(), full.tap_hidden[0].float(), dim=-1)
    assert cos.min().item() > 0.999


def test_steered_request_searches_its_own_prompt(lm, nda_library):
    doc = contractnli_docs(6)[5].text[:1500]
    text = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": doc + "\n\nCopy the first sentence of the text above exactly."}],
        tokenize=False, add_generation_prompt=True)
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=2))
    [ev] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=12, snapshot_mode="always", steer="knn"))])
    snaps = [e for e in ev if isinstance(e, SnapshotEvent)]
    ctx = [h for s in snaps for h in s.top if h.kind == "context"]
    assert ctx, "copying from the prompt should find prompt positions among the nearest anchors"
    for h in ctx:
        assert h.span["doc_id"] == "prompt" and h.span["unit"] == "token" and 0 <= h.anchor_id < len(ids) - 1
        assert h.span["text"] and h.span["text"].strip() in lm.tokenizer.decode(ids, skip_special_tokens=True)
    for s in snaps:  # the event's anchor_id stays a library row even when prompt anchors rank first
        assert 0 <= s.anchor_id < nda_library.n_anchors
        assert any(h.kind != "context" and h.anchor_id == s.anchor_id for h in s.top)
    assert eng.runner.context.requests == {}  # released with the request
    # without steering the prompt is neither captured nor searched
    [plain] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=4, snapshot_mode="always"))])
    assert all(h.kind != "context" for e in plain if isinstance(e, SnapshotEvent) for h in e.top)


def test_chunked_prefill_and_prefix_cache_keep_every_prompt_position(lm, nda_library):
    doc = contractnli_docs(6)[5].text[:900]
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": doc + "\n\nSummarise."}], tokenize=False,
                                            add_generation_prompt=True)
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64))
    ca = eng.runner.context
    calls = []
    add = ca.add

    def spy(rid, start, tap, tok_ids):
        add(rid, start, tap, tok_ids)
        calls.append((rid, start, int(tap.shape[0]), ca.count(rid)))

    ca.add = spy
    params = SamplingParams(max_tokens=2, snapshot_mode="always", steer="knn")
    run_to_completion(eng, [(ids, params)])
    first = [c for c in calls if c[0] == "sync-0"]
    assert len(first) > 1 and first[0][1] == 0  # several chunks, from position 0
    assert all(a[1] + a[2] == b[1] for a, b in zip(first, first[1:]))  # contiguous
    assert first[-1][1] + first[-1][2] == len(ids) and first[-1][3] == len(ids) - 1
    calls.clear()
    run_to_completion(eng, [(ids, params)])  # same prompt: the prefix cache skips most of it
    again = [c for c in calls if c[0] == "sync-0"]
    assert again and again[0][1] > 0, "expected a prefix-cache hit"
    assert again[-1][3] == len(ids) - 1  # the skipped positions came back from the context LRU
