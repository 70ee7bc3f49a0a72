"""EngineThread._emit: a step's events reach each event loop in one hand-over, in order."""

import asyncio
import threading
from types import SimpleNamespace

from sfcl.engine.async_engine import EngineThread, QueueSink
from sfcl.engine.events import ErrorEvent, Finished, Started, TextDelta


def test_one_step_is_one_call_soon_threadsafe_per_loop_in_order_and_ended_sinks_are_dropped():
    loop = asyncio.new_event_loop()
    calls = []
    real = loop.call_soon_threadsafe

    def counting(cb, *args):
        calls.append(cb)
        return real(cb, *args)

    loop.call_soon_threadsafe = counting
    qa, qb = asyncio.Queue(), asyncio.Queue()
    plain = []
    et = EngineThread(SimpleNamespace())  # _emit uses only the sinks
    et.sinks = {"a": QueueSink(loop, qa), "b": QueueSink(loop, qb), "c": plain.append}
    fin = Finished("max_tokens", None, 3, 2, {})
    events = [("a", Started("a", 3)), ("b", Started("b", 3)), ("a", TextDelta("x", 0)), ("c", TextDelta("y", 0)),
              ("b", ErrorEvent("boom", "api_error")), ("a", TextDelta("z", 1)), ("a", fin), ("gone", TextDelta("w", 0))]
    t = threading.Thread(target=et._emit, args=(events,))  # the engine thread, not the loop's
    t.start()
    t.join()
    assert len(calls) == 1  # one wake-up of the loop for the whole step
    assert plain == [TextDelta("y", 0)]  # a plain callable sink is called directly
    assert set(et.sinks) == {"c"}  # a and b ended (Finished / ErrorEvent)
    loop.run_until_complete(asyncio.sleep(0))
    got_a = [qa.get_nowait() for _ in range(qa.qsize())]
    got_b = [qb.get_nowait() for _ in range(qb.qsize())]
    assert got_a == [Started("a", 3), TextDelta("x", 0), TextDelta("z", 1), fin]
    assert [type(e) for e in got_b] == [Started, ErrorEvent]
    loop.close()
    et._emit([("c", TextDelta("late", 1))])  # a closed loop is not an error for other sinks
    QueueSink(loop, qa)(TextDelta("late", 2))  # nor for the sink itself
