"""INT8 KV cache vs the model-dtype (bf16) KV cache: memory per token, perplexity, greedy agreement.

    python scripts/kv_int8_quality.py --docs 8 --tokens 2048 --prompts 8 --gen 64

Perplexity is teacher-forced over the first ``--tokens`` tokens of each ContractNLI NDA
(``../shared/data/contractnli/dev.json``), fed in ``--chunk``-token prefill chunks so that every
chunk after the first attends to the *stored* KV (quantized in the INT8 run). Greedy agreement runs
the engine on ``--prompts`` questions over NDA excerpts with both caches and reports the share of
generated tokens identical up to the first divergence, and the share of fully identical answers.
Targets (issue 3): INT8 KV bytes/token <= 0.55x bf16, perplexity within 1% of bf16.
Writes a JSON next to the printout with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from sfcl.anchors.corpus import read_corpus
from sfcl.config import EngineConfig, contractnli_path, default_cache_dir
from sfcl.engine.engine import run_to_completion
from sfcl.engine.events import TextDelta
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import make_llm_engine
from sfcl.eval.quality import greedy_agreement, nda_prompts, teacher_forced
from sfcl.model.kv_cache import KVCache
from sfcl.model.loader import load_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(contractnli_path()),
                   help="ContractNLI JSON (default: $SFCL_DATA_DIR/contractnli/dev.json, else ../shared/data/contractnli/dev.json)")
    ap.add_argument("--docs", type=int, default=8, help="documents for perplexity")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per document")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk for the teacher-forced pass")
    ap.add_argument("--prompts", type=int, default=8, help="greedy prompts")
    ap.add_argument("--gen", type=int, default=64, help="tokens generated per greedy prompt")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    lm = load_model(None, dtype=torch.bfloat16, cache_dir=default_cache_dir())
    docs = read_corpus([a.data])[: max(a.docs, a.prompts)]
    res: dict = {"date": time.strftime("%Y-%m-%d"), "model": lm.name}
    bf = KVCache(lm.args, 1, 16, torch.bfloat16)
    q8 = KVCache(lm.args, 1, 16, torch.bfloat16, kv_dtype="int8")
    res["bytes_per_token"] = {"bf16": bf.bytes_per_token, "int8": q8.bytes_per_token,
                              "ratio": q8.bytes_per_token / bf.bytes_per_token}
    sums = {"auto": [0.0, 0], "int8": [0.0, 0]}
    for d in tqdm(docs[: a.docs], desc="perplexity", file=sys.stderr):
        ids = lm.tokenizer(d.text, add_special_tokens=False)["input_ids"][: a.tokens]
        for k in sums:
            t, n, _ = teacher_forced(lm.model, lm.args, ids, a.chunk, kv_dtype=k)
            sums[k][0] += t
            sums[k][1] += n
    ppl = {k: math.exp(t / n) for k, (t, n) in sums.items()}
    res["perplexity"] = {"bf16": ppl["auto"], "int8": ppl["int8"], "relative_change": ppl["int8"] / ppl["auto"] - 1,
                         "tokens": sums["auto"][1]}
    prompts = nda_prompts(lm.tokenizer, docs, a.prompts)
    outs = {}
    for k in ("auto", "int8"):
        eng = make_llm_engine(lm, None, EngineConfig(max_num_seqs=8, kv_cache_dtype=k, prefix_cache_tokens=0))
        evs = run_to_completion(eng, [(p, SamplingParams(max_tokens=a.gen, snapshot_mode="off")) for p in
                                      tqdm(prompts, desc=f"greedy {k}", file=sys.stderr)])
        outs[k] = ["".join(e.text for e in ev if isinstance(e, TextDelta)) for ev in evs]
    res["greedy"] = greedy_agreement(lm.tokenizer, outs["auto"], outs["int8"])
    r = res
    print(f"INT8 KV vs bf16 KV on {lm.name} ({r['date']})")
    print(f"| figure | bf16 KV | INT8 KV | ratio / change | target |\n|---|---|---|---|---|")
    bpt = r["bytes_per_token"]
    print(f"| KV bytes per token | {bpt['bf16']:.0f} | {bpt['int8']:.0f} | {bpt['ratio']:.3f}x | <= 0.55x "
          f"{'PASS' if bpt['ratio'] <= 0.55 else 'FAIL'} |")
    pp = r["perplexity"]
    print(f"| perplexity ({pp['tokens']} NDA tokens) | {pp['bf16']:.3f} | {pp['int8']:.3f} | "
          f"{100 * pp['relative_change']:+.2f}% | within 1% {'PASS' if abs(pp['relative_change']) <= 0.01 else 'FAIL'} |")
    g = r["greedy"]
    print(f"| greedy agreement ({g['prompts']} prompts x {a.gen} tokens) | - | - | "
          f"{100 * g['prefix_agreement']:.1f}% tokens before first divergence, {100 * g['identical_answers']:.0f}% "
          f"identical answers | reported |")
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
