"""EngineThread._emit: a step's events reach each event loop in one hand-over, in order
(with the break-it pass's cases: many loops, a closed loop, removed sinks, later steps)."""

import asyncio
import threading
from types import SimpleNamespace

from test_metrics import value

from sfcl.engine.async_engine import EngineThread, QueueSink
from sfcl.engine.events import ErrorEvent, Finished, Started, TextDelta


def _counting_loop():
    loop = asyncio.new_event_loop()
    calls = []
    real = loop.call_soon_threadsafe

    def counting(cb, *args):
        calls.append(cb)
        return real(cb, *args)

    loop.call_soon_threadsafe = counting
    return loop, calls


def _drain(loop, q):
    loop.run_until_complete(asyncio.sleep(0))
    return [q.get_nowait() for _ in range(q.qsize())]


def _emit_from_thread(et, events):
    t = threading.Thread(target=et._emit, args=(events,))
    t.start()
    t.join()


def test_one_step_is_one_call_soon_threadsafe_per_loop_in_order_and_ended_sinks_are_dropped():
    loop, calls = _counting_loop()
    qa, qb = asyncio.Queue(), asyncio.Queue()
    plain = []
    et = EngineThread(SimpleNamespace())  # _emit uses only the sinks
    et.sinks = {"a": QueueSink(loop, qa), "b": QueueSink(loop, qb), "c": plain.append}
    fin = Finished("max_tokens", None, 3, 2, {})
    events = [("a", Started("a", 3)), ("b", Started("b", 3)), ("a", TextDelta("x", 0)), ("c", TextDelta("y", 0)),
              ("b", ErrorEvent("boom", "api_error")), ("a", TextDelta("z", 1)), ("a", fin), ("gone", TextDelta("w", 0))]
    _emit_from_thread(et, events)  # the engine thread, not the loop's
    assert len(calls) == 1  # one wake-up of the loop for the whole step
    assert plain == [TextDelta("y", 0)]  # a plain callable sink is called directly
    assert set(et.sinks) == {"c"}  # a and b ended (Finished / ErrorEvent)
    got_a = _drain(loop, qa)
    got_b = _drain(loop, qb)
    assert got_a == [Started("a", 3), TextDelta("x", 0), TextDelta("z", 1), fin]
    assert [type(e) for e in got_b] == [Started, ErrorEvent]
    loop.close()
    et._emit([("c", TextDelta("late", 1))])  # a closed loop is not an error for other sinks
    QueueSink(loop, qa)(TextDelta("late", 2))  # nor for the sink itself


def test_many_loops_one_call_each_closed_loop_and_removed_sinks_do_not_block_the_others():
    loops = [_counting_loop() for _ in range(4)]
    qs = [asyncio.Queue() for _ in range(4)]
    et = EngineThread(SimpleNamespace())
    et.sinks = {f"r{i}": QueueSink(loops[i][0], qs[i]) for i in range(4)}
    loops[1][0].close()  # a client loop that is gone
    del et.sinks["r2"]  # an aborted request: its sink was removed before the step's events
    fin = Finished("stop", None, 1, 2, {})
    events = []
    for i in range(4):
        events += [(f"r{i}", TextDelta("a", 0)), (f"r{i}", TextDelta("b", 1))]
    events += [(f"r{i}", fin) for i in range(4)]
    _emit_from_thread(et, events)
    assert [len(c) for _, c in loops] == [1, 1, 0, 1]  # the closed loop was tried once, r2 not at all
    for i in (0, 3):
        assert _drain(loops[i][0], qs[i]) == [TextDelta("a", 0), TextDelta("b", 1), fin]  # Finished last
    assert et.sinks == {}  # every request that finished is dropped, also on the closed loop
    for i in (0, 2, 3):
        loops[i][0].close()


def test_events_after_the_end_are_dropped_and_later_steps_follow_in_order():
    loop, calls = _counting_loop()
    q = asyncio.Queue()
    et = EngineThread(SimpleNamespace())
    et.sinks = {"a": QueueSink(loop, q), "b": QueueSink(loop, q)}  # two requests sharing one queue
    _emit_from_thread(et, [("a", Started("a", 1)), ("b", Started("b", 1)), ("a", TextDelta("x", 0))])
    _emit_from_thread(et, [("b", TextDelta("y", 0)), ("a", ErrorEvent("boom")), ("a", TextDelta("late", 1)),
                           ("b", TextDelta("z", 1))])
    assert len(calls) == 2  # one per step
    got = _drain(loop, q)
    assert got == [Started("a", 1), Started("b", 1), TextDelta("x", 0), TextDelta("y", 0), ErrorEvent("boom"),
                   TextDelta("z", 1)]  # the step order; nothing of "a" after its error
    assert set(et.sinks) == {"b"}
    loop.close()


def test_empty_step_posts_nothing():
    loop, calls = _counting_loop()
    et = EngineThread(SimpleNamespace())
    et.sinks = {"a": QueueSink(loop, asyncio.Queue())}
    et._emit([])
    et._emit([("other", TextDelta("x", 0))])
    assert calls == []
    loop.close()


def _requests_total(m, status: str, tag: str) -> float:
    return value(m.render().decode(), f'sfcl_requests_total{{status="{status}",tag="{tag}"}}')


def test_a_client_abort_counts_as_an_aborted_request_once_and_an_unknown_id_not_at_all():
    """Found by a new-user pass: requests whose client went away never reached sfcl_requests_total."""
    from sfcl.metrics import PrometheusStatLogger

    m = PrometheusStatLogger(snapshots_enabled=True, known_tags=("high-risk",))
    live = {"r1": SimpleNamespace(seq=SimpleNamespace(params=SimpleNamespace(tag="high-risk")))}
    eng = SimpleNamespace(requests=live, abort=lambda rid: live.pop(rid, None) is not None)
    et = EngineThread(eng, stat_logger=m)
    et.sinks = {"r1": print}
    et._handle(("abort", "r1"))
    et._handle(("abort", "r1"))  # the stream's cleanup may abort again: not counted twice
    et._handle(("abort", "never-seen"))
    assert _requests_total(m, "aborted", "high-risk") == 1.0
    assert _requests_total(m, "aborted", "none") == 0.0 and "r1" not in et.sinks


def test_requests_failed_by_an_engine_error_or_refused_at_intake_count_as_errors_under_their_tag():
    from sfcl.engine.scheduler import QueueFullError
    from sfcl.metrics import PrometheusStatLogger

    m = PrometheusStatLogger(snapshots_enabled=True, known_tags=("high-risk",))
    seq = lambda rid, tag: SimpleNamespace(request_id=rid, params=SimpleNamespace(tag=tag))  # noqa: E731
    eng = SimpleNamespace(scheduler=SimpleNamespace(running=[seq("a", "high-risk"), None, seq("b", None)]),
                          abort=lambda rid: True)
    et = EngineThread(eng, stat_logger=m)
    et._fail_running("internal engine error")
    assert _requests_total(m, "error", "high-risk") == 1.0 and _requests_total(m, "error", "none") == 1.0

    def full(*_):
        raise QueueFullError("full")

    got = []
    eng.add_request = full
    et._handle(("add", "c", [1, 2], SimpleNamespace(tag="high-risk"), got.append))
    assert got == [ErrorEvent("the engine queue is full; retry later", "overloaded_error", tag="high-risk")]
    assert _requests_total(m, "error", "high-risk") == 2.0 and m.n_requests == 3
