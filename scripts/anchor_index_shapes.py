"""One-row lookup latency of IVF shapes (anchors per cell x cells scanned), interleaved query by query.

    python scripts/anchor_index_shapes.py --anchors LIB [--shapes 32x12 64x8 48x8 32x8] [--reps 400]

Builds one ``AnchorIndex`` per shape over the library, then for each query searches every index in
turn, each right after copying 64 MB (a decode step's memory traffic, which the served lookup
follows), so that no index gets the warm-up or a quieter moment to itself. Queries: library
vectors plus noise (latency does not depend on what they are; recall on real NDA states is
``scripts/anchor_search_bench.py --list-size N --nprobe P``). Prints p50 / p99 ms per shape.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from sfcl.library.index import AnchorIndex
from sfcl.library.versions import load_library


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchors", required=True, help="anchor library (root or directory)")
    ap.add_argument("--shapes", nargs="+", default=["32x12", "64x8", "48x8", "32x8"],
                    help="LISTxNPROBE: anchors per cell on average x cells scanned per query")
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lib = load_library(a.anchors)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in a.shapes]
    index = {s: AnchorIndex(lib, approximate=True, list_size=s[0], nprobe=s[1]) for s in shapes}
    if any(i.cells is None for i in index.values()):
        raise SystemExit(f"{lib.n_anchors} anchors: below the IVF size, the index is dense")
    g = torch.Generator().manual_seed(0)
    q = lib.vectors[torch.randint(0, lib.n_anchors, (a.reps,), generator=g)].float()
    q = q + 0.3 * q.std() * torch.randn(q.shape, generator=g)
    src = torch.empty(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    ms: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    for i in range(a.reps):
        for s in shapes:
            dst.copy_(src)
            t0 = time.perf_counter()
            index[s].search(q[i:i + 1], 3)
            ms[s].append((time.perf_counter() - t0) * 1e3)
    print(f"{lib.n_anchors} anchors, CPU {torch.backends.cpu.get_cpu_capability()}, native {index[shapes[0]].native}")
    print("| anchors per cell x cells scanned | cells | p50 ms | p99 ms |")
    print("|---|---|---|---|")
    for s in shapes:
        print(f"| {s[0]} x {s[1]} | {index[s].cells.nlist} | {np.percentile(ms[s], 50):.3f} | {np.percentile(ms[s], 99):.3f} |")


if __name__ == "__main__":
    main()
