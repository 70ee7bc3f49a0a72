"""Overlapped anchor lookups (``ModelRunner(overlap_lookup=True)``, ``sfcl serve --overlap-lookup``): a step's batched
search runs on the lookup thread during the next step. Same snapshots and tokens as searching
inside the step; each event follows its token's text and precedes ``Finished``; a step whose
search includes a steering row searches in the step; an abort or a failed search touches only its
own request."""

from __future__ import annotations

import logging
import threading

import pytest

from sfcl.config import EngineConfig
from sfcl.engine.events import ErrorEvent, Finished, SnapshotEvent, Started, TextDelta
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import make_llm_engine
from sfcl.snapshot.steering import SteerConfig

pytestmark = pytest.mark.slow

CLAUSE = ("The Receiving Party shall hold the Confidential Information in strict confidence for a period of "
          "five (5) years from the Effective Date of 1 March 2021. ")
REQS = [("triggered", False, "Who may receive the information?"),
        ("always", False, "Summarise the obligations in one sentence."),
        ("always", "knn", "For how many years must the information be kept confidential?")]


def chat(lm, text):
    t = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return lm.tokenizer(t, add_special_tokens=False)["input_ids"]


def engine(lm, lib, overlap: bool):
    eng = make_llm_engine(lm, lib, EngineConfig(max_num_seqs=4, prefix_cache_tokens=0, overlap_lookup=overlap))
    eng.runner.snapshotter.steer = SteerConfig(lambda_max=1.0)
    threads: list[str] = []
    real = eng.runner.snapshotter.lookup

    def spy(*a, **k):  # which thread searched
        threads.append(threading.current_thread().name)
        return real(*a, **k)

    eng.runner.snapshotter.lookup = spy
    return eng, threads


def drive(eng, lm, reqs, max_tokens=16, on_step=None):
    events: dict[str, list] = {}
    for i, (mode, steer, q) in enumerate(reqs):
        p = SamplingParams(max_tokens=max_tokens, snapshot_mode=mode, steer=steer, ignore_eos=True,
                           temperature=1.0 if steer else 0.0, seed=5)
        events[f"r{i}"] = [e for _, e in eng.add_request(f"r{i}", chat(lm, CLAUSE + q), p)]
    lookups, n = 0, 0
    while eng.has_work():
        for rid, e in eng.step():
            events[rid].append(e)
        lookups += eng.last_stats.lookups
        n += 1
        if on_step:
            on_step(n)
    return events, lookups


def view(e: SnapshotEvent):
    return (e.token_index, e.token, e.token_logprob, e.triggers, e.anchor_id, e.confidence, e.steer,
            [(t.anchor_id, t.score, t.kind) for t in e.top])


def order_ok(events, after: bool) -> bool:
    """Each snapshot event comes right after its token's text (after=True: overlapped) or
    before it (searched in the step), and never after a later token's text."""
    seen = -1  # highest token index whose text has been streamed
    for e in events:
        if isinstance(e, TextDelta):
            seen = max(seen, e.token_index)
        elif isinstance(e, SnapshotEvent) and not (seen == e.token_index if after else seen < e.token_index):
            return False
    return True


def test_overlapped_lookups_give_the_same_snapshots_after_their_tokens(lm, nda_library):
    reqs = REQS[:2]  # triggered, always; no steering
    sync, t_sync = engine(lm, nda_library, overlap=False)
    ev_s, look_s = drive(sync, lm, reqs)
    over, t_over = engine(lm, nda_library, overlap=True)
    ev_o, look_o = drive(over, lm, reqs)
    over.runner.close()
    assert set(t_sync) == {threading.current_thread().name} and set(t_over) == {"sfcl-lookup_0"}
    for rid in ev_s:
        text = ["".join(e.text for e in ev[rid] if isinstance(e, TextDelta)) for ev in (ev_s, ev_o)]
        assert text[0] and text[0] == text[1]
        snaps = [[view(e) for e in ev[rid] if isinstance(e, SnapshotEvent)] for ev in (ev_s, ev_o)]
        assert snaps[0] == snaps[1]  # same rows per search: the same numbers, bit for bit
        assert [e.snapshot_summary for e in ev_s[rid] if isinstance(e, Finished)] == \
               [e.snapshot_summary for e in ev_o[rid] if isinstance(e, Finished)]
        assert isinstance(ev_o[rid][0], Started) and isinstance(ev_o[rid][-1], Finished)
        assert order_ok(ev_s[rid], after=False) and order_ok(ev_o[rid], after=True)
        if snaps[0]:  # the triggered request fires on few of its 16 tokens, maybe none (calibrated to ~1 in 16)
            assert not order_ok(ev_o[rid], after=False)  # the check can tell the two orders apart
    assert look_s == look_o == sum(1 for ev in ev_o.values() for e in ev if isinstance(e, SnapshotEvent))
    assert len([e for e in ev_o["r1"] if isinstance(e, SnapshotEvent)]) == 16  # always: the last one too


def test_a_step_with_a_steering_row_searches_in_the_step(lm, nda_library):
    """One batched search per step: when a looked-up row steers, the whole search runs in the step."""
    eng, threads = engine(lm, nda_library, overlap=True)
    ev, _ = drive(eng, lm, [REQS[1], REQS[2]])  # always (plain) + always with steering: every step steers
    eng.runner.close()
    assert set(threads) == {threading.current_thread().name}
    for rid in ev:
        assert len([e for e in ev[rid] if isinstance(e, SnapshotEvent)]) == 16 and order_ok(ev[rid], after=False)
    assert any(e.steer is not None for e in ev["r1"] if isinstance(e, SnapshotEvent))


def test_abort_with_a_lookup_in_flight_and_a_failed_search_touch_only_their_request(lm, nda_library, caplog):
    eng, _ = engine(lm, nda_library, overlap=True)
    real = eng.runner.snapshotter.lookup
    calls = [0]

    def flaky(*a, **k):  # the 3rd overlapped search raises
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("search failed")
        return real(*a, **k)

    eng.runner.snapshotter.lookup = flaky
    reqs = [("always", False, "Who may receive the information?"),
            ("always", False, "Summarise the obligations in one sentence.")]

    def abort_r0(n):
        if n == 4:
            assert "r0" in eng.pending  # its last token's search is in flight
            eng.abort("r0")

    with caplog.at_level(logging.ERROR, logger="sfcl.engine"):
        events, _ = drive(eng, lm, reqs, max_tokens=12, on_step=abort_r0)
    eng.runner.close()
    assert "anchor lookup for request" in caplog.text
    assert not eng.pending and not eng.requests
    r1 = events["r1"]
    assert isinstance(r1[-1], Finished) and r1[-1].completion_tokens == 12
    assert not any(isinstance(e, ErrorEvent) for ev in events.values() for e in ev)
    # both prompts prefill in step 1, so each search has both rows: the failed 3rd costs r1 one event
    n1 = sum(isinstance(e, SnapshotEvent) for e in r1)
    assert n1 == 11 and r1[-1].snapshot_summary["lookups"] == 11
    assert not any(isinstance(e, Finished) for e in events["r0"])
