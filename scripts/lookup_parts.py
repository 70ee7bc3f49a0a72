"""Where one snapshot lookup's time goes, with warm and with evicted caches.

    python scripts/lookup_parts.py --anchors LIB [--reps 300] [--evict-mb 64] [--rows 1,2,3,4,5]

Times, on one thread, ``Snapshotter.lookup`` for one row (the part of a served lookup that its
``lookup_ms`` measures), ``AnchorIndex.search`` for one row (what the server calls per lookup), the
IVF pass alone (the kernel module's ``anchor_search`` on a unit query, top ``--k``; before 2026-12-05
faiss's IVF scan), the same pass in torch operators (``ivf_search_torch``, the search without
SFCL's native kernels), the search again with a pure-Python thread busy beside it (the served
lookup shares the GIL with the server's event loop), the hit's epilogue
(``anchor_confidence_each`` over the found anchors' weights and decays, to lists, kind names) in
numpy as ``Snapshotter.lookup`` does it and in torch, and an empty call, each once with
warm caches and once right after copying ``--evict-mb`` MB (the memory traffic of a decode step,
which is what the in-step lookup follows). Queries: library vectors plus noise (latency does not
depend on what they are; recall is measured on real NDA states by ``scripts/anchor_search_bench.py``).
``--rows 2,3,4`` adds ``Snapshotter.lookup`` of that many rows at once (the rows that fired in one
decode step share one search and its time). Prints p50 / p99 in ms per case. The 2026-12-04 before/after figures in docs/benchmarks.md came
from this script's faiss version on ``1e90854`` and on the change after it.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import numpy as np
import torch

from sfcl.library.index import AnchorIndex, candidates, ivf_search_torch
from sfcl.library.store import KIND_NAMES
from sfcl.library.versions import load_library
from sfcl.model import decode_kernel
from sfcl.snapshot.snapshotter import Snapshotter
from sfcl.snapshot.triggers import anchor_confidence_each


def timed(fn, reps: int, evict: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[float, float]:
    """p50, p99 ms of ``fn(i)`` over ``reps`` calls, each after ``dst.copy_(src)`` when ``evict``."""
    ts = np.empty(reps)
    for i in range(reps):
        if evict is not None:
            evict[1].copy_(evict[0])
        t0 = time.perf_counter()
        fn(i)
        ts[i] = (time.perf_counter() - t0) * 1e3
    return float(np.percentile(ts, 50)), float(np.percentile(ts, 99))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchors", required=True, help="anchor library (root or directory)")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--evict-mb", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--rows", default="1", help="comma-separated batch sizes: Snapshotter.lookup of that many rows "
                    "at once (the rows that fired in one decode step share one search)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    lib = load_library(a.anchors)
    index = AnchorIndex(lib, approximate=True)
    if index.cells is None:
        raise SystemExit(f"{lib.n_anchors} anchors: below the IVF size, the index is dense")
    g = torch.Generator().manual_seed(0)
    batches = sorted({int(b) for b in a.rows.split(",") if b} - {1})
    base = lib.vectors[torch.randint(0, lib.n_anchors, (a.reps * max([1] + batches),), generator=g)].float()
    q = base + 0.3 * base.std() * torch.randn(base.shape, generator=g)
    unit = [(r / r.norm())[None].contiguous() for r in q]
    c = index.cells
    cells = c.arrays()
    n_cand = candidates(a.k, index.n)
    found = [index.search(q[i:i + 1], a.k) for i in range(a.reps)]
    w, d = lib.weights.float(), lib.decay.float()
    w_np, d_np = w.numpy(), d.numpy()
    kind_np = np.asarray(KIND_NAMES, dtype=object)[np.asarray(lib.kinds, dtype=np.int64)]

    def epilogue_numpy(i: int) -> list:
        s, ids = (t.numpy() for t in found[i])
        conf = anchor_confidence_each(s, w_np[ids], d_np[ids])
        return [s.tolist(), conf.tolist(), [kind_np[j] for j in ids[0].tolist()]]

    def epilogue_torch(i: int) -> list:
        s, ids = found[i]
        conf = anchor_confidence_each(s, w[ids], d[ids])
        return [s.tolist(), conf.tolist(), [lib.kind_name(j) for j in ids[0].tolist()]]

    if not index.native:
        raise SystemExit("SFCL's native kernels are not loaded here (sfcl.model.decode_kernel.load)")
    native = decode_kernel.module().anchor_search
    src = torch.empty(a.evict_mb * 2**20 // 4)
    dst = torch.empty_like(src)
    snap = Snapshotter(lib, class_table=torch.zeros(1, dtype=torch.uint8), top_k=a.k)  # the server's lookup
    snap.index = index
    cases = [("Snapshotter.lookup, 1 row (the served lookup's timed part)", lambda i: snap.lookup(q[i:i + 1])),
             ("AnchorIndex.search, 1 row", lambda i: index.search(q[i:i + 1], a.k)),
             ("AnchorIndex.search_confidence, 1 row",
              lambda i: index.search_confidence(q[i:i + 1], a.k, snap.weights, snap.decay)),
             (f"IVF pass alone (anchor_search), top {a.k}",
              lambda i: native(unit[i], index.stored, *cells, index.nprobe, a.k, n_cand)),
             (f"IVF pass alone with confidences, top {a.k}",
              lambda i: native(unit[i], index.stored, *cells, index.nprobe, a.k, n_cand, snap.weights, snap.decay)),
             (f"IVF pass in torch operators, top {a.k}",
              lambda i: ivf_search_torch(c, index.stored, unit[i], index.nprobe, a.k, n_cand)),
             ("hit epilogue, numpy (the lookup's)", epilogue_numpy),
             ("hit epilogue, torch", epilogue_torch),
             ("empty call", lambda i: None)]
    cases[1:1] = [(f"Snapshotter.lookup, {b} rows at once", lambda i, b=b: snap.lookup(q[i * b:(i + 1) * b]))
                  for b in batches]
    print(f"{lib.n_anchors} anchors, IVF with 4-bit codes (groups: int8), nlist {c.nlist}, nprobe {index.nprobe}, "
          f"{n_cand} candidates re-scored, CPU {torch.backends.cpu.get_cpu_capability()}")
    print(f"| case | warm p50 ms | warm p99 ms | after {a.evict_mb} MB copy p50 ms | p99 ms |")
    print("|---|---|---|---|---|")
    for name, fn in cases:
        w50, w99 = timed(fn, a.reps, None)
        c50, c99 = timed(fn, a.reps, (src, dst))
        print(f"| {name} | {w50:.3f} | {w99:.3f} | {c50:.3f} | {c99:.3f} |")
    # the served lookup shares the GIL with the event loop: a thread running pure-Python bursts
    # (2 ms of work, 0.5 ms asleep) beside the search, at the default and at a 10x shorter switch interval
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            t_end = time.perf_counter() + 0.002
            while time.perf_counter() < t_end:
                sum(range(100))
            time.sleep(0.0005)

    default_interval = sys.getswitchinterval()
    for interval in (default_interval, default_interval / 10):
        sys.setswitchinterval(interval)
        th = threading.Thread(target=busy, daemon=True)
        th.start()
        try:
            w50, w99 = timed(lambda i: index.search(q[i:i + 1], a.k), a.reps, None)
            c50, c99 = timed(lambda i: index.search(q[i:i + 1], a.k), a.reps, (src, dst))
        finally:
            stop.set()
            th.join()
            stop.clear()
        print(f"| AnchorIndex.search, 1 row, a busy Python thread beside it (switch interval "
              f"{interval * 1e3:g} ms) | {w50:.3f} | {w99:.3f} | {c50:.3f} | {c99:.3f} |")
    sys.setswitchinterval(default_interval)


if __name__ == "__main__":
    main()
