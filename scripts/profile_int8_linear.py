"""SFCL's int8 GEMVs (``torch.ops.sfcl.int8_linear``, bf16 activations, and ``int8_q8_linear``, int8
activations per block of 32) against torch's ``_weight_int8pack_mm``.

    python scripts/profile_int8_linear.py [--reps 40] [--tokens 128] [--rounds 4] [--threads 2]

1. The default model's int8 ``lm_head`` (49,152 x 576, the default weight format's head) at M = 1
   and 4 rows, each kernel timed warm and right after copying 96 MB (a decode step's weight
   traffic, which the head follows), p50 over ``--reps`` calls.
2. The engine (default weight format, snapshots on, fused decode layers) decoding one greedy
   stream of ``--tokens`` tokens, the three kernels alternating run by run for ``--rounds`` rounds
   in one process (the head's ``QuantLinear.kernel`` and ``sfcl.model.quant.int8_mm`` swapped); ms
   per token including the prefill, and whether the greedy texts are equal.

Prints the CPU, the figures of the kernels and their ratios to ``int8_linear``.
"""

from __future__ import annotations

import argparse
import time

import torch

from sfcl.config import EngineConfig, ModelConfig, SnapshotConfig
from sfcl.engine.engine import run_to_completion
from sfcl.engine.events import TextDelta
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import load_anchors, make_llm_engine
from sfcl.model import decode_kernel, quant
from sfcl.model.hardware import cpu_flags, resolve_weight_format
from sfcl.model.loader import load_model


def p50_ms(fn, reps: int, evict: tuple[torch.Tensor, torch.Tensor] | None) -> float:
    ts = []
    for _ in range(reps):
        if evict is not None:
            evict[1].copy_(evict[0])
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if not decode_kernel.load():
        raise SystemExit(f"SFCL's native kernels are not available: {decode_kernel.why_unavailable()}")
    flags = " ".join(sorted(cpu_flags() & {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16"}))
    print(f"CPU: torch {torch.backends.cpu.get_cpu_capability()} ({flags}); {a.threads} threads")
    mcfg, scfg = ModelConfig(), SnapshotConfig()
    lm = load_model(mcfg.model, dtype=mcfg.dtype, device="cpu", cache_dir=scfg.cache_dir)
    wq = resolve_weight_format("auto", lm.model.embed_tokens.weight.dtype)
    quant.quantize_weights(lm.model, wq.mode, max_rows=wq.max_rows, dense=wq.dense, lm_head=wq.lm_head,
                          head_max_rows=wq.head_max_rows)
    head = lm.model.lm_head
    if not (isinstance(head, quant.QuantLinear) and head.mode == "int8"):
        raise SystemExit(f"the default weight format here ({wq}) has no int8 lm_head")
    src = torch.empty(96 * 2**20 // 4)
    dst = torch.empty_like(src)
    dt = lm.model.embed_tokens.weight.dtype
    kernels = {  # name: (kernel, activation dtype it is given when serving)
        "sfcl int8_linear": (torch.ops.sfcl.int8_linear, quant.KERNEL_DTYPE),
        "sfcl int8_q8_linear": (torch.ops.sfcl.int8_q8_linear, dt),
        "torch _weight_int8pack_mm": (torch._weight_int8pack_mm, quant.KERNEL_DTYPE),
    }
    print(f"| lm_head {head.out_features} x {head.in_features} int8, p50 ms | " + " | ".join(kernels)
          + " | q8 / int8_linear | torch / int8_linear |")
    print("|---|---|---|---|---|---|")
    for M in (1, 2, 3, 4):
        x = torch.randn(M, head.in_features)
        for evict in (None, (src, dst)):
            t = [p50_ms(lambda k=k, xd=x.to(d): k(xd, head.qweight, head.scales), a.reps, evict)
                 for k, d in kernels.values()]
            print(f"| M = {M}, {'after a 96 MB copy' if evict else 'warm'} | " + " | ".join(f"{v:.3f}" for v in t)
                  + f" | {t[1] / t[0]:.2f}x | {t[2] / t[0]:.2f}x |")

    lib = load_anchors(lm, scfg, False)
    eng = make_llm_engine(lm, lib, EngineConfig(max_num_seqs=16), scfg)
    ids = lm.tokenizer("Summarise the confidentiality obligations of the receiving party in this agreement.",
                       add_special_tokens=False)["input_ids"]

    def params() -> SamplingParams:
        return SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)

    run_to_completion(eng, [(ids, params())])  # warm-up
    ours, kernel0 = quant.int8_mm, head.kernel
    swaps = {"sfcl int8_linear": ("bf16", ours), "sfcl int8_q8_linear": ("q8", ours),
             "torch _weight_int8pack_mm": ("bf16", torch._weight_int8pack_mm)}
    per_token: dict[str, list[float]] = {k: [] for k in swaps}
    texts: dict[str, str] = {}
    try:
        for _ in range(a.rounds):
            for name, (kind, fn) in swaps.items():
                head.kernel, quant.int8_mm = kind, fn
                t0 = time.perf_counter()
                [events] = run_to_completion(eng, [(ids, params())])
                per_token[name].append((time.perf_counter() - t0) / a.tokens * 1e3)
                texts[name] = "".join(e.text for e in events if isinstance(e, TextDelta))
    finally:
        head.kernel, quant.int8_mm = kernel0, ours
    print(f"\none greedy stream, {a.tokens} tokens incl. prefill, ms/token per round (min):")
    for name, v in per_token.items():
        print(f"  {name}: " + " ".join(f"{x:.2f}" for x in v) + f" ({min(v):.2f})")
    base = min(per_token["sfcl int8_linear"])
    print("  ratio of the minima to int8_linear: " + ", ".join(f"{n} {min(v) / base:.3f}" for n, v in per_token.items())
          + f"; greedy texts equal to int8_linear's: "
          + ", ".join(f"{n} {texts[n] == texts['sfcl int8_linear']}" for n in texts))

if __name__ == "__main__":
    main()
