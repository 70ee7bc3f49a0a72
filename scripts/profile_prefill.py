"""Cold prefill of long NDA prompts in process: SFCL's element-wise operators against torch's.

Usage: python scripts/profile_prefill.py [--tokens 4000] [--prompts 8] [--data DEV_JSON]

Loads the bundled model as ``sfcl serve`` does (``--dtype auto``, ``--weight-quant auto``, the default
anchor library), then sends, one at a time through ``LLMEngine`` (no HTTP), the first ``--tokens``
tokens of each of the first ``--prompts`` ContractNLI documents that long, each twice with one
token generated: once with SFCL's element-wise operators (``torch.ops.sfcl.rms_norm``, ``silu_mul``,
``rope_``; ``sfcl.model.llama.native_rows``) and once with torch's, in alternating order. The two
copies differ in their first token, so neither reuses the other's prefix-cache blocks. Prints the
wall time of each (the prompt's prefill and the first token) and the medians. On a CPU where
``--dtype auto`` picks float32 the operators run in float32 (since the twenty-seventh session; before,
float32 always took torch's operators).
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
    a = ap.parse_args(argv)

    from sfcl.engine.request import SamplingParams
    from sfcl.engine_stack import load_anchors, make_llm_engine
    from sfcl.model import llama
    from sfcl.model.hardware import resolve_weight_format
    from sfcl.model.loader import load_model
    from sfcl.model.quant import quantize_weights

    lm = load_model(None, dtype="auto")
    scfg = SnapshotConfig()
    lib = load_anchors(lm, scfg, False)
    wq = resolve_weight_format("auto", next(lm.model.parameters()).dtype)
    quantize_weights(lm.model, wq.mode, max_rows=wq.max_rows, dense=wq.dense, lm_head=wq.lm_head,
                     head_max_rows=wq.head_max_rows)
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
    native_rows = llama.native_rows
    times: dict[str, list[float]] = {"SFCL's": [], "torch's": []}
    try:
        for i, p in enumerate(prompts):
            for j, mode in enumerate(("SFCL's", "torch's") if i % 2 == 0 else ("torch's", "SFCL's")):
                llama.native_rows = native_rows if mode == "SFCL's" else (lambda *x: False)
                first = 1000 + 2 * i + (mode == "torch's")  # a first token of its own: no prefix-cache hit
                eng.add_request(f"{i}-{j}", [first] + p[1:], SamplingParams(max_tokens=1, temperature=0.0))
                t0 = time.perf_counter()
                while eng.has_work():
                    eng.step()
                times[mode].append(time.perf_counter() - t0)
            print(f"prompt {i} ({a.tokens} tokens): " + ", ".join(f"{k} element-wise ops {v[-1]:.3f} s"
                                                                 for k, v in times.items()), flush=True)
    finally:
        llama.native_rows = native_rows
    dtype = str(next(lm.model.parameters()).dtype).removeprefix("torch.")
    print(f"median cold prefill, {len(prompts)} prompts of {a.tokens} tokens ({dtype}, {torch.get_num_threads()} threads): "
          + ", ".join(f"{k} element-wise ops {statistics.median(v):.3f} s" for k, v in times.items()))


if __name__ == "__main__":
    main()
