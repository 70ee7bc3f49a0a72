"""sfcl.engine.threads: a thread's count set with set_thread_count survives another thread's
torch.set_num_threads; run_on_scratch_thread returns, re-raises, and leaves no thread behind."""

from __future__ import annotations

import threading

import pytest
import torch

from sfcl import engine_stack
from sfcl.engine.threads import run_on_scratch_thread, set_thread_count


def _count_after_others_change(setter) -> int:
    """On a new thread: ``setter(1)``, then the main thread sets torch's count to 3, then the new
    thread reads its own count (its first parallel op would run with it)."""
    set_done, changed, got = threading.Event(), threading.Event(), []

    def side() -> None:
        setter(1)
        set_done.set()
        changed.wait(10)
        got.append(torch.get_num_threads())

    main = torch.get_num_threads()
    t = threading.Thread(target=side)
    t.start()
    try:
        assert set_done.wait(10)
        torch.set_num_threads(3)
        changed.set()
        t.join(10)
    finally:
        torch.set_num_threads(main)
    return got[0]


def test_set_thread_count_survives_a_later_process_wide_change():
    assert _count_after_others_change(set_thread_count) == 1


def test_plain_set_num_threads_is_undone_by_the_lazy_init():
    # the torch behaviour set_thread_count exists for: without a get first, the thread's lazy
    # initialisation re-reads the process-wide count another thread set in the meantime
    assert _count_after_others_change(torch.set_num_threads) == 3


def test_set_thread_count_rejects_less_than_one():
    with pytest.raises(ValueError, match=">= 1"):
        set_thread_count(0)


def test_scratch_thread_returns_and_exits():
    seen = []

    def fn(a, b=0):
        seen.append(threading.current_thread())
        return a + b

    assert run_on_scratch_thread(fn, 2, b=3, name="t-scratch") == 5
    assert seen[0] is not threading.current_thread() and seen[0].name == "t-scratch"
    assert not seen[0].is_alive()


def test_scratch_thread_reraises_the_same_exception():
    class Boom(RuntimeError):
        pass

    err = Boom("x")

    def fn():
        raise err

    with pytest.raises(Boom) as info:
        run_on_scratch_thread(fn)
    assert info.value is err


def test_build_engine_loads_on_a_thread_that_exits(monkeypatch):
    seen = []

    def fake(mcfg, ecfg, scfg, progress):
        seen.append((threading.current_thread(), mcfg, progress))
        return "built"

    monkeypatch.setattr(engine_stack, "_build_engine", fake)
    assert engine_stack.build_engine("m", "e", "s", progress=False) == "built"
    t, mcfg, progress = seen[0]
    assert t is not threading.current_thread() and t.name == "sfcl-load" and not t.is_alive()
    assert (mcfg, progress) == ("m", False)
