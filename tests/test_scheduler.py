"""Scheduler and slot compaction: pure Python, no model."""

import pytest

from sfcl.engine.request import RequestStatus, SamplingParams
from sfcl.engine.scheduler import QueueFullError, Scheduler, SchedulerConfig, Sequence


def make_requests(n, prompt_len=4, max_tokens=8):
    return [Sequence(request_id=f"r{i}", prompt_ids=list(range(1, prompt_len + 1)),
                     params=SamplingParams(max_tokens=max_tokens)) for i in range(n)]


def test_fcfs_admission_one_prefill_per_step_then_batched_decode():
    s = Scheduler(SchedulerConfig(max_num_seqs=4))
    for r in make_requests(3):
        s.add(r)
    out = s.schedule()
    assert [q.request_id for q in out.prefill] == ["r0"] and out.decode == []
    assert out.prefill[0].slot == 0 and out.prefill[0].status is RequestStatus.RUNNING
    out = s.schedule()
    assert [q.request_id for q in out.prefill] == ["r1"] and [q.request_id for q in out.decode] == ["r0"]
    out = s.schedule()
    assert [q.slot for q in out.decode] == [0, 1] and out.prefill[0].slot == 2


def test_max_num_seqs_caps_running():
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_prefill_seqs=4))
    for r in make_requests(3):
        s.add(r)
    out = s.schedule()
    assert len(out.prefill) == 2 and s.num_waiting == 1
    out = s.schedule()
    assert out.prefill == [] and len(out.decode) == 2


def test_finish_compacts_slots_with_a_kv_move():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_seqs=4))
    reqs = make_requests(4)
    for r in reqs:
        s.add(r)
    s.schedule()
    for r in reqs:
        r.output_ids.append(7)
    s.finish(reqs[1], "end_turn")
    out = s.schedule()
    assert [(m.src, m.dst, m.length) for m in out.moves] == [(3, 1, 5)]
    assert [q.request_id for q in out.decode] == ["r0", "r3", "r2"]
    assert [q.slot for q in out.decode] == [0, 1, 2]
    assert reqs[1].status is RequestStatus.FINISHED and reqs[1].slot == -1


def test_finishing_the_last_slot_needs_no_move():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_prefill_seqs=4))
    reqs = make_requests(3)
    for r in reqs:
        s.add(r)
    s.schedule()
    s.finish(reqs[2], "max_tokens")
    s.finish(reqs[0], "max_tokens")
    out = s.schedule()
    assert [(m.src, m.dst) for m in out.moves] == [(1, 0)]
    assert [q.request_id for q in out.decode] == ["r1"] and reqs[1].slot == 0


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
    s.schedule()  # a running, b waiting
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
