"""How leftover OpenMP thread pools slow the engine thread's parallel ops (``sfcl.engine.threads``).

Usage: python scripts/omp_pools.py [--regions 2000] [--repeats 6]

Each case runs in its own process (libgomp's pools live as long as the process's threads) and
times, on an "engine" thread with 2 torch threads, ``--regions`` additions of two 200k-float
vectors (one OpenMP parallel region each), best of 5, ``--repeats`` times. Cases:

- ``alone``: nothing else ever ran a parallel op;
- ``main-pool``: the main thread ran one 2-thread op first (as loading a model on all cores
  does), and its pool stays;
- ``scratch-thread``: that op ran on a thread that exited (``run_on_scratch_thread``);
- ``side-thread-plain``: a side thread set 1 thread with ``torch.set_num_threads`` only, the
  engine thread then set its own count, and the side thread ran one op (at its first parallel op
  torch re-read the process-wide count: it ran on 2 threads and kept a pool);
- ``side-thread-fixed``: the same with ``set_thread_count(1)`` (get first, then set).

Prints each case's median ms and its ratio to ``alone``. Needs at least 2 cores.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CASES = ("alone", "main-pool", "scratch-thread", "side-thread-plain", "side-thread-fixed")

CHILD = r'''
import concurrent.futures as cf, sys, threading, time
import torch
from sfcl.engine.threads import run_on_scratch_thread, set_thread_count
case, regions, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
a, b = torch.randn(200_000), torch.randn(200_000)
def bulk():
    torch.randn(1_000_000).add(1)
torch.set_num_threads(2)
if case == "main-pool":
    bulk()
elif case == "scratch-thread":
    run_on_scratch_thread(bulk)
side = None
if case.startswith("side-thread"):
    init = (lambda: torch.set_num_threads(1)) if case.endswith("plain") else (lambda: set_thread_count(1))
    side = cf.ThreadPoolExecutor(1, initializer=init)
    side.submit(int).result()
out = []
def engine():
    set_thread_count(2)
    if side is not None:
        side.submit(bulk).result()
    for _ in range(repeats):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(regions):
                a.add(b)
            best = min(best, time.perf_counter() - t0)
        out.append(best * 1e3)
t = threading.Thread(target=engine)
t.start()
t.join()
print(" ".join(f"{x:.2f}" for x in out))
'''


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--regions", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=6)
    a = ap.parse_args(argv)
    med = {}
    for case in CASES:
        r = subprocess.run([sys.executable, "-c", CHILD, case, str(a.regions), str(a.repeats)],
                           capture_output=True, text=True, check=True)
        times = [float(x) for x in r.stdout.split()]
        med[case] = statistics.median(times)
        print(f"{case:18s} median {med[case]:7.2f} ms   runs {' '.join(f'{t:.1f}' for t in times)}"
              f"   / alone {med[case] / med['alone']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
