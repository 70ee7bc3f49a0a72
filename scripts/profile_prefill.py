"""Cold prefill of long NDA prompts in process: one of SFCL's prompt-path kernels against torch's.

Usage: python scripts/profile_prefill.py [--tokens 4000] [--prompts 8] [--data DEV_JSON]
                                         [--compare elementwise|attention] [--profile]

Loads the bundled model as ``sfcl serve`` does (``--dtype auto``, ``--weight-quant auto``, the default
anchor library), then sends, one at a time through ``LLMEngine`` (no HTTP), the first ``--tokens``
tokens of each of the first ``--prompts`` ContractNLI documents that long, each twice with one
token generated, in alternating order: once with SFCL's kernel and once with torch's operators.
``--compare elementwise`` (default): SFCL's element-wise operators (``torch.ops.sfcl.rms_norm``,
``silu_mul``, ``rope_``; ``sfcl.model.llama.native_rows``) against torch's; on a CPU where ``--dtype
auto`` picks float32 they run in float32 (since the twenty-seventh session; before, float32 always
took torch's operators). ``--compare attention``: the prompt chunks' causal attention on SFCL's
kernel for the dtype (``sfcl.model.llama.prefill_attention`` where ``native_prefill_attention``
allows: float32 with AVX2 since the twenty-ninth session, bf16 on AMX tiles or AVX-512 BF16 vectors
since the thirtieth) against torch's SDPA with the chunk's mask; where neither runs both copies take
SDPA, and the script says so. The two copies differ in their first
token, so neither reuses the other's prefix-cache blocks. Prints the wall time of each (the prompt's
prefill and the first token) and the medians; ``--profile`` then prefills the first prompt once more
per copy under torch's profiler and prints each copy's eight costliest operators (self CPU time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sfcl.config import EngineConfig, SnapshotConfig, contractnli_path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--data", default=str(contractnli_path()))
    ap.add_argument("--compare", choices=("elementwise", "attention"), default="elementwise")
    ap.add_argument("--profile", action="store_true", help="then one more prefill per copy under torch's profiler")
    a = ap.parse_args(argv)

    from sfcl.engine.request import SamplingParams
    from sfcl.engine_stack import load_anchors, make_llm_engine, served_weights
    from sfcl.model import llama
    from sfcl.model.loader import load_model

    lm = load_model(None, dtype="auto")
    scfg = SnapshotConfig()
    lib = load_anchors(lm, scfg, False)
    served_weights(lm)  # as sfcl serve holds them (dense bf16 weights packed for oneDNN since 2026-12-07)
    eng = make_llm_engine(lm, lib, EngineConfig(), scfg, "cpu", decode_threads=torch.get_num_threads())
    prompts = []
    for d in json.loads(open(a.data, encoding="utf-8").read())["documents"]:
        ids = lm.tokenizer(d["text"], add_special_tokens=False)["input_ids"]
        if len(ids) >= a.tokens:
            prompts.append(ids[:a.tokens])
        if len(prompts) == a.prompts:
            break
    if not prompts:
        raise SystemExit(f"no document of {a.tokens} tokens in {a.data}")
    name, what = ("native_rows", "element-wise ops") if a.compare == "elementwise" else \
        ("native_prefill_attention", "attention")
    native = getattr(llama, name)
    dtype = next(lm.model.parameters()).dtype
    if a.compare == "attention" and not native(torch.empty(1, dtype=dtype), lm.model.a.head_dim):
        print(f"note: SFCL's prefill attention does not run here ({dtype}; float32 needs a kernel build with AVX2, "
              "bf16 one with AVX-512 BF16): "
              "both copies take torch's SDPA", flush=True)
    times: dict[str, list[float]] = {"SFCL's": [], "torch's": []}
    def prefill(rid: str, first: int, p: list[int]) -> float:
        eng.add_request(rid, [first] + p[1:], SamplingParams(max_tokens=1, temperature=0.0))
        t0 = time.perf_counter()
        while eng.has_work():
            eng.step()
        return time.perf_counter() - t0

    try:
        for i, p in enumerate(prompts):
            for j, mode in enumerate(("SFCL's", "torch's") if i % 2 == 0 else ("torch's", "SFCL's")):
                setattr(llama, name, native if mode == "SFCL's" else (lambda *x: False))
                # a first token of its own: no prefix-cache hit
                times[mode].append(prefill(f"{i}-{j}", 1000 + 2 * i + (mode == "torch's"), p))
            print(f"prompt {i} ({a.tokens} tokens): " + ", ".join(f"{k} {what} {v[-1]:.3f} s"
                                                                 for k, v in times.items()), flush=True)
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            for j, mode in enumerate(("SFCL's", "torch's")):
                setattr(llama, name, native if mode == "SFCL's" else (lambda *x: False))
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    t = prefill(f"profile-{j}", 900 + j, prompts[0])
                print(f"\n{mode} {what}, prompt 0 under the profiler: {t:.3f} s")
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8))
    finally:
        setattr(llama, name, native)
    print(f"median cold prefill, {len(prompts)} prompts of {a.tokens} tokens ({str(dtype).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads): "
          + ", ".join(f"{k} {what} {statistics.median(v):.3f} s" for k, v in times.items()))


if __name__ == "__main__":
    main()
