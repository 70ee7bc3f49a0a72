"""Steering: the kNN-LM mixture (sfcl.snapshot.steering), the runner's correction of the triggered
token on the real model (every mechanism), and the ``steer`` field / header of both APIs."""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from sfcl.config import EngineConfig
from sfcl.engine.engine import run_to_completion
from sfcl.engine.events import SnapshotEvent, TextDelta
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import make_llm_engine
from sfcl.library.store import save_library
from sfcl.library.versions import load_library
from sfcl.model.llama import AttnBatch
from sfcl.snapshot.mechanisms import DEFAULT_STEER
from sfcl.snapshot.steering import SteerConfig, anchor_distribution, interpolate

# -- the mixture math ---------------------------------------------------------------------------

def test_lambda_zero_keeps_the_model_distribution():
    logits = torch.randn(2, 10)
    q = torch.zeros(2, 10)
    q[:, 3] = 0.4
    out = interpolate(logits, q, torch.zeros(2))
    assert torch.allclose(out.exp(), torch.softmax(logits, -1), atol=1e-6)


def test_mixture_is_a_distribution_and_backs_off_the_unknown_tail():
    logits = torch.randn(1, 10)
    scores = torch.tensor([[0.9, 0.8]])
    ids = torch.tensor([[[3, 4, -1], [3, -1, -1]]])
    probs = torch.tensor([[[0.3, 0.1, 0.0], [0.5, 0.0, 0.0]]])
    q = anchor_distribution(scores, ids, probs, 10, tau=0.1)
    w0 = 1 / (1 + math.exp(-1.0))  # softmax([0.9, 0.8] / 0.1)[0]
    assert q[0, 3].item() == pytest.approx(w0 * 0.3 + (1 - w0) * 0.5, abs=1e-5)
    assert q[0, 4].item() == pytest.approx(w0 * 0.1, abs=1e-5)
    p = interpolate(logits, q, torch.tensor([0.5])).exp()
    assert p.sum().item() == pytest.approx(1.0, abs=1e-5)
    m = q.sum().item()  # the anchors' covered mass; the rest stays the model's
    pm = torch.softmax(logits, -1)
    assert p[0, 7].item() == pytest.approx((1 - 0.5 * m) * pm[0, 7].item(), rel=1e-4)
    assert p[0, 3].item() == pytest.approx((1 - 0.5 * m) * pm[0, 3].item() + 0.5 * q[0, 3].item(), rel=1e-4)


def test_one_hot_anchor_at_full_lambda_decides():
    logits = torch.tensor([[5.0, 0.0, 0.0]])
    q = anchor_distribution(torch.tensor([[1.0]]), torch.tensor([[[2]]]), torch.tensor([[[1.0]]]), 3, 0.1)
    p = interpolate(logits, q, torch.tensor([1.0])).exp()
    assert p.argmax().item() == 2 and p[0, 2].item() == pytest.approx(1.0, abs=1e-6)


def test_steer_config_validates():
    with pytest.raises(ValueError):
        SteerConfig(lambda_max=1.5)
    with pytest.raises(ValueError):
        SteerConfig(tau=0)


# -- the engine ---------------------------------------------------------------------------------

def chat_ids(lm, content):
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                            add_generation_prompt=True)
    return lm.tokenizer(text, add_special_tokens=False)["input_ids"]


PROMPT = "Name the capital of France in one word."


def tap_state(lm, ids, layer):
    """Snapshot-layer hidden state of the last prompt position (what the first lookup queries)."""
    from sfcl.model.kv_cache import KVCache

    kv = KVCache(lm.args, 1, len(ids) + 1, next(lm.model.parameters()).dtype, "cpu")
    T = len(ids)
    batch = AttnBatch(is_prefill=True, slots=torch.tensor([0]), positions=torch.arange(T), kv_len=T)
    fo = lm.model(torch.tensor([ids]), batch, kv, layer)
    return fo.tap_hidden[0, -1].float()


def crafted_library(lm, base, path, query, target_token):
    """4 anchors: anchor 0 is exactly the first lookup's query and says "next comes target_token"
    (one-hot); the others point elsewhere."""
    g = torch.Generator().manual_seed(0)
    H = query.numel()
    vec = torch.randn(4, H, generator=g)
    vec[0] = query
    nid = torch.full((4, 8), -1, dtype=torch.int32)
    npb = torch.zeros(4, 8)
    nid[:, 0], npb[:, 0] = target_token, 1.0
    nid[1:, 0] = 0
    z = torch.zeros(4, dtype=torch.int32)
    return save_library(path, vectors=vec, counts=z + 1, weights=torch.ones(4), decay=torch.full((4,), 10.0),
                        next_ids=nid, next_probs=npb, kinds=z.clone(), span_doc=z.clone(),
                        span_start=z.clone(), span_end=z + 1, span_texts=["crafted"] * 4,
                        doc_ids=["crafted"], model_fingerprint=lm.fingerprint, model_name=lm.name,
                        layer=base.layer, build={"test": True}, corpus_hash="crafted",
                        calibration=base.calibration)


def text_of(events):
    return "".join(e.text for e in events if isinstance(e, TextDelta))


def test_steering_off_is_identical_to_snapshots_off(lm, nda_library):
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=2))
    ids = chat_ids(lm, "The Receiving Party shall keep the Confidential Information secret for five years. "
                       "How long must it be kept secret?")
    # a first run leaves the prompt in the prefix cache, so the three compared runs compute it alike: a
    # bf16 prompt computed cold and one restored from the cache round differently, and a greedy near-tie
    # may then go either way (docs/engine.md); here that would not be the snapshots' doing
    run_to_completion(eng, [(ids, SamplingParams(max_tokens=1))])
    out = {}
    for mode in ("off", "triggered", "always"):
        [ev] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=24, snapshot_mode=mode, steer=False))])
        out[mode] = ev
    assert text_of(out["off"]) and text_of(out["off"]) == text_of(out["triggered"]) == text_of(out["always"])
    snaps = [e for e in out["always"] if isinstance(e, SnapshotEvent)]
    assert snaps and all(s.steer is None for s in snaps)


def test_steering_changes_the_token_when_a_crafted_anchor_fires(lm, nda_library, tmp_path):
    ids = chat_ids(lm, PROMPT)
    target = lm.tokenizer(" banana", add_special_tokens=False)["input_ids"][0]
    q = tap_state(lm, ids, nda_library.layer)
    lib = load_library(crafted_library(lm, nda_library, tmp_path / "crafted", q, target))
    eng = make_llm_engine(lm, lib, EngineConfig(max_num_seqs=2))
    eng.runner.snapshotter.steer = SteerConfig(lambda_max=1.0)
    params = dict(max_tokens=2, snapshot_mode="always")
    [plain] = run_to_completion(eng, [(ids, SamplingParams(**params))])
    [steered] = run_to_completion(eng, [(ids, SamplingParams(**params, steer="knn"))])
    s0 = [e for e in steered if isinstance(e, SnapshotEvent)][0]
    p0 = [e for e in plain if isinstance(e, SnapshotEvent)][0]
    assert p0.token != " banana" and p0.steer is None
    assert s0.top[0].anchor_id == 0 and s0.top[0].score > 0.99 and s0.confidence > 0.9
    # the snapshot fired on the first token: the same position is re-sampled from the mixture
    assert s0.token == " banana" and s0.steer["changed"] and s0.steer["original_token"] == p0.token
    assert s0.steer["mechanism"] == "knn" and s0.steer["token"] == " banana"
    assert s0.steer["lambda"] == pytest.approx(s0.confidence, rel=1e-6)
    assert text_of(steered).startswith(" banana") or text_of(steered).startswith("banana")
    assert s0.token_logprob < p0.token_logprob  # reported logprob is the model's, of the emitted token
    # greedy + steering is deterministic; sampled + steering reproduces with a seed
    [again] = run_to_completion(eng, [(ids, SamplingParams(**params, steer="knn"))])
    assert text_of(again) == text_of(steered)
    sampled = [run_to_completion(eng, [(ids, SamplingParams(**params, steer="knn", temperature=0.8, seed=7))])[0]
               for _ in range(2)]
    assert text_of(sampled[0]) == text_of(sampled[1])
    s1 = [e for e in sampled[0] if isinstance(e, SnapshotEvent)][0]
    assert s1.steer is not None and s1.token == " banana"  # lambda ~1 leaves almost no other choice


def test_every_mechanism_answers_and_reports_what_it_did(lm_fp32, nda_library):
    """On the real model with a contract: each mechanism (and a combination) answers, every
    looked-up token of a steered request carries a ``steer`` record naming its mechanism, and a
    changed token is the one emitted. Observe-only requests in the same batch are untouched: the
    answer equals the same request's alone (in float32: in bf16 the prompt computed in one chunk
    here and restored from the prefix cache there rounds differently, enough to flip a near tie)."""
    from sfcl.snapshot.mechanisms import no_document_messages

    lm = lm_fp32

    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=6, max_model_len=1024))
    msgs = [{"role": "user", "content": "Contract:\nThis Agreement is between Acme Widgets Inc. and Beta Labs LLC. "
                                        "The Recipient shall return all Confidential Information within thirty (30) "
                                        "days of a written request. This Agreement is governed by the laws of the "
                                        "State of New York.\n\nQuestion: Within how many days must information be "
                                        "returned, and which law governs?"}]
    enc = lambda m, sys_=None: lm.tokenizer(lm.tokenizer.apply_chat_template(  # noqa: E731
        ([{"role": "system", "content": sys_}] if sys_ else []) + m, tokenize=False, add_generation_prompt=True),
        add_special_tokens=False)["input_ids"]
    ids, cad_ids = enc(msgs), enc(*no_document_messages(msgs, None))
    steers = [False, "source", "cad", "knn", "source+cad"]
    evs = run_to_completion(eng, [(ids, SamplingParams(max_tokens=24, snapshot_mode="always", steer=st,
                                                       cad_prompt_ids=cad_ids)) for st in steers])
    plain = text_of(evs[0])
    assert plain
    for st, ev in zip(steers[1:], evs[1:]):
        snaps = [e for e in ev if isinstance(e, SnapshotEvent)]
        assert text_of(ev) and snaps and all(e.steer is not None for e in snaps)
        mech = "+".join(sorted(st.split("+"), key=("cad", "knn", "source").index))
        assert {e.steer["mechanism"] for e in snaps} == {mech}
        for e in snaps:
            assert e.token == e.steer["token"] and e.steer["changed"] == (e.steer["token"] != e.steer["original_token"])
            if "source" in st and e.steer["supported"]:
                assert e.steer["source_span"]["text"].strip()
            if "cad" in st:
                assert 0.0 <= e.steer["alpha"] <= 1.0
    assert all(e.steer is None for e in evs[0] if isinstance(e, SnapshotEvent))
    [again] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=24, snapshot_mode="always"))])
    assert text_of(again) == plain  # steering its neighbours left the observe-only answer as it was


def test_steering_a_prompt_with_nothing_to_ground_in_still_answers(lm, nda_library):
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=2, max_model_len=256))
    ids = chat_ids(lm, "Hi")
    [ev] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=16, snapshot_mode="always", steer="source+cad"))])
    snaps = [e for e in ev if isinstance(e, SnapshotEvent)]
    assert text_of(ev) and snaps
    # no document: cad says so; no entity of the answer is found in the prompt: no source span
    assert all(e.steer["reason"] in ("no_document", "not_entity", "no_supported_candidate") for e in snaps)
    assert all(e.steer["source_span"] is None for e in snaps if e.steer["reason"] == "no_supported_candidate")
    assert all(e.steer["alpha"] is None for e in snaps)


def test_steer_header_and_body_validation(serve):
    url, engine = serve()
    body = {"model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    h = {"anthropic-version": "2023-06-01"}
    r = httpx.post(url + "/v1/messages", json={**body, "steer": True, "snapshot_mode": "off"}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "steer" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-sfcl-steer": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-sfcl-steer"
    r = httpx.post(url + "/v1/chat/completions", json={**body, "steer": True},
                   headers={"x-sfcl-steer": "off", "x-sfcl-snapshot": "off"})
    assert r.status_code == 200  # the header wins over the body
    assert engine.requests[-1].params.steer == ()
    r = httpx.post(url + "/v1/messages", json=body, headers={**h, "x-sfcl-steer": "on"})
    assert r.status_code == 200 and engine.requests[-1].params.steer == DEFAULT_STEER
    for value, expect in (("source", ("source",)), ("source+cad", ("cad", "source")), (["knn"], ("knn",))):
        r = httpx.post(url + "/v1/messages", json={**body, "steer": value}, headers=h)
        assert r.status_code == 200 and engine.requests[-1].params.steer == expect
    # an unknown mechanism is a 400 in each API's own error format, naming the field and the values
    r = httpx.post(url + "/v1/messages", json={**body, "steer": "banana"}, headers=h)
    err = r.json()
    assert r.status_code == 400 and err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert "steer" in err["error"]["message"] and "'source'" in err["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={**body, "steer": "source+banana"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "steer" and "'cad'" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/chat/completions", json={**body, "steer": 3})
    assert r.status_code == 400 and "steer" in r.json()["error"]["message"]


def test_unsupported_number_trigger_fires_on_numbers_the_document_lacks(lm, nda_library):
    """The grounding trigger on the real model: with a document that has no number, every digit the
    answer writes fires ``unsupported_number`` (and only digits do); with a document that has those
    numbers, none does. Observe-only requests record the check for calibration."""
    from sfcl.snapshot.source import canonical_table, is_number

    canon = canonical_table(lm.tokenizer, lm.args.vocab_size)
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=2, max_model_len=512))
    text = ("The Recipient shall hold the Confidential Information in strict confidence, shall use it only for the "
            "Purpose, and shall not disclose it to any third party without the prior written consent of the "
            "Discloser. The obligations of this Agreement survive its termination.")
    ask = "\n\nWhat is the notice period in days?"  # the model answers with a number of days
    without = chat_ids(lm, "Contract:\n" + text + ask)
    with_nums = chat_ids(lm, "Contract:\n" + text + " Notice of termination must be given thirty (30) days in advance."
                         + " Notice of renewal must be given 21 days in advance." + ask)
    evs = run_to_completion(eng, [(ids, SamplingParams(max_tokens=12, snapshot_mode="triggered"))
                                  for ids in (without, with_nums)])
    fired = [[e for e in ev if isinstance(e, SnapshotEvent) and "unsupported_number" in e.triggers] for ev in evs]
    digits = sum(is_number(canon[lm.tokenizer(e.token, add_special_tokens=False)["input_ids"][0]]) for e in fired[0])
    assert fired[0] and digits == len(fired[0])  # it fires, on digit tokens only
    assert not fired[1]  # every number of that answer is in the prompt
    eng.runner.record_signals = True
    seen = []
    inner = eng.runner.execute

    def spy(plan):
        out = inner(plan)
        seen.extend((r.token_id, r.record) for r in out.results.values())
        return out
    eng.runner.execute = spy
    run_to_completion(eng, [(without, SamplingParams(max_tokens=12, snapshot_mode="off"))])
    col = [rec[4] for tok, rec in seen if is_number(canon[tok])]
    assert col and all(v == 1.0 for v in col)
    assert all(math.isnan(rec[4]) for tok, rec in seen if not is_number(canon[tok]))
