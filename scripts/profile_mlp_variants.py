"""One decoder layer's MLP over an anchor-build batch of rows, three ways (how the build's MLP was tried).

Usage: python scripts/profile_mlp_variants.py [--rows 4096] [--blocks 128,256,512,1024]

Random bf16 weights of SmolLM2-135M's MLP (gate/up 3,072 x 576, down 576 x 1,536) and ``--rows`` rows:
``h += down(silu(gate) * up)`` as the anchor builder's model pass computes it (one gate/up GEMM,
``torch.ops.sfcl.silu_mul``, the down GEMM adding into h: ``sfcl.anchors.model_pass.add_linear_``);
with SiLU fused into oneDNN's gate GEMM and the multiply by up into the up GEMM
(``torch.ops.mkldnn._linear_pointwise`` "swish", then its "mul" form); and in blocks of rows with the
weights packed for oneDNN (``sfcl.model.quant.pack_dense_weights``' layout), so that a block's gate/up
output can stay in L2. Prints the best of 3 runs of 10 calls each and the largest difference from the
first way. Needs SFCL's kernels (built on first use) and a torch with oneDNN.
"""

from __future__ import annotations

import argparse
import time

import torch

from sfcl.model import decode_kernel


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--blocks", default="128,256,512,1024")
    a = ap.parse_args(argv)
    if not decode_kernel.load(verbose=False):
        raise SystemExit(f"SFCL's kernels are not available: {decode_kernel.why_unavailable()}")
    g = torch.Generator().manual_seed(0)
    n, lp = a.rows, torch.ops.mkldnn._linear_pointwise
    x = torch.randn(n, 576, generator=g).to(torch.bfloat16)
    h0 = torch.randn(n, 576, generator=g).to(torch.bfloat16)
    wgu = (torch.randn(3072, 576, generator=g) * 0.05).to(torch.bfloat16)
    wd = (torch.randn(576, 1536, generator=g) * 0.03).to(torch.bfloat16)
    wg, wu = wgu[:1536].contiguous(), wgu[1536:].contiguous()

    def whole(h):
        return h.addmm_(torch.ops.sfcl.silu_mul(x @ wgu.t()), wd.t())

    def fused(h):
        y = lp.binary(x, lp(x, wg, None, "swish", [], ""), wu, None, "mul")
        return h.addmm_(y, wd.t())

    def blocks(r):
        pgu, pd = (torch.ops.mkldnn._reorder_linear_weight(w, r) for w in (wgu, wd))

        def f(h):
            for i in range(0, n, r):
                h[i:i + r] += lp(torch.ops.sfcl.silu_mul(lp(x[i:i + r], pgu, None, "none", [], "")), pd, None, "none", [], "")
            return h
        return f

    ref = whole(h0.clone())
    ways = [("gate/up GEMM, silu_mul, down GEMM adding into h", whole),
            ("SiLU and the multiply fused into oneDNN's GEMMs", fused)]
    ways += [(f"blocks of {r} rows, packed weights", blocks(r)) for r in (int(b) for b in a.blocks.split(","))]
    print(f"{n} rows, bf16, {torch.get_num_threads()} threads; best of 3 x 10 calls")
    for name, f in ways:
        diff = float((f(h0.clone()).float() - ref.float()).abs().max())
        best = float("inf")
        for _ in range(3):
            h = h0.clone()
            f(h)
            t = time.perf_counter()
            for _ in range(10):
                f(h)
            best = min(best, (time.perf_counter() - t) / 10 * 1e3)
        print(f"{name}: {best:.2f} ms (max |difference| {diff:.3g})", flush=True)


if __name__ == "__main__":
    main()
