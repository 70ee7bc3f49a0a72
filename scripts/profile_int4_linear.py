"""SFCL's int4 x int8 GEMV (``torch.ops.sfcl.int4_linear``) against torch's ``_weight_int4pack_mm_for_cpu``.

    python scripts/profile_int4_linear.py [--reps 30] [--rows 1 2 4] [--threads 2]

The four projections of all 30 decoder layers of the default model's shape (qkv 960 x 576, o 576 x
576, gate_up 3,072 x 576, down 576 x 1,536; random int4 weights, 53 MB of codes), one pass over
all 120 at M rows, each kernel's pass timed right after copying 64 MB (what the previous step left
in the caches), p50 over ``--reps`` passes, the two kernels alternating pass by pass. Also the
relative error of each against float64 with the same dequantized weights (Gaussian activations).
Times the AVX2 code paths on an AVX-512 CPU with ``SFCL_KERNEL_MARCH=haswell
ATEN_CPU_CAPABILITY=avx2`` (both kernels then run their AVX2 code). Prints the CPU, both figures
and their ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from sfcl.model import decode_kernel, quant
from sfcl.model.hardware import cpu_flags

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # one layer's projections (N, K)
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not decode_kernel.load():
        raise SystemExit(f"SFCL's native kernels are not available: {decode_kernel.why_unavailable()}")
    g = torch.Generator().manual_seed(0)
    torch_w, ours_w, dense_w = [], [], []
    for _ in range(LAYERS):
        for n, k in SHAPES:
            q, scale, zero = quant.quantize_int4(torch.randn(n, k, generator=g) * 0.05)
            sz = torch.stack([scale.t(), zero.t()], -1).to(torch.bfloat16).contiguous()
            torch_w.append((torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1), sz))
            ours_w.append(quant.int4_q8_layout(q, sz))
            if len(dense_w) < len(SHAPES):
                dense_w.append(quant._int4_kernel_weight(q, sz))
    src = torch.empty(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, kernels -march={decode_kernel.MARCH}, "
          f"avx512_vnni={'avx512_vnni' in cpu_flags()}, {a.threads} threads; 120 projections, 53 MB of codes")
    print("| rows | torch int4 (bf16 activations) ms | SFCL int4 x int8 ms | ratio | rel. error torch / SFCL |")
    print("|---|---|---|---|---|")
    for m in a.rows:
        xs = {k: torch.randn(m, k, generator=g) for k in (576, 1536)}
        xb = {k: v.bfloat16() for k, v in xs.items()}

        def run_torch() -> None:
            for (w, sz), (n, k) in zip(torch_w, SHAPES * LAYERS):
                torch._weight_int4pack_mm_for_cpu(xb[k], w, quant.INT4_GROUP, sz)

        def run_ours() -> None:
            for (c, sz), (n, k) in zip(ours_w, SHAPES * LAYERS):
                torch.ops.sfcl.int4_linear(xs[k], c, sz)

        ts = {"torch": [], "ours": []}
        for _ in range(a.reps):
            for name, fn in (("torch", run_torch), ("ours", run_ours)):
                dst.copy_(src)
                t0 = time.perf_counter()
                fn()
                ts[name].append((time.perf_counter() - t0) * 1e3)
        p = {name: sorted(v)[len(v) // 2] for name, v in ts.items()}
        err = {}
        for (n, k), w in zip(SHAPES, dense_w):
            ref = xs[k].double() @ w.double().T
            i = SHAPES.index((n, k))
            yt = torch._weight_int4pack_mm_for_cpu(xb[k], *torch_w[i][:1], quant.INT4_GROUP, torch_w[i][1])
            yo = torch.ops.sfcl.int4_linear(xs[k], *ours_w[i])
            for name, y in (("torch", yt), ("ours", yo)):
                err.setdefault(name, []).append(float((y.double() - ref).norm() / ref.norm()))
        print(f"| {m} | {p['torch']:.2f} | {p['ours']:.2f} | {p['torch'] / p['ours']:.2f}x | "
              f"{max(err['torch']):.1e} / {max(err['ours']):.1e} |")


if __name__ == "__main__":
    main()
