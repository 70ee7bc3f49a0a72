"""The model's dense bf16 projections with the weights plain (``F.linear``) against packed for oneDNN.

Usage: python scripts/profile_dense_packing.py [--rows 7,16,32,40,128,512] [--reps 10]

Builds random bf16 weights of SmolLM2-135M's block projections (qkv 960 x 576, o 576 x 576, gate/up
3,072 x 576, down 576 x 1,536; 30 layers, 212 MB: more than the caches, as in a served step) and
times, per row count, one pass of all 120 products with ``F.linear`` (torch's bf16 GEMM, which
reorders the weight into oneDNN's blocked layout on every call) and with the weights packed once
(``torch.ops.mkldnn._reorder_linear_weight`` at ``sfcl.model.quant.PACK_BATCH_HINT``, multiplied by
``torch.ops.mkldnn._linear_pointwise``: ``sfcl.model.quant.pack_dense_weights``), alternating, best of 3
runs of ``--reps`` passes each, on torch's threads; checks that the products agree bit for bit.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from sfcl.model.quant import dense_packing_available, packed_linear, packed_weight

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of qkv, o, gate_up, down


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="7,16,32,40,128,512")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--layers", type=int, default=30)
    a = ap.parse_args(argv)
    if not dense_packing_available():
        raise SystemExit("this torch build does not pack bf16 weights for oneDNN (sfcl.model.quant.dense_packing_available)")
    g = torch.Generator().manual_seed(0)
    plain = [[(torch.randn(o, i, generator=g) * 0.05).to(torch.bfloat16) for o, i in SHAPES] for _ in range(a.layers)]
    packed = [[packed_weight(w) for w in layer] for layer in plain]
    print(f"{a.layers} layers x 4 projections, bf16, {torch.get_num_threads()} threads; ms per pass (best of 3 x {a.reps})")
    for rows in (int(r) for r in a.rows.split(",")):
        xs = {i: torch.randn(rows, i, generator=g).to(torch.bfloat16) for _, i in SHAPES}

        def run_plain():
            return [F.linear(xs[w.shape[1]], w) for layer in plain for w in layer]

        def run_packed():
            return [packed_linear(xs[w.shape[1]], p) for layer, players in zip(plain, packed) for w, p in zip(layer, players)]

        same = all(torch.equal(x, y) for x, y in zip(run_plain(), run_packed()))
        best = {"F.linear": float("inf"), "packed": float("inf")}
        for _ in range(3):
            for name, f in (("F.linear", run_plain), ("packed", run_packed)):
                t = time.perf_counter()
                for _ in range(a.reps):
                    f()
                best[name] = min(best[name], (time.perf_counter() - t) / a.reps * 1e3)
        print(f"{rows:5d} rows: F.linear {best['F.linear']:.2f} ms, packed {best['packed']:.2f} ms "
              f"({best['F.linear'] / best['packed']:.2f}x), products equal bit for bit: {same}", flush=True)


if __name__ == "__main__":
    main()
