"""Scheduler: admission, chunked prefill, slot layout, prefix-cache planning. Pure Python, no model."""

import pytest

from sfcl.engine.request import RequestStatus, SamplingParams
from sfcl.engine.block_manager import block_hashes
from sfcl.engine.scheduler import DecodeGroup, QueueFullError, Scheduler, SchedulerConfig, Sequence, decode_groups


def make_requests(n, prompt_len=4, max_tokens=8, base=1):
    return [Sequence(request_id=f"r{i}", prompt_ids=list(range(base, base + prompt_len)),
                     params=SamplingParams(max_tokens=max_tokens)) for i in range(n)]


def run_step(s, token=7):
    """schedule + pretend the runner ran: every sampled sequence gets one token."""
    out = s.schedule()
    s.step_done()
    for q in out.sampled:
        q.output_ids.append(token)
    return out


def test_short_prompts_are_admitted_together_and_sampled_on_their_last_chunk():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_seqs=2))
    for r in make_requests(3):
        s.add(r)
    out = run_step(s)
    assert [(c.seq.request_id, c.start, c.end, c.is_last) for c in out.prefill] == [("r0", 0, 4, True), ("r1", 0, 4, True)]
    assert [q.slot for q in out.sampled] == [0, 1] and out.decode == []
    assert out.sampled[0].status is RequestStatus.RUNNING and s.num_waiting == 1
    out = run_step(s)
    assert [q.request_id for q in out.decode] == ["r0", "r1"] and [c.seq.request_id for c in out.prefill] == ["r2"]
    assert out.prefill[0].seq.slot == 2


def test_max_num_seqs_caps_running():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_prefill_seqs=4))
    for r in make_requests(3):
        s.add(r)
    out = run_step(s)
    assert len(out.prefill) == 2 and s.num_waiting == 1
    out = run_step(s)
    assert out.prefill == [] and len(out.decode) == 2


def test_long_prompt_is_chunked_on_block_boundaries_within_the_token_budget():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=40, block_size=16)
    s = Scheduler(cfg)
    short, = make_requests(1)
    s.add(short)
    run_step(s)
    long_ = Sequence("long", list(range(100, 200)), SamplingParams(max_tokens=4))  # 100 prompt tokens
    s.add(long_)
    spans = []
    while not long_.output_ids:
        out = run_step(s)
        assert [q.request_id for q in out.decode] == ["r0"]  # the running stream decodes every step
        assert sum(c.end - c.start for c in out.prefill) + len(out.decode) <= cfg.max_num_batched_tokens
        spans += [(c.start, c.end, c.is_last) for c in out.prefill]
    # budget 40 - 1 decode row = 39 -> 32-token (2-block) chunks until the rest (36) fits whole
    assert spans == [(0, 32, False), (32, 64, False), (64, 100, True)]
    out = run_step(s)
    assert [q.request_id for q in out.decode] == ["r0", "long"] and [q.slot for q in out.decode] == [0, 1]


def test_finish_compacts_decode_slots_with_a_kv_move():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_seqs=4))
    reqs = make_requests(4)
    for r in reqs:
        s.add(r)
    run_step(s)
    s.finish(reqs[1], "end_turn")
    out = s.schedule()
    assert [(m.src, m.dst, m.length) for m in out.moves] == [(3, 1, 4)]  # 4 prompt tokens have KV
    assert [q.request_id for q in out.decode] == ["r0", "r3", "r2"]
    assert [q.slot for q in out.decode] == [0, 1, 2]
    assert reqs[1].status is RequestStatus.FINISHED and reqs[1].slot == -1
    # slot 1 was vacated but KV was moved into it; slot 3 was left by the move: only 3 is released
    assert out.release == [3]
    assert run_step(s).release == []  # listed once


def test_finishing_the_last_slot_needs_no_move():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_seqs=4))
    reqs = make_requests(3)
    for r in reqs:
        s.add(r)
    run_step(s)
    s.finish(reqs[2], "max_tokens")
    s.finish(reqs[0], "max_tokens")
    out = s.schedule()
    assert [(m.src, m.dst) for m in out.moves] == [(1, 0)]
    assert [q.request_id for q in out.decode] == ["r1"] and reqs[1].slot == 0


def test_a_prefilling_sequence_in_the_decode_region_is_swapped_out_via_the_scratch_row():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=20, block_size=16, max_prefill_seqs=2))
    y = Sequence("y", list(range(40)), SamplingParams(max_tokens=2))  # long: slot 0, chunk 0..16
    x = Sequence("x", [1, 2], SamplingParams(max_tokens=9))  # short: slot 1, completes in the same step
    s.add(y)
    s.add(x)
    out = run_step(s)
    assert (y.slot, x.slot) == (0, 1) and [(c.seq.request_id, c.start, c.end) for c in out.prefill] == [
        ("x", 0, 2), ("y", 0, 16)]  # the short prompt first
    out = s.schedule()  # x decodes and must sit in slot 0, where y's 16 computed positions live
    assert [(m.src, m.dst, m.length) for m in out.moves] == [(0, 2, 16), (1, 0, 2), (2, 1, 16)]
    assert (x.slot, y.slot) == (0, 1) and out.decode == [x] and out.prefill[0].seq is y
    assert out.release == [2]  # the scratch row, after the swap


def test_a_slot_left_by_a_finished_sequence_is_released_even_when_reused_in_the_same_step():
    """Released after the moves and before any write: the newcomer has no KV there yet."""
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_prefill_seqs=2))
    a, b, c = make_requests(3)
    s.add(a)
    s.add(b)
    run_step(s)
    s.add(c)
    s.finish(b, "end_turn")  # slot 1, the last decode slot: no move
    out = run_step(s)
    assert c.slot == 1 and out.release == [1] and out.moves == []
    assert [(ch.seq.request_id, ch.start) for ch in out.prefill] == [("r2", 0)]
    s.abort("r0")  # slot 0: r2 moves down into it and leaves slot 1
    out = s.schedule()
    assert [(m.src, m.dst) for m in out.moves] == [(1, 0)] and out.release == [1]


def test_a_release_alone_makes_a_step():
    """An idle engine still gives a finished sequence's KV memory back."""
    s = Scheduler(SchedulerConfig(max_num_seqs=2))
    a, = make_requests(1)
    s.add(a)
    run_step(s)
    s.finish(a, "end_turn")
    out = s.schedule()
    assert out.release == [0] and out.decode == [] and out.prefill == [] and not out.is_empty


def test_prefix_cache_restores_the_shared_prompt_blocks_and_counts_hits():
    cfg = SchedulerConfig(max_num_seqs=4, block_size=4, prefix_cache_blocks=8, max_num_batched_tokens=64)
    s = Scheduler(cfg)
    doc = list(range(100, 113))  # 13 tokens: (13-1)//4 = 3 full blocks may be cached
    a = Sequence("a", doc, SamplingParams(max_tokens=2))
    s.add(a)
    out = run_step(s)
    assert out.restores == [] and out.prefix_queries == 13 and out.prefix_hits == 0
    assert [(w.slot, w.first_block, len(w.pool_blocks)) for w in out.saves] == [(0, 0, 3)]
    b = Sequence("b", doc + [1, 2, 3], SamplingParams(max_tokens=2))  # same document, another question
    s.add(b)
    out = run_step(s)
    assert [(r.slot, r.first_block, r.pool_blocks) for r in out.restores] == [(1, 0, a.block_table)]
    assert out.prefix_hits == 12 and b.cached_tokens == 12
    assert [(c.start, c.end) for c in out.prefill] == [(12, 16)]  # only the rest is computed
    assert [(w.first_block, len(w.pool_blocks)) for w in out.saves] == []  # block 3 (12..16) is not full-below-last
    assert s.prefix.blocks[a.block_table[0]].ref == 2
    s.finish(a, "end_turn")
    s.finish(b, "end_turn")
    assert all(blk.ref == 0 for blk in s.prefix.blocks) and s.prefix.num_free == 8
    # a third request with a different first block shares nothing (hashes are chained)
    c = Sequence("c", [9] + doc[1:], SamplingParams(max_tokens=2))
    s.add(c)
    out = run_step(s)
    assert out.prefix_hits == 0 and out.restores == []


def test_blocks_saved_in_a_step_are_not_restored_before_that_step_ran():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, block_size=4, prefix_cache_blocks=8, max_num_batched_tokens=64))
    doc = list(range(100, 113))
    a = Sequence("a", doc, SamplingParams(max_tokens=2))
    s.add(a)
    out = s.schedule()
    assert [w.slot for w in out.saves] == [a.slot]
    s.prefix.discard_pending()  # the step failed: nothing becomes matchable
    c = Sequence("c", doc, SamplingParams(max_tokens=2))
    s.add(c)
    out = s.schedule()
    assert out.restores == [] and {ch.seq.request_id for ch in out.prefill} == {"c"}


def test_a_request_whose_prefix_is_being_computed_waits_and_then_restores_it():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, block_size=4, prefix_cache_blocks=16, max_num_batched_tokens=64,
                                  max_prefill_seqs=4))
    doc = list(range(100, 113))  # 3 cacheable blocks
    a, b = Sequence("a", doc + [1], SamplingParams(max_tokens=2)), Sequence("b", doc + [2], SamplingParams(max_tokens=2))
    c = Sequence("c", list(range(200, 213)), SamplingParams(max_tokens=2))  # another document
    for q in (a, b, c):
        s.add(q)
    out = run_step(s)  # b's first block is a's to compute: b waits, c (behind it) goes ahead
    assert {ch.seq.request_id for ch in out.prefill} == {"a", "c"} and [q.request_id for q in s.waiting] == ["b"]
    out = run_step(s)
    assert [(r.slot, r.pool_blocks) for r in out.restores] == [(b.slot, a.block_table)]
    assert [(ch.seq.request_id, ch.start, ch.end) for ch in out.prefill] == [("b", 12, 14)]
    assert a.exact_blocks == b.exact_blocks == 3 and b.block_table == a.block_table


def test_a_block_computed_alongside_another_sequence_is_not_exact():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, block_size=4, prefix_cache_blocks=16, max_num_batched_tokens=64))
    doc = list(range(100, 113))
    a = Sequence("a", doc, SamplingParams(max_tokens=2), slot=0, num_computed=12)
    a.block_hashes = block_hashes(doc, 4, 3)
    s.prefix.allocate(a.block_hashes[1], tuple(doc[4:8]))  # another row is computing block 1 too
    saves = s._plan_saves(a)
    assert len(a.block_table) == 3 and a.exact_blocks == 1  # block 1 is not a copy of a's row: nor what follows
    assert [(w.first_block, len(w.pool_blocks)) for w in saves] == [(0, 1), (2, 1)]


def test_decode_groups_gather_rows_that_restored_the_same_blocks(monkeypatch):
    monkeypatch.setattr("sfcl.engine.scheduler.MIN_SHARED_SAVING", 0)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, block_size=4, prefix_cache_blocks=64, max_num_batched_tokens=64,
                                  max_prefill_seqs=8))
    doc = list(range(100, 141))  # 10 cacheable blocks
    first = Sequence("q0", doc + [1], SamplingParams(max_tokens=8))
    s.add(first)
    run_step(s)
    seqs = [Sequence(f"q{i}", doc + [1 + i], SamplingParams(max_tokens=8)) for i in range(1, 4)]
    seqs.append(Sequence("other", list(range(300, 341)), SamplingParams(max_tokens=8)))
    for q in seqs:
        s.add(q)
    run_step(s)
    out = run_step(s)
    rows = {q.request_id: i for i, q in enumerate(out.decode)}
    assert len(out.decode) == 5
    assert [(g.rows, g.shared) for g in out.decode_groups] == [(sorted(rows[f"q{i}"] for i in range(4)), 40)]
    s2 = Scheduler(SchedulerConfig(max_num_seqs=8, block_size=4, prefix_cache_blocks=64, max_num_batched_tokens=64,
                                   shared_prefix_attention=False))
    assert s2.schedule().decode_groups == []


def _decoding(tables: dict[str, list[int]]) -> list[Sequence]:
    out = []
    for rid, t in tables.items():
        q = Sequence(rid, [0] * 100, SamplingParams())
        q.block_table, q.exact_blocks = list(t), len(t)
        out.append(q)
    return out


def test_decode_groups_split_where_the_deeper_shared_prefix_spares_more():
    # three rows share 2 blocks; two of them share 10: one group of two at 10 blocks spares more
    rows = _decoding({"a": list(range(10)), "b": list(range(10)), "c": [0, 1, 50, 51]})
    assert [(g.rows, g.shared) for g in decode_groups(rows, 16, min_saving=0)] == [([0, 1], 160)]
    # ... but with many rows on the short prefix, one group over all of them does
    rows = _decoding({"a": list(range(10)), "b": list(range(10)), **{f"c{i}": [0, 1, 50 + i] for i in range(12)}})
    assert [(g.rows, g.shared) for g in decode_groups(rows, 16, min_saving=0)] == [(list(range(14)), 32)]
    # groups that spare fewer positions than min_saving are not formed
    assert decode_groups(_decoding({"a": [0, 1], "b": [0, 1]}), 16, min_saving=64) == []
    assert decode_groups(_decoding({"a": [0, 1], "b": [0, 1], "c": [7]}), 16, min_saving=32) == [
        DecodeGroup([0, 1], 32)]


def test_prefix_cache_evicts_least_recently_used_unreferenced_blocks():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, block_size=4, prefix_cache_blocks=2, max_num_batched_tokens=64))
    first = Sequence("p", list(range(10, 19)), SamplingParams(max_tokens=1))  # 2 cacheable blocks
    s.add(first)
    run_step(s)
    s.finish(first, "max_tokens")
    other = Sequence("q", list(range(50, 59)), SamplingParams(max_tokens=1))
    s.add(other)
    run_step(s)  # evicts p's blocks (pool of 2)
    s.finish(other, "max_tokens")
    again = Sequence("p2", list(range(10, 19)), SamplingParams(max_tokens=1))
    s.add(again)
    out = run_step(s)
    assert out.prefix_hits == 0
    back = Sequence("q2", list(range(50, 59)), SamplingParams(max_tokens=1))
    s.add(back)
    out = run_step(s)
    assert out.prefix_hits == 0  # q's blocks were evicted by p2 (p2 still holds them: pool exhausted)


def test_bounded_waiting_queue_and_context_check():
    s = Scheduler(SchedulerConfig(max_waiting=2, max_model_len=16))
    a, b, c = make_requests(3)
    s.add(a)
    s.add(b)
    with pytest.raises(QueueFullError):
        s.add(c)
    s2 = Scheduler(SchedulerConfig(max_model_len=10))
    with pytest.raises(ValueError, match="context window"):
        s2.add(Sequence("x", list(range(8)), SamplingParams(max_tokens=4)))


def test_abort_waiting_and_running():
    s = Scheduler(SchedulerConfig(max_num_seqs=4))
    a, b = make_requests(2)
    s.add(a)
    s.add(b)
    s.schedule()  # a and b running (b admitted too)
    assert s.abort("r1") and s.num_waiting == 0
    assert s.abort("r0")
    out = s.schedule()
    assert out.decode == [] and {q.request_id for q in out.finished} == {"r0", "r1"}
    assert not s.abort("nope")
    assert not s.has_work()



def test_priority_tags_jump_the_queue_fcfs_among_themselves():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, priority_tags=("high-risk",)))
    tags = [None, "high-risk", None, "high-risk", "other"]
    for i, t in enumerate(tags):
        s.add(Sequence(f"r{i}", [1, 2], SamplingParams(max_tokens=2, tag=t)))
    assert [q.request_id for q in s.waiting] == ["r1", "r3", "r0", "r2", "r4"]


def test_tag_validation():
    with pytest.raises(ValueError, match="tag"):
        SamplingParams(tag="bad tag with spaces")
    assert SamplingParams(tag="high-risk").tag == "high-risk"


def test_with_prefix_caching_the_prompt_tail_is_its_own_chunk_in_the_same_step():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, block_size=4, prefix_cache_blocks=8, max_num_batched_tokens=64))
    a = Sequence("a", list(range(100, 111)), SamplingParams(max_tokens=2))  # 11 tokens: 2 cacheable blocks
    s.add(a)
    out = run_step(s)
    assert [(c.start, c.end, c.is_last) for c in out.prefill] == [(0, 8, False), (8, 11, True)]
    b = Sequence("b", list(range(100, 111)), SamplingParams(max_tokens=2))
    s.add(b)
    out = run_step(s)
    assert [(c.start, c.end) for c in out.prefill] == [(8, 11)]  # the same tail chunk as the cold run
    s2 = Scheduler(SchedulerConfig(max_num_seqs=2, block_size=4, prefix_cache_blocks=0, max_num_batched_tokens=64))
    s2.add(Sequence("c", list(range(100, 111)), SamplingParams(max_tokens=2)))
    assert [(c.start, c.end) for c in run_step(s2).prefill] == [(0, 11)]  # no cache: one chunk


def test_a_request_waiting_for_a_prefix_goes_ahead_when_its_owner_is_aborted():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, block_size=4, prefix_cache_blocks=16, max_num_batched_tokens=20,
                                  max_prefill_seqs=4))
    doc = list(range(100, 161))  # 15 cacheable blocks: a's prefill takes several steps
    a, b = Sequence("a", doc + [1], SamplingParams(max_tokens=2)), Sequence("b", doc + [2], SamplingParams(max_tokens=2))
    s.add(a)
    s.add(b)
    run_step(s)
    assert [q.request_id for q in s.waiting] == ["b"]
    run_step(s)  # a's first blocks are saved, but b still waits: its next block is the one a is computing
    assert [q.request_id for q in s.waiting] == ["b"]
    s.abort("a")
    out = run_step(s)
    assert [q.request_id for q in s.running] == ["b"] and not s.waiting
    assert out.restores and out.restores[0].pool_blocks and b.cached_tokens > 0  # what a had saved is kept
    while not b.prefill_done:
        run_step(s)
    assert b.num_computed == len(b.prompt_ids)


def test_a_deferred_request_keeps_the_slot_it_waits_for():
    """A request behind a deferred one may not take the last free slot: the deferred one would
    then wait for a whole generation (found by review: 204 steps here before)."""
    s = Scheduler(SchedulerConfig(max_num_seqs=2, block_size=4, prefix_cache_blocks=64, max_num_batched_tokens=16,
                                  max_prefill_seqs=2))
    doc = list(range(100, 164))
    owner = Sequence("O", doc + [1], SamplingParams(max_tokens=200))
    d = Sequence("D", doc + [2], SamplingParams(max_tokens=4))
    e = Sequence("E", list(range(300, 304)), SamplingParams(max_tokens=200))
    for q in (owner, d, e):
        s.add(q)
    for _ in range(8):
        run_step(s)
        assert e.status is RequestStatus.WAITING
        if d.status is RequestStatus.RUNNING:
            break
    assert d.status is RequestStatus.RUNNING and d.cached_tokens == 64


def test_a_knn_request_waits_only_for_an_owner_that_records_context_anchors():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, block_size=4, prefix_cache_blocks=16, max_num_batched_tokens=64,
                                  max_prefill_seqs=4))
    doc = list(range(100, 113))
    s.add(Sequence("a", doc + [1], SamplingParams(max_tokens=2)))
    s.add(Sequence("k", doc + [2], SamplingParams(max_tokens=2, steer="knn")))
    s.add(Sequence("b", doc + [3], SamplingParams(max_tokens=2)))
    out = s.schedule()  # k computes (and records) the document itself; b waits for a's blocks
    assert {c.seq.request_id for c in out.prefill} == {"a", "k"} and [q.request_id for q in s.waiting] == ["b"]


def test_a_short_prompt_admitted_during_a_long_prefill_is_not_held_behind_its_chunks():
    """Found by a break-it check: 12 short requests sent with an 8,176-token prompt each waited
    ~30 s, the long prompt's whole prefill, because chunks went oldest first. Prompts that finish
    within short_prefill_tokens now go first; long prompts among themselves stay oldest first."""
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=16)  # short: 64 // 4 = 16 tokens
    s = Scheduler(cfg)
    long_ = Sequence("long", list(range(100, 300)), SamplingParams(max_tokens=4))  # 200 prompt tokens
    s.add(long_)
    out = run_step(s)
    assert [(c.seq.request_id, c.start, c.end) for c in out.prefill] == [("long", 0, 64)]  # alone: the whole budget
    short, = make_requests(1, prompt_len=10)
    later = Sequence("long2", list(range(400, 500)), SamplingParams(max_tokens=4))  # 100 tokens: not short
    s.add(short)
    s.add(later)
    out = run_step(s)
    assert [(c.seq.request_id, c.start, c.end) for c in out.prefill] == [("r0", 0, 10), ("long", 64, 112)]
    assert [q.request_id for q in out.sampled] == ["r0"]  # its first token in the step it was admitted
    out = run_step(s)  # r0 decodes; the older long prompt still goes before the younger one
    assert [q.request_id for q in out.decode] == ["r0"]
    assert [(c.seq.request_id, c.start, c.end) for c in out.prefill] == [("long", 112, 160)]  # 63 -> 3 blocks
    assert sum(c.end - c.start for c in out.prefill) + len(out.decode) <= cfg.max_num_batched_tokens
    with pytest.raises(ValueError, match="short_prefill_tokens"):
        SchedulerConfig(short_prefill_tokens=-1)
