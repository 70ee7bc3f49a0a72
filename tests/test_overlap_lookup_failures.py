"""Break-it tests for overlapped anchor lookups (``ModelRunner(overlap_lookup=True)``).

* A request whose overlapped lookup cannot be turned into its snapshot event (bookkeeping error
  in ``LLMEngine._snapshot_event``) must cost that request only, as it does when the lookup ran in
  the step (``_advance`` catches per request); it must not fail the whole step.
* Starting the lookup thread (``torch.set_num_threads(1)`` in its initializer) must not leave
  torch's process-wide default thread count at 1 for threads started later (the SIGHUP and
  HTTP reload threads build the new library's search copies on it).
"""

from __future__ import annotations

import re
import threading

import pytest
import torch

from sfcl.config import EngineConfig
from sfcl.engine.events import ErrorEvent, Finished, SnapshotEvent
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import make_llm_engine

pytestmark = pytest.mark.slow

PROMPT = ("The Receiving Party shall hold the Confidential Information in strict confidence for five (5) "
          "years. Who may receive the information?")


def chat(lm, text):
    t = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return lm.tokenizer(t, add_special_tokens=False)["input_ids"]


def run(eng, lm, n=2, max_tokens=6):
    events: dict[str, list] = {}
    ids = chat(lm, PROMPT)
    for i in range(n):
        p = SamplingParams(max_tokens=max_tokens, snapshot_mode="always", ignore_eos=True, temperature=0.0)
        events[f"r{i}"] = [e for _, e in eng.add_request(f"r{i}", ids, p)]
    while eng.has_work():
        for rid, e in eng.step():
            events[rid].append(e)
    return events


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_a_failed_snapshot_event_costs_only_its_request(lm, nda_library, overlap):
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=4, prefix_cache_tokens=0,
                                                        overlap_lookup=overlap))
    real = eng._snapshot_event

    def broken(st, res, hit, idx):  # r0's third snapshot cannot be built
        if st.seq.request_id == "r0" and idx == 2:
            raise KeyError("span of a vanished anchor")
        return real(st, res, hit, idx)

    eng._snapshot_event = broken
    try:
        events = run(eng, lm)
    finally:
        eng.runner.close()
    assert isinstance(events["r0"][-1], ErrorEvent)
    assert not any(isinstance(e, Finished) for e in events["r0"])
    r1 = events["r1"]
    assert isinstance(r1[-1], Finished) and r1[-1].completion_tokens == 6
    assert sum(isinstance(e, SnapshotEvent) for e in r1) == 6
    assert not eng.requests and not eng.pending


def test_lookup_thread_leaves_the_process_wide_thread_count(lm, nda_library):
    def fresh_thread_count() -> int:
        got = []
        t = threading.Thread(target=lambda: got.append(torch.get_num_threads()))
        t.start()
        t.join()
        return got[0]

    main = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert fresh_thread_count() == 2
        eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=4, prefix_cache_tokens=0,
                                                            overlap_lookup=True))
        try:
            run(eng, lm, n=1, max_tokens=3)
            assert eng.runner._lookup_pool is not None  # the lookup thread did start
        finally:
            eng.runner.close()
        assert torch.get_num_threads() == 2  # this (engine) thread's own count
        assert fresh_thread_count() == 2  # and the default a new thread starts with
    finally:
        torch.set_num_threads(main)


def test_lookup_thread_keeps_one_thread_when_the_engine_sets_more(lm, nda_library):
    """The lookup thread's count is set for good (sfcl.engine.threads.set_thread_count): torch's
    lazy per-thread init at its first parallel op must not replace it with the process-wide
    count the engine thread restores (it did: the lookup thread ran 2-thread OpenMP regions and
    kept a second pool, which slowed every prompt chunk of the engine's afterwards)."""
    main = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=4, prefix_cache_tokens=0,
                                                            overlap_lookup=True))
        try:
            run(eng, lm, n=1, max_tokens=3)
            assert eng.runner._lookup_pool is not None
            assert eng.runner._lookup_pool.submit(torch.get_num_threads).result() == 1
        finally:
            eng.runner.close()
    finally:
        torch.set_num_threads(main)


def test_reload_with_lookups_in_flight_keeps_the_old_version_until_its_last_request(lm, nda_library):
    """Swap the library (as ``AsyncEngine.reload_anchors`` does, between steps) while a lookup of
    the old version is in flight, and drop every outside reference to the old library: the pending
    search and the running request finish on the old version, a new request runs on the new one,
    and the old library (its memory map) is released once its last request ended."""
    import gc
    import weakref

    from sfcl.config import SnapshotConfig
    from sfcl.engine_stack import make_reloader
    from sfcl.library.versions import load_library

    old_lib = load_library(nda_library.path, expect_fingerprint=lm.fingerprint)
    gone = weakref.ref(old_lib)
    eng = make_llm_engine(lm, old_lib, EngineConfig(max_num_seqs=4, prefix_cache_tokens=0, overlap_lookup=True))
    p = SamplingParams(max_tokens=6, snapshot_mode="always", ignore_eos=True, temperature=0.0)
    ids = chat(lm, PROMPT)
    events = {"r0": [e for _, e in eng.add_request("r0", ids, p)]}
    for _ in range(2):
        for rid, e in eng.step():
            events[rid].append(e)
    assert "r0" in eng.pending
    new_lib, new_snap = make_reloader(lm, SnapshotConfig(anchors=str(nda_library.path)))(None)
    eng.swap_library(new_lib, new_snap)
    del old_lib
    gc.collect()
    assert gone() is not None and gone().vectors is not None  # r0 still runs on it
    events["r1"] = [e for _, e in eng.add_request("r1", ids, p)]
    assert eng.runner.bindings["r1"].snap is new_snap and eng.runner.bindings["r0"].snap.lib is gone()
    try:
        while eng.has_work():
            for rid, e in eng.step():
                events[rid].append(e)
    finally:
        eng.runner.close()
    for rid in ("r0", "r1"):
        assert isinstance(events[rid][-1], Finished) and events[rid][-1].completion_tokens == 6
        assert sum(isinstance(e, SnapshotEvent) for e in events[rid]) == 6
        assert not any(isinstance(e, ErrorEvent) for e in events[rid])
    assert eng.runner.bindings == {} and not eng.pending
    gc.collect()
    assert gone() is None  # nothing (a finished future, a SeqResult) pins the old version


def test_cut_all_with_a_pending_lookup_whose_event_fails(lm, nda_library):
    """Graceful shutdown past its deadline (``cut_all``, run by the engine thread outside any
    per-request guard) resolves the overlapped lookups and ends every request with an
    ``overloaded_error``: one whose snapshot event cannot be built still gets its error, and
    nothing raises out of the engine thread's command handler."""
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=4, prefix_cache_tokens=0, overlap_lookup=True))
    real = eng._snapshot_event
    broken = {"on": False}

    def maybe_broken(st, res, hit, idx):
        if broken["on"] and st.seq.request_id == "r0":
            raise KeyError("span of a vanished anchor")
        return real(st, res, hit, idx)

    eng._snapshot_event = maybe_broken
    ids = chat(lm, PROMPT)
    for rid in ("r0", "r1"):
        eng.add_request(rid, ids, SamplingParams(max_tokens=50, snapshot_mode="always", ignore_eos=True,
                                                 temperature=0.0))
    try:
        for _ in range(3):
            eng.step()
        assert set(eng.pending) == {"r0", "r1"}
        broken["on"] = True
        events = eng.cut_all()
    finally:
        eng.runner.close()
    by = {rid: [e for r, e in events if r == rid] for rid in ("r0", "r1")}
    assert all(isinstance(by[r][-1], ErrorEvent) and by[r][-1].type == "overloaded_error" for r in by)
    assert re.search(r"stopped after [1-9]\d* output tokens", by["r1"][-1].message)
    assert isinstance(by["r1"][0], SnapshotEvent)  # r1's overlapped lookup is delivered before its error
    assert not eng.requests and not eng.pending and eng.scheduler.num_running == 0


def test_engine_thread_counts_hold_with_lookups_overlapped(lm, nda_library, monkeypatch):
    """--prefill-threads with the lookup thread running: every forward of the engine thread still
    runs on the prefill count (prompt steps) or the decode count (the rest), before and after the
    lookup thread started (its ``torch.set_num_threads(1)``)."""
    from sfcl.engine.model_runner import PREFILL_THREADS_MIN_TOKENS

    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=2, prefill_threads=2, prefix_cache_tokens=0,
                                                        overlap_lookup=True), decode_threads=1)
    seen = []  # (prompt tokens in the step, torch threads during its forward, lookup thread started)
    fwd = eng.runner.model.forward_step

    def spy(ids, step, *a, **k):
        seen.append((sum(c.length for c in step.chunks), torch.get_num_threads(),
                     eng.runner._lookup_pool is not None))
        return fwd(ids, step, *a, **k)

    # on the instance, through monkeypatch: it also puts back an instance attribute an earlier test
    # may have left on the session's shared model (tests/test_engine.py did, before a fix elsewhere)
    monkeypatch.setattr(eng.runner.model, "forward_step", spy)
    before = torch.get_num_threads()
    ids = chat(lm, PROMPT * 3)
    assert len(ids) >= PREFILL_THREADS_MIN_TOKENS
    p = SamplingParams(max_tokens=4, snapshot_mode="always", ignore_eos=True, temperature=0.0)
    try:
        eng.add_request("r0", ids, p)
        for _ in range(3):
            eng.step()
        eng.add_request("r1", ids[:-1], p)  # a second prompt once the lookup thread runs
        while eng.has_work():
            eng.step()
    finally:
        eng.runner.close()
        torch.set_num_threads(before)
    assert any(started and n >= PREFILL_THREADS_MIN_TOKENS for n, _, started in seen)
    assert any(started and n == 0 for n, _, started in seen)
    for n, threads, _ in seen:
        assert threads == (2 if n >= PREFILL_THREADS_MIN_TOKENS else 1), seen
