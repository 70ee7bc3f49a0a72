"""Torch intra-op threads across the serving process's native threads (OpenMP, libgomp).

PyTorch's CPU wheels run intra-op parallelism on GNU OpenMP. Two of its behaviours decide how
fast the engine's multi-threaded steps (prompt chunks on every core) run:

1. **One thread pool per native thread, for that thread's lifetime.** Every thread that ever ran
   a parallel region keeps its own team of OpenMP threads until it exits. When the pools of all
   threads together hold more threads than there are CPUs, libgomp shortens the spin of waiting
   threads from ~300,000 iterations to 100 (``gomp_throttled_spin_count_var``, libgomp's
   env.c), so each parallel region of the engine thread has to wake a sleeping worker through a
   futex. Measured on this project's 2-core CPU (``python scripts/omp_pools.py``: 2,000
   additions of 200k floats on 2 threads, median): 24.5 ms alone, 42.8 ms (1.75x) once the main
   thread had run one 2-thread op, 23.2 ms when that op ran on a thread that then exited. A server that loads its model on
   the main thread, with all cores, therefore slowed every later prompt chunk.
   ``run_on_scratch_thread`` runs such bulk work on a thread that exits when done, which frees
   its pool.
2. **A thread's first parallel op re-reads torch's process-wide count** (``at::init_num_threads``),
   which ``torch.set_num_threads`` on any thread sets. A thread that sets its own count before
   that first op can have it overwritten later. ``set_thread_count`` calls
   ``torch.get_num_threads()`` first (which runs the lazy initialisation), then sets. The lookup
   thread (``sfcl.engine.model_runner``) used to set 1 the plain way: it then ran on the
   engine's count and kept a second pool (``scripts/omp_pools.py``: 42.4 ms, 1.74x, against
   24.1 ms set the fixed way), so every prompt chunk after the first snapshot lookup was slower,
   in every snapshot mode.
3. **Spinning.** A worker with no work spins ~300,000 iterations before it sleeps. On a machine
   whose cores other processes also want, the spinning thread takes the time slice the thread it
   waits for needs, and every parallel region can cost a scheduler slice: with two busy processes
   beside the server on 2 cores, a 300-token stream took 18.5-20.2 s with gaps of ~1 s (a new
   user with another server running saw 131 s for 1,500 tokens) against 5.6-6.1 s (p99 gap 32-39
   ms) with ``GOMP_SPINCOUNT=1000``. But too few spins cost an idle machine: a worker asleep at
   each of a step's ~150 parallel regions must be woken, and on an Intel Xeon (2026-12-05) one
   stream took 8.7-9.9 ms per token at 1,000 spins against 7.5-8.5 at 10,000, and on AVX2 code
   paths 17.5-18.4 against 12.1-13.3 (11.6-12.6 at libgomp's 300,000). With two busy processes
   beside it, 10,000 spins gave 7.2-8.2 s for the 300 tokens (p99 gap 36-60 ms), 1,000 spins
   5.7-8.8 s, 30,000 16.9 s (p99 140 ms). So ``sfcl`` sets 10,000 (``OPENMP_SPINCOUNT``);
   ``OMP_WAIT_POLICY=PASSIVE`` (no spinning) cost 55% (12.3-13.1 ms on the EPYC). Set
   ``GOMP_SPINCOUNT=300000`` (libgomp's default) for a machine that runs nothing else. libgomp
   reads it once, when torch loads it, so ``sfcl.engine.openmp_env.limit_openmp_spinning`` must
   run before ``import torch``: the ``sfcl`` command does it first thing (``sfcl.cli``).
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

T = TypeVar("T")


def set_thread_count(n: int) -> None:
    """Give the calling thread ``n`` intra-op threads, for good (see the module docstring, 2).
    Also sets torch's process-wide count, which threads started later take.
    Raises ValueError if n < 1."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    torch.get_num_threads()  # runs this thread's lazy init now: it cannot undo the next line later
    torch.set_num_threads(n)


def run_on_scratch_thread(fn: Callable[..., T], *args, name: str = "sfcl-scratch", **kwargs) -> T:
    """``fn(*args, **kwargs)`` on a new thread that exits when it returns; returns its result or
    re-raises its exception in the caller. Whatever OpenMP pool ``fn``'s torch ops start dies
    with the thread (module docstring, 1). The thread is a daemon: an interrupt of the caller
    (Ctrl-C while it waits) does not wait for ``fn``. Objects ``fn`` builds (models, compiled
    functions, tensors) are usable from any thread afterwards."""
    box: dict[str, object] = {}

    def work() -> None:
        try:
            box["result"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller as is
            box["error"] = e

    t = threading.Thread(target=work, name=name, daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["result"]  # type: ignore[return-value]
