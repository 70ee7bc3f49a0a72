"""SFCL's int8 GEMV (``torch.ops.sfcl.int8_linear``) against torch's ``_weight_int8pack_mm``.

    python scripts/profile_int8_linear.py [--reps 40] [--tokens 128] [--rounds 4] [--threads 2]

1. The default model's int8 ``lm_head`` (49,152 x 576, the default weight format's head) at M = 1
   and 4 rows, each kernel timed warm and right after copying 96 MB (a decode step's weight
   traffic, which the head follows), p50 over ``--reps`` calls.
2. The engine (default weight format, snapshots on, fused decode layers) decoding one greedy
   stream of ``--tokens`` tokens, the two kernels alternating run by run for ``--rounds`` rounds
   in one process (``sfcl.model.quant.int8_mm`` swapped); ms per token including the prefill, and
   whether the greedy texts are equal.

Prints the CPU, the figures of both kernels and their ratio.
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
    quant.quantize_weights(lm.model, wq.mode, max_rows=wq.max_rows, dense=wq.dense, lm_head=wq.lm_head)
    head = lm.model.lm_head
    if not (isinstance(head, quant.QuantLinear) and head.mode == "int8"):
        raise SystemExit(f"the default weight format here ({wq}) has no int8 lm_head")
    src = torch.empty(96 * 2**20 // 4)
    dst = torch.empty_like(src)
    kernels = {"sfcl int8_linear": torch.ops.sfcl.int8_linear, "torch _weight_int8pack_mm": torch._weight_int8pack_mm}
    print(f"| lm_head {head.out_features} x {head.in_features} int8, p50 ms | " + " | ".join(kernels) + " | ratio |")
    print("|---|---|---|---|")
    for M in (1, 2, 3, 4):
        x = torch.randn(M, head.in_features).to(quant.KERNEL_DTYPE)
        for evict in (None, (src, dst)):
            t = [p50_ms(lambda k=k: k(x, head.qweight, head.scales), a.reps, evict) for k in kernels.values()]
            print(f"| M = {M}, {'after a 96 MB copy' if evict else 'warm'} | {t[0]:.3f} | {t[1]:.3f} | {t[0] / t[1]:.2f}x |")

    lib = load_anchors(lm, scfg, False)
    eng = make_llm_engine(lm, lib, EngineConfig(max_num_seqs=16), scfg)
    ids = lm.tokenizer("Summarise the confidentiality obligations of the receiving party in this agreement.",
                       add_special_tokens=False)["input_ids"]

    def params() -> SamplingParams:
        return SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)

    run_to_completion(eng, [(ids, params())])  # warm-up
    ours = quant.int8_mm
    swaps = {"sfcl int8_linear": ours, "torch _weight_int8pack_mm": torch._weight_int8pack_mm}
    per_token: dict[str, list[float]] = {k: [] for k in swaps}
    texts: dict[str, str] = {}
    try:
        for _ in range(a.rounds):
            for name, fn in swaps.items():
                quant.int8_mm = fn
                t0 = time.perf_counter()
                [events] = run_to_completion(eng, [(ids, params())])
                per_token[name].append((time.perf_counter() - t0) / a.tokens * 1e3)
                texts[name] = "".join(e.text for e in events if isinstance(e, TextDelta))
    finally:
        quant.int8_mm = ours
    print(f"\none greedy stream, {a.tokens} tokens incl. prefill, ms/token per round (min):")
    for name, v in per_token.items():
        print(f"  {name}: " + " ".join(f"{x:.2f}" for x in v) + f" ({min(v):.2f})")
    print(f"  ratio of the minima {min(per_token['sfcl int8_linear']) / min(per_token['torch _weight_int8pack_mm']):.3f}; "
          f"same greedy text: {len(set(texts.values())) == 1}")


if __name__ == "__main__":
    main()
