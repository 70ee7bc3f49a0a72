"""Causal prefill attention of one chunk on the CPU: torch's SDPA against SFCL's kernel for the dtype
(``sfcl.model.llama.prefill_attention``, where ``native_prefill_attention`` allows it: float32 on AVX2,
bf16 on AMX tiles or AVX-512 BF16 vectors) and a blocked form built from batched matmuls (what a kernel
of our own for the anchor builder's model pass would have to beat).

Usage: python scripts/profile_prefill_attention.py [--tokens 1024] [--start 0] [--dtype bfloat16]
                                                   [--threads 2]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64): ``--tokens`` queries at positions
[start, start + tokens) over keys [0, start + tokens), as a prompt chunk after ``--start`` cached
positions (SDPA then takes the chunk's bool mask, as ``Attention.prefill_attn`` passes it). SFCL's
kernel: ``torch.ops.sfcl.prefill_attention`` in float32, ``torch.ops.sfcl.causal_attention`` in bf16
(on AMX tiles where the CPU has them; ``--no-amx`` its AVX-512 BF16 vector path); the blocked form (``--start 0`` only) takes
query blocks of 128 / 256 / 512 rows, stacks the query heads of each KV head into one GEMM, masks the
diagonal block and softmaxes in float32. Prints the largest difference to SDPA, the p50 of 20 calls
each and its rate in GFLOP/s counting the causal product's 4 nh hd (T start + T^2 / 2) FLOP, then
torch's GEMM in the same dtype at the model's (T x 576) x (576 x 1,536) shape, the rate to read them against.
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
    ap.add_argument("--start", type=int, default=0, help="cached positions before the chunk")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-amx", action="store_true", help="bf16: SFCL's AVX-512 BF16 vector path where AMX runs")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dt = getattr(torch, a.dtype)
    T, start, nh, nkv, hd = a.tokens, a.start, 9, 3, 64
    S = start + T
    q = torch.randn(1, nh, T, hd, dtype=dt)
    k, v = torch.randn(1, nkv, S, hd, dtype=dt), torch.randn(1, nkv, S, hd, dtype=dt)
    mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=start) if start else None
    fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=not start, attn_mask=mask,
                                                          enable_gqa=True)}
    from sfcl.model import decode_kernel
    from sfcl.model.llama import native_prefill_attention, prefill_attention

    if decode_kernel.load() and native_prefill_attention(q, hd):
        if dt == torch.bfloat16 and a.no_amx:
            fns["sfcl causal_attention (vectors)"] = lambda: torch.ops.sfcl.causal_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), hd ** -0.5, False).transpose(1, 2)
        else:
            fns[f"sfcl {a.dtype}"] = lambda: prefill_attention(q, k, v, hd ** -0.5).transpose(1, 2)
    else:
        print(f"SFCL's prefill attention does not run here in {a.dtype} (float32 needs a kernel build with AVX2, "
              "bf16 one with AVX-512 BF16)", flush=True)
    if not start:
        for b in (128, 256, 512):
            fns[f"blocked {b}"] = lambda b=b: blocked(q, k, v, b)
    flop = 4 * nh * hd * (T * start + T * T / 2)
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
        print(f"{name}: p50 {ts[10] * 1e3:.2f} ms, {flop / ts[10] / 1e9:.0f} GFLOP/s (max |diff| to sdpa {diff:.3g})",
              flush=True)
    # the ceiling to read those rates against: torch's GEMM (MKL / oneDNN) in the same dtype, at the model's
    # gate/up shape with the chunk's rows
    x, w = torch.randn(T, 576, dtype=dt), torch.randn(576, 1536, dtype=dt)
    ts = []
    for i in range(23):
        t = time.perf_counter()
        torch.mm(x, w)
        ts.append(time.perf_counter() - t)
    ts = sorted(ts[3:])
    print(f"torch.mm ({T} x 576) x (576 x 1536), {a.dtype}: p50 {ts[10] * 1e3:.2f} ms, "
          f"{2 * T * 576 * 1536 / ts[10] / 1e9:.0f} GFLOP/s", flush=True)

if __name__ == "__main__":
    main()
