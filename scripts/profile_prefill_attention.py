"""Causal prefill attention of one window on the CPU: torch's SDPA against a blocked form built from
batched matmuls (what a kernel of our own for the anchor builder's model pass would have to beat).

Usage: python scripts/profile_prefill_attention.py [--tokens 1024] [--dtype bfloat16] [--threads 2]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64). The blocked form takes query
blocks of 128 / 256 / 512 rows, stacks the query heads of each KV head into one GEMM, masks the
diagonal block and softmaxes in float32. Prints the largest difference to SDPA and the p50 of 20
calls each.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F


def blocked(q, k, v, block: int) -> torch.Tensor:
    """q (1, nh, T, hd), k/v (1, nkv, T, hd) -> causal attention (1, nh, T, hd), query blocks of ``block``."""
    _, nh, T, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    out = torch.empty(nkv, g, T, hd, dtype=q.dtype)
    qg = q[0].view(nkv, g, T, hd) * (hd ** -0.5)
    kk, vv = k[0], v[0]
    for s in range(0, T, block):
        e = min(T, s + block)
        n = e - s
        sc = torch.bmm(qg[:, :, s:e].reshape(nkv, g * n, hd), kk[:, :e].transpose(1, 2)).float().view(nkv, g, n, e)
        sc[..., s:e].masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        p = sc.softmax(-1).to(q.dtype).view(nkv, g * n, e)
        out[:, :, s:e] = torch.bmm(p, vv[:, :e]).view(nkv, g, n, hd)
    return out.view(1, nh, T, hd)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dt = getattr(torch, a.dtype)
    T, nh, nkv, hd = a.tokens, 9, 3, 64
    q = torch.randn(1, nh, T, hd, dtype=dt)
    k, v = torch.randn(1, nkv, T, hd, dtype=dt), torch.randn(1, nkv, T, hd, dtype=dt)
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)}
    for b in (128, 256, 512):
        fns[f"blocked {b}"] = lambda b=b: blocked(q, k, v, b)
    ref = fns["sdpa"]().float()
    for name, f in fns.items():
        diff = float((f().float() - ref).abs().max())
        for _ in range(3):
            f()
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        ts.sort()
        print(f"{name}: p50 {ts[10] * 1e3:.2f} ms (max |diff| to sdpa {diff:.3g})", flush=True)


if __name__ == "__main__":
    main()
