"""Time one engine forward step per weight format, interleaved in one process (no HTTP, no
scheduler): which format ``sfcl.model.hardware.choose_weight_quant`` should pick on this CPU.

    python scripts/profile_weight_formats.py [--dtype auto] [--batches 1,4,16,32] [--prefill 256]
        [--formats none,fp16,int4+fp16,int4+fp16/fp16,int8+fp16/fp16] [--threads 1] [--reps 12] [--split 4] [--max-rows 6] [--head-max-rows 3] [--kernels]
        [--pack-dense] [--gemvs torch,sfcl]

A format is ``MODE[+DENSE][/HEAD]`` for ``sfcl.model.quant.quantize_weights(model, MODE, dense=DENSE,
lm_head=HEAD)``: ``int4+fp16/fp16`` = int4 packed kernels for decode batches of <= max_rows rows,
FBGEMM fp16 weights above, fp16 lm_head; ``FORMAT@N`` sets that format's max_rows to N (e.g.
``int4/int8@0``: the packed kernels for no batch, the dense weights for all) and ``FORMAT@N:H`` also
its lm_head's (``int4+fp16/int8@32:16``: the int8 lm_head's kernel for 1-16 rows). Each batch size B runs ``LlamaModel.forward_step`` on B
decode rows attending to ``--length`` cache positions (``--prefill T``: one T-token prompt chunk),
the formats in turn (ABAB...), ``--reps`` rounds; prints the median wall ms and thread CPU ms
per step, and each format's ratio to the first. ``--pack-dense`` holds each model's dense bf16
weights in oneDNN's packed layout, as ``sfcl serve`` does without ``--compile``
(``sfcl.model.quant.pack_dense_weights``). ``--gemvs torch,sfcl`` quantizes every int4 / int8 format
once per GEMV choice (``$SFCL_INT4_KERNEL`` = torch / sfcl with ``$SFCL_INT8_KERNEL`` = bf16 / q8 while
it is quantized: ``sfcl.model.quant.int4_kernel``), labelled ``FORMAT[torch]`` and ``FORMAT[sfcl]``, so
that both GEMVs are timed in one process. On a shared machine the CPU-time column is the
steadier one (it still includes cache and memory-bandwidth contention); report ``uptime`` with it.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: what sfcl serve picks here)")
    ap.add_argument("--batches", default="1,4,16,32", help="decode batch sizes")
    ap.add_argument("--prefill", type=int, default=256, help="also time one prompt chunk of this many tokens (0: no)")
    ap.add_argument("--length", type=int, default=200, help="attended cache positions of the decode rows")
    ap.add_argument("--split", type=int, default=0,
                    help="also time 16 decode rows + the --prefill tokens as ONE chunk against the same tokens as "
                         "SPLIT chunks of different sequences (what per-part attention costs; 0: no)")
    ap.add_argument("--formats", default="none,fp16,int4+fp16,int4+fp16/fp16,int8+fp16/fp16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--max-rows", type=int, default=None,
                    help="largest batch on the packed int8 / int4 kernels (default: sfcl.model.quant's per mode)")
    ap.add_argument("--head-max-rows", type=int, default=None, help="the same for a quantized lm_head (default: --max-rows)")
    ap.add_argument("--kernels", action="store_true",
                    help="SFCL's fused decode kernels on, as sfcl serve runs them (decode_kernel.enable): "
                         "decode-only steps whose projections decode_layers takes run in one C++ call")
    ap.add_argument("--pack-dense", action="store_true", help="pack the dense bf16 weights for oneDNN, as sfcl serve")
    ap.add_argument("--gemvs", default="", help="torch,sfcl: each int4 / int8 format once per GEMV choice")
    a = ap.parse_args(argv)

    from sfcl.model.compiled import dummy_decode_step
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import ChunkSpec, StepBatch
    from sfcl.model.loader import load_model
    from sfcl.model.quant import pack_dense_weights, parse_weight_format, quantize_weights, weight_bytes

    torch.set_num_threads(a.threads)
    lm = load_model(None, dtype=a.dtype)
    models = {}
    env = {"torch": ("torch", "bf16"), "sfcl": ("sfcl", "q8")}
    saved = {k: os.environ.get(k) for k in ("SFCL_INT4_KERNEL", "SFCL_INT8_KERNEL")}
    for spec in a.formats.split(","):
        body, _, cuts = spec.partition("@")  # FORMAT@N[:H]: max_rows N (and head_max_rows H) for this format
        mode, dense, head = parse_weight_format(body)
        rows, _, head_rows = cuts.partition(":")
        max_rows = int(rows) if rows else a.max_rows
        head_max_rows = int(head_rows) if head_rows else a.head_max_rows
        gemvs = [g for g in a.gemvs.split(",") if g] if (mode, head) != ("none", None) else []
        for g in gemvs or [None]:
            if g is not None:  # read by QuantLinear when it is built
                os.environ["SFCL_INT4_KERNEL"], os.environ["SFCL_INT8_KERNEL"] = env[g]
            m = quantize_weights(copy.deepcopy(lm.model), mode, max_rows, dense=dense, lm_head=head,
                                 head_max_rows=head_max_rows)
            if a.pack_dense:
                pack_dense_weights(m)
            models[spec if g is None else f"{spec}[{g}]"] = m
    for k, v in saved.items():  # as the caller set them
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    del lm.model
    batches = [int(b) for b in a.batches.split(",") if b]
    dtype = next(iter(models.values())).embed_tokens.weight.dtype
    rows = max(batches + [1, 16 + a.split])
    kv = KVCache(lm.args, rows, a.length + a.prefill + 8, dtype)
    kv.ensure_initialized(rows, a.length)
    if a.kernels:
        from sfcl.model import decode_kernel
        why = decode_kernel.enable(kv, lm.args)
        if why:
            print(f"fused kernels off: {why}", file=sys.stderr)

    def decode(model, B):
        ids = torch.zeros(1, B, dtype=torch.long)
        return lambda: model.forward_step(ids, dummy_decode_step(B, a.length), kv, lm.args.n_layers * 3 // 4)

    def prefill(model, T):
        ids = torch.zeros(1, T, dtype=torch.long)
        step = StepBatch(positions=torch.arange(T), decode=None, chunks=[ChunkSpec(0, 0, 0, T, True)],
                         sample_index=torch.tensor([T - 1]))
        return lambda: model.forward_step(ids, step, kv, lm.args.n_layers * 3 // 4)

    def mixed(model, parts: int):  # 16 decode rows (rows 0-15) + prefill tokens in `parts` chunks (rows 16+)
        T, B = a.prefill, 16
        dec = dummy_decode_step(B, a.length)
        n = T // parts
        chunks = [ChunkSpec(B + i, 0, B + i * n, n, True) for i in range(parts)]
        step = StepBatch(positions=torch.cat([dec.positions] + [torch.arange(n)] * parts), decode=dec.decode,
                         chunks=chunks, sample_index=torch.tensor(list(range(B)) + [B + (i + 1) * n - 1 for i in range(parts)]))
        ids = torch.zeros(1, B + n * parts, dtype=torch.long)
        return lambda: model.forward_step(ids, step, kv, lm.args.n_layers * 3 // 4)

    cases = [(f"decode B={b}", {s: decode(m, b) for s, m in models.items()}) for b in batches]
    if a.prefill:
        cases.append((f"prefill T={a.prefill}", {s: prefill(m, a.prefill) for s, m in models.items()}))
    if a.split:
        m0 = next(iter(models.values()))
        cases.append((f"16 decode rows + {a.prefill} prompt tokens as 1 chunk vs {a.split} chunks",
                      {"1 chunk": mixed(m0, 1), f"{a.split} chunks": mixed(m0, a.split)}))
    print(f"{dtype} model, {a.threads} thread(s), CPU {torch.backends.cpu.get_cpu_capability()}; "
          f"linear MiB (packed+dense): " + ", ".join(
              f"{s} {sum(weight_bytes(m).values()) / 2**20:.0f}" for s, m in models.items()), flush=True)
    with torch.no_grad():
        for name, fns in cases:
            wall = {s: [] for s in fns}
            cpu = {s: [] for s in fns}
            for f in fns.values():
                f()  # warm-up
            for _ in range(a.reps):
                for s, f in fns.items():
                    t, c = time.perf_counter(), time.thread_time()
                    f()
                    cpu[s].append(time.thread_time() - c)
                    wall[s].append(time.perf_counter() - t)
            first = next(iter(fns))
            m0w, m0c = statistics.median(wall[first]), statistics.median(cpu[first])
            print(f"{name}: " + " | ".join(
                f"{s} {statistics.median(wall[s]) * 1e3:.1f} ms wall ({statistics.median(wall[s]) / m0w:.2f}x), "
                f"{statistics.median(cpu[s]) * 1e3:.1f} ms CPU ({statistics.median(cpu[s]) / m0c:.2f}x)"
                for s in fns), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
