"""Batched decode attention over the slot-contiguous KV cache: the serving path against the
alternatives torch offers, one layer, SmolLM2-135M's heads (9 query, 3 KV, head dim 64).

    python scripts/profile_decode_attention.py [--threads 2] [--dtype bfloat16] [--shapes 32x300,16x300,1x300]

K and V are views of a (slots, KV heads, max_len, head_dim) cache, as ``KVCache.read`` returns
them, so their batch stride is max_len x head_dim, not S x head_dim. Variants, each timed as the
mean of 40 calls after 5 warm-up calls, with its max |difference| from the serving path:

- ``serving``: ``Attention.decode_attn``'s arithmetic: scores as K q^T (``matmul``), float32 softmax
  with the additive mask, weights times V (``matmul``);
- ``sdpa``: ``F.scaled_dot_product_attention`` with ``enable_gqa`` and the mask;
- ``float32``: K and V upcast first, then the same matmuls in float32;
- ``no-mkldnn``: the serving arithmetic with oneDNN off (``torch.backends.mkldnn.flags``).

Why it exists: at 32 rows x 300 positions, ``scripts/profile_decode.py --eager --batch 32 --length
300 --threads 2 --profile`` showed each layer's K and V copied to contiguous memory before the
batched matmuls (``aten::copy_`` of [96, 300, 64], ~190 us each); this script is where the other
ways to do the same attention were timed (docs/performance-journal.md).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

MAX_LEN, NKV, G, HD = 2048, 3, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--shapes", default="32x300,16x300,32x150,8x600,1x300", help="BxS pairs, comma-separated")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    dt = getattr(torch, a.dtype)
    print(f"threads {a.threads}, {a.dtype}, CPU {torch.backends.cpu.get_cpu_capability()}")
    print("| B | S | variant | us per layer | max abs diff |")
    print("|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        B, S = (int(x) for x in shape.split("x"))
        g = torch.Generator().manual_seed(0)
        ck = torch.randn(B + 1, NKV, MAX_LEN, HD, generator=g).to(dt)
        cv = torch.randn(B + 1, NKV, MAX_LEN, HD, generator=g).to(dt)
        kk, vv = ck[:B, :, :S], cv[:B, :, :S]  # (B, nkv, S, hd) views, as KVCache.read gives them
        q = torch.randn(B, NKV * G, HD, generator=g).to(dt)
        bias = torch.zeros(B, 1, 1, S)

        def serving():
            qg = (q * HD ** -0.5).reshape(B, NKV, G, HD)
            s = torch.matmul(kk, qg.transpose(-1, -2)).transpose(-1, -2).float() + bias  # (B, nkv, g, S)
            return torch.matmul(s.softmax(-1).to(dt), vv).reshape(B, -1)

        def sdpa():
            return F.scaled_dot_product_attention(q.view(B, NKV * G, 1, HD), kk, vv, attn_mask=bias.to(dt),
                                                  enable_gqa=True).reshape(B, -1)

        def float32():
            qg = (q * HD ** -0.5).reshape(B, NKV, G, HD).float()
            s = torch.matmul(qg, kk.float().transpose(-1, -2)) + bias
            return torch.matmul(s.softmax(-1), vv.float()).to(dt).reshape(B, -1)

        def no_mkldnn():
            with torch.backends.mkldnn.flags(enabled=False):
                return serving()

        ref = serving().float()
        for name, fn in (("serving", serving), ("sdpa", sdpa), ("float32", float32), ("no-mkldnn", no_mkldnn)):
            for _ in range(5):
                fn()
            t0 = time.perf_counter()
            for _ in range(40):
                out = fn()
            us = (time.perf_counter() - t0) / 40 * 1e6
            print(f"| {B} | {S} | {name} | {us:.0f} | {(out.float() - ref).abs().max():.4f} |", flush=True)


if __name__ == "__main__":
    main()
