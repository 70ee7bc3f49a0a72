"""Engine on the real bundled model with anchors built from real NDAs (ContractNLI)."""

import pytest
import torch
from conftest import contractnli_docs

from sfcl.config import EngineConfig
from sfcl.engine.engine import run_to_completion
from sfcl.engine.events import Finished, SnapshotEvent, Started, TextDelta
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import make_llm_engine

pytestmark = pytest.mark.slow


def chat_ids(lm, content):
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                            add_generation_prompt=True)
    return lm.tokenizer(text, add_special_tokens=False)["input_ids"]


def summarise(events):
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    snaps = [e for e in events if isinstance(e, SnapshotEvent)]
    fin = [e for e in events if isinstance(e, Finished)]
    assert len(fin) == 1 and isinstance(events[0], Started) and events[-1] is fin[0]
    return text, snaps, fin[0]


@pytest.fixture(scope="module")
def nda_prompt(lm):
    doc = contractnli_docs(6)[5].text[:6000]
    return chat_ids(lm, doc + "\n\nHow long does this agreement last, and how can it be terminated? "
                               "Quote the relevant clause.")


def test_greedy_text_identical_across_snapshot_modes(lm, nda_library, nda_prompt):
    # each mode computes the prompt cold: a prefix-cache hit multiplies other row counts, which in bf16 round
    # differently and can flip a near tie (README), a difference that is not the mode's
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=4, prefix_cache_tokens=0))
    res = {}
    for mode in ("off", "triggered", "always"):
        [ev] = run_to_completion(eng, [(nda_prompt, SamplingParams(max_tokens=96, snapshot_mode=mode))])
        res[mode] = summarise(ev)
    texts = {m: r[0] for m, r in res.items()}
    assert texts["off"] and texts["off"] == texts["triggered"] == texts["always"]
    n_out = res["always"][2].completion_tokens
    assert len(res["off"][1]) == 0
    assert len(res["always"][1]) == n_out  # one lookup per generated token
    assert 0 < len(res["triggered"][1]) < n_out  # the triggers fire, but on far fewer tokens
    for s in res["triggered"][1]:
        assert 0 <= s.anchor_id < nda_library.n_anchors and 0.0 <= s.confidence <= 1.0
        assert s.trigger in ("entity_low_confidence", "attention_dispersion", "surprisal_deviation")
        assert [h.anchor_id for h in s.top][0] == s.anchor_id and len(s.top) == 3
        assert s.top[0].score >= s.top[1].score >= s.top[2].score
        assert s.top[0].span["doc_id"].startswith("dev:")
    summary = res["triggered"][2].snapshot_summary
    assert summary["lookups"] == len(res["triggered"][1]) and sum(summary["triggers"].values()) >= summary["lookups"]


def test_concurrent_requests_batch_and_finish_independently(lm, nda_library):
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=4))
    prompts = [chat_ids(lm, q) for q in ("Name three colours.", "What is 2+2?", "Say hello in French.",
                                          "List two prime numbers.", "What is a contract?")]
    params = [SamplingParams(max_tokens=n) for n in (12, 20, 8, 30, 16)]
    batched = run_to_completion(eng, list(zip(prompts, params)))
    assert eng.runner.kv.n_slots == 4  # 5 requests through 4 slots: one waited, slots were reused
    for ev, p in zip(batched, params):
        text, _, fin = summarise(ev)
        assert fin.completion_tokens <= p.max_tokens and text
        assert fin.stop_reason in ("end_turn", "max_tokens")
        if fin.stop_reason == "max_tokens":
            assert fin.completion_tokens == p.max_tokens
    # batched decoding matches one-at-a-time decoding for the first tokens (bf16 GEMMs may round
    # differently at other batch sizes, so compare a prefix)
    alone = run_to_completion(eng, [(prompts[1], params[1])])
    a, b = summarise(alone[0])[0], summarise(batched[1])[0]
    assert a[:8] == b[:8]


def test_stop_sequence_and_max_tokens(lm, nda_library):
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=2))
    ids = chat_ids(lm, "Count from 1 to 20, separated by commas.")
    [free] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=40, snapshot_mode="off"))])
    text, _, _ = summarise(free)
    assert "5" in text
    [stopped] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=40, stop=["5"], snapshot_mode="off"))])
    t2, _, fin = summarise(stopped)
    assert fin.stop_reason == "stop_sequence" and fin.stop_sequence == "5"
    assert t2 == text[: text.index("5")]
    [short] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=3))])
    assert summarise(short)[2].completion_tokens == 3 and summarise(short)[2].stop_reason == "max_tokens"


def test_seeded_sampling_is_reproducible(lm, nda_library):
    # no prefix cache: the second run would restore the prompt's KV instead of computing it, and in
    # bf16 restored and computed logits can round apart (seen on an Intel Xeon with AMX)
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=2, prefix_cache_tokens=0))
    ids = chat_ids(lm, "Write a sentence about a lease.")
    p = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=123, snapshot_mode="off")
    a = summarise(run_to_completion(eng, [(ids, p)])[0])[0]
    b = summarise(run_to_completion(eng, [(ids, SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=123,
                                                              snapshot_mode="off"))])[0])[0]
    c = summarise(run_to_completion(eng, [(ids, SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7,
                                                              snapshot_mode="off"))])[0])[0]
    assert a == b and a != c


def test_a_failing_request_does_not_take_down_its_batch(lm, nda_library):
    """An error in one request's update ends that request with an ErrorEvent; the others finish."""
    from sfcl.engine.events import ErrorEvent

    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=4))
    ids = [chat_ids(lm, q) for q in ("Say yes.", "Say no.", "Say maybe.")]
    params = [SamplingParams(max_tokens=10, snapshot_mode="off") for _ in ids]
    for i, (p, sp) in enumerate(zip(ids, params)):
        eng.add_request(f"r{i}", p, sp)
    bad = eng.requests["r1"]

    class Boom:
        def add(self, token_id):
            raise RuntimeError("boom")

        def flush(self):
            return ""

    bad.detok = Boom()
    seen: dict[str, list] = {"r0": [], "r1": [], "r2": []}
    while eng.has_work():
        for rid, ev in eng.step():
            seen[rid].append(ev)
    assert isinstance(seen["r1"][-1], ErrorEvent) and "internal error" in seen["r1"][-1].message
    assert isinstance(seen["r0"][-1], Finished) and isinstance(seen["r2"][-1], Finished)
    assert eng.scheduler.num_running == 0 and eng.requests == {}


@pytest.fixture(scope="module")
def fp32(cache_dir):
    from sfcl.model.loader import load_model

    return load_model(None, dtype=torch.float32, cache_dir=cache_dir)


def greedy(eng, ids, n=24):
    [ev] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=n, snapshot_mode="off"))])
    return [e for e in ev if isinstance(e, Finished)][0], "".join(e.text for e in ev if isinstance(e, TextDelta))


def test_chunked_prefill_and_prefix_cache_hits_keep_greedy_output_exact_in_fp32(fp32, nda_prompt):
    whole = make_llm_engine(fp32, None, EngineConfig(max_num_seqs=2, max_num_batched_tokens=8192,
                                                     prefix_cache_tokens=0))
    _, ref = greedy(whole, nda_prompt)
    eng = make_llm_engine(fp32, None, EngineConfig(max_num_seqs=2, max_num_batched_tokens=64,
                                                   prefix_cache_tokens=4096))
    _, cold = greedy(eng, nda_prompt)  # 64-token chunks
    assert cold == ref and eng.scheduler.prefix.hits == 0
    fin, warm = greedy(eng, nda_prompt)  # the whole prompt but its last block comes from the cache
    assert warm == ref
    assert eng.scheduler.prefix.hits == (len(nda_prompt) - 1) // 16 * 16
    assert eng.last_stats is not None
    # another question over the same document reuses the document's blocks
    other = nda_prompt[:-40] + nda_prompt[-40:][::-1]
    before = eng.scheduler.prefix.hits
    greedy(eng, other, n=4)
    assert eng.scheduler.prefix.hits - before >= (len(nda_prompt) - 40) // 16 * 16


def test_running_streams_keep_decoding_while_a_long_prompt_prefills_in_chunks(lm, nda_prompt):
    eng = make_llm_engine(lm, None, EngineConfig(max_num_seqs=4, max_num_batched_tokens=128, prefix_cache_tokens=0))
    short = chat_ids(lm, "Count from 1 to 50.")
    eng.add_request("short", short, SamplingParams(max_tokens=40, snapshot_mode="off"))
    eng.step()  # the short prompt prefills and samples its first token
    eng.add_request("long", nda_prompt, SamplingParams(max_tokens=4, snapshot_mode="off"))
    steps_while_prefilling = 0
    while not eng.requests["long"].seq.output_ids:
        ev = eng.step()
        st = eng.last_stats
        assert st.decode_batch == 1 and any(rid == "short" for rid, _ in ev)  # the stream moved on
        assert st.prefill_tokens <= 128 - 1
        steps_while_prefilling += 1
    assert steps_while_prefilling >= len(nda_prompt) // 127


def test_int8_kv_cache_follows_model_dtype_logits(lm, nda_prompt):
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import AttnBatch

    def final_logits(kv_dtype):
        kv = KVCache(lm.args, 1, 4096, lm.model.embed_tokens.weight.dtype, kv_dtype=kv_dtype)
        T = len(nda_prompt)
        for a in range(0, T, 256):  # chunked, so later chunks attend to the stored (quantized) KV
            b = min(T, a + 256)
            out = lm.model(torch.tensor([nda_prompt[a:b]]), AttnBatch(True, torch.tensor([0]), torch.arange(a, b), b),
                           kv, 3, want_probs=False)
        return out.logits[0].float()

    ref, q = final_logits("auto"), final_logits("int8")
    kl = torch.nn.functional.kl_div(q.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="sum")
    assert ref.argmax() == q.argmax() and float(kl) < 0.02

    def decode_logits(kv_dtype, n=8):  # teacher-forced one-token decode steps over the stored KV
        kv = KVCache(lm.args, 2, 4096, lm.model.embed_tokens.weight.dtype, kv_dtype=kv_dtype)
        T = len(nda_prompt) - n
        lm.model(torch.tensor([nda_prompt[:T]]), AttnBatch(True, torch.tensor([0]), torch.arange(T), T), kv, 3,
                 want_probs=False)
        rows = []
        for t in range(T, T + n):
            kv.ensure_initialized(1, t + 1)
            mask = torch.ones(1, 1, 1, t + 1, dtype=torch.bool)
            out = lm.model(torch.tensor([[nda_prompt[t]]]), AttnBatch(False, torch.arange(1), torch.tensor([t]), t + 1,
                                                                     mask, (0, 1)), kv, 3)
            rows.append(out.logits[0].float())
        return torch.stack(rows)

    ref_d, q_d = decode_logits("auto"), decode_logits("int8")
    assert torch.isfinite(q_d).all()
    assert (ref_d.argmax(-1) == q_d.argmax(-1)).float().mean() >= 0.75
    eng = make_llm_engine(lm, None, EngineConfig(max_num_seqs=2, kv_cache_dtype="int8"))
    fin, text = greedy(eng, nda_prompt, n=12)
    assert text and fin.completion_tokens >= 1


def test_a_repeated_request_reproduces_the_cold_answer_in_bf16(lm):
    eng = make_llm_engine(lm, None, EngineConfig(max_num_seqs=2))
    ids = chat_ids(lm, "Explain in two sentences what a confidentiality clause is for.")
    _, cold = greedy(eng, ids, n=32)
    hits = eng.scheduler.prefix.hits
    _, warm = greedy(eng, ids, n=32)
    assert eng.scheduler.prefix.hits - hits == (len(ids) - 1) // 16 * 16 > 0
    assert warm == cold


def test_prompt_steps_run_on_prefill_threads_and_decode_steps_on_decode_threads(lm, nda_prompt, monkeypatch):
    """--prefill-threads: a step computing >= 64 prompt tokens runs on the prefill count, every
    other step (decode, short prompts) on the decode count; the caller's count is irrelevant."""
    from sfcl.engine.model_runner import PREFILL_THREADS_MIN_TOKENS
    from sfcl.model.llama import LlamaModel

    eng = make_llm_engine(lm, None, EngineConfig(max_num_seqs=2, prefill_threads=2, prefix_cache_tokens=0),
                          decode_threads=1)
    seen = []  # (prompt tokens in the step, torch threads during its forward)
    fwd = LlamaModel.forward_step

    def spy(self, ids, step, *a, **k):
        seen.append((sum(c.length for c in step.chunks), torch.get_num_threads()))
        return fwd(self, ids, step, *a, **k)

    # On the class, undone at teardown: `lm` is the session's shared model, and an instance
    # attribute set here outlived the test (a closure over this model's bound method, which
    # copy.deepcopy(lm.model) carried along, so a quantized copy later ran these bf16 weights).
    monkeypatch.setattr(LlamaModel, "forward_step", spy)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        long_p, short_p = nda_prompt[:100], nda_prompt[:20]
        run_to_completion(eng, [(long_p, SamplingParams(max_tokens=3)), (short_p, SamplingParams(max_tokens=3))])
    finally:
        torch.set_num_threads(before)
    assert any(n >= PREFILL_THREADS_MIN_TOKENS for n, _ in seen) and any(n == 0 for n, _ in seen)
    for n, threads in seen:
        assert threads == (2 if n >= PREFILL_THREADS_MIN_TOKENS else 1), seen


def test_engine_config_rejects_zero_prefill_threads():
    with pytest.raises(ValueError, match="prefill_threads"):
        EngineConfig(prefill_threads=0)


def test_a_finished_request_gives_its_kv_memory_back(lm, nda_prompt):
    """Scheduler -> runner -> KV cache: the slot a finished request held is released in the next
    step (its pages beyond ``keep_positions`` return to the OS) and reads as zeros there."""
    from tests.test_kv_cache import _resident

    eng = make_llm_engine(lm, None, EngineConfig(max_num_seqs=2, prefix_cache_tokens=0))
    kv = eng.runner.kv
    rows = kv.k + kv.v
    before = _resident(rows)
    eng.add_request("long", nda_prompt, SamplingParams(max_tokens=2, snapshot_mode="off", ignore_eos=True))
    while not eng.requests["long"].seq.output_ids:
        eng.step()
    held = _resident(rows) - before
    n = len(nda_prompt)
    assert held >= 0.9 * (n - kv.keep_positions) * kv.bytes_per_token
    while eng.has_work():
        eng.step()
    assert kv.hwm[0] == kv.keep_positions
    assert _resident(rows) - before < held * (kv.keep_positions + 64) / n
    k, v = kv.read(0, slice(0, 1), n)
    assert float(k[:, :, kv.keep_positions + 32:].abs().sum()) == 0
