"""KV cache memory against the tokens it holds (``sfcl.model.kv_cache``): resident bytes after
writing, after releasing rows, and what the page faults and releases cost.

    python scripts/profile_kv_memory.py [--slots 16] [--tokens 150] [--max-len 8192]
                                        [--dtype float32] [--kv-dtype auto] [--keep-positions 256]

Builds a KV cache of SmolLM2-135M's shape (30 layers, 3 KV heads of 64) with ``--slots`` rows of
``--max-len`` positions, writes ``--tokens`` positions into every row (all layers), writes them
again (pages already touched), reads ``--max-len`` positions of every row (never-written pages
read as zeros without being allocated), then releases every row. Prints the resident set size
(``/proc/self/statm``) after each stage against ``tokens x rows x bytes_per_token``, and the
seconds each stage took: first write - rewrite = the page faults; release = ``madvise``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=150, help="positions written per row")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--keep-positions", type=int, default=256)
    a = ap.parse_args(argv)

    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import LlamaArgs

    torch.set_num_threads(1)
    args = LlamaArgs("llama", 49152, 576, 1536, 30, 9, 3, 64, 1e-5, 8192, True, False, False)
    dt = getattr(torch, a.dtype)
    r0 = rss_mib()
    kv = KVCache(args, a.slots, a.max_len, dt, kv_dtype=a.kv_dtype, keep_positions=a.keep_positions)
    expect = a.slots * a.tokens * kv.bytes_per_token / 2**20
    print(f"KV cache {a.slots} rows x {a.max_len} positions, {a.dtype} {a.kv_dtype}, "
          f"{kv.bytes_per_token} bytes/token, keep_positions {a.keep_positions}: "
          f"{a.slots} x {a.tokens} tokens = {expect:.1f} MiB")
    print(f"allocated: +{rss_mib() - r0:.1f} MiB resident")
    k = torch.randn(args.n_kv_heads, a.tokens, args.head_dim).to(dt)

    def write() -> float:
        t = time.perf_counter()
        for slot in range(a.slots):
            for layer in range(args.n_layers):
                kv.write_prefill(layer, slot, 0, k, k)
        return time.perf_counter() - t

    first = write()
    print(f"written: +{rss_mib() - r0:.1f} MiB resident, {first * 1e3:.0f} ms")
    again = write()
    print(f"rewritten: +{rss_mib() - r0:.1f} MiB resident, {again * 1e3:.0f} ms "
          f"(page faults: {(first - again) * 1e3:.0f} ms, {(first - again) * 1e6 / (a.slots * a.tokens):.0f} us/token)")
    for layer in range(args.n_layers):
        kk, vv = kv.read(layer, slice(0, a.slots), a.max_len)
        float(kk[:, :, -1].sum() + vv[:, :, -1].sum())
    del kk, vv
    print(f"read {a.max_len} positions of every row: +{rss_mib() - r0:.1f} MiB resident")
    t = time.perf_counter()
    for slot in range(a.slots):
        kv.release(slot)
    dt_rel = time.perf_counter() - t
    print(f"released: +{rss_mib() - r0:.1f} MiB resident, {dt_rel * 1e3:.1f} ms "
          f"({dt_rel * 1e3 / a.slots:.2f} ms/row)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
