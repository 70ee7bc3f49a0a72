"""Weight-only INT8 / INT4 linears (``sfcl.model.quant``) vs the unquantized weights: perplexity,
greedy agreement, snapshot-tap drift, and in-process engine step time.

    python scripts/weight_quant_quality.py --docs 12 --tokens 1024 --prompts 8 --gen 48 --speed

- Model dtype: ``--dtype`` (default ``auto``, what ``sfcl serve`` runs: fp32 on an AVX2-only CPU,
  bf16 where the CPU has native bf16). "unquantized" below means that dtype's weights.
- Perplexity: teacher-forced over the first ``--tokens`` tokens of each ContractNLI NDA
  (``../shared/data/contractnli/dev.json``) in ``--chunk``-token chunks, with every linear forced
  onto the packed quantized kernel (``max_rows`` unbounded) so the figure is the quantized
  weights' own, not the dense path that serving uses for prefill chunks. The relative change
  comes with a 95% percentile-bootstrap CI resampled by document (cluster bootstrap: tokens of
  one NDA are not independent). The quality bar of ``sfcl.model.hardware.choose_weight_quant``
  is a change within 1%.
- Tap drift: on the same tokens, cosine between the unquantized and quantized hidden states at the
  snapshot layer of the default anchor library, and how often the nearest anchor (top-1) is the
  same; also whether the model fingerprint (what libraries are tied to) is unchanged.
- Greedy agreement: the engine (real dispatch: packed kernel for decode batches of <= max_rows,
  the dense weights above, so prompts prefill densely) answers ``--prompts`` questions over NDA excerpts;
  share of generated tokens identical up to the first divergence and of identical answers.
- ``--speed``: ms per ``engine.step()`` at decode batch 1 and 16 (median over the decode steps
  after warm-up), like ``sfcl serve`` runs them, snapshot mode ``triggered``.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from sfcl.anchors.corpus import read_corpus
from sfcl.config import EngineConfig, SnapshotConfig, contractnli_path, default_cache_dir
from sfcl.engine.engine import run_to_completion
from sfcl.engine.events import TextDelta
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import load_anchors, make_llm_engine
from sfcl.eval import stats
from sfcl.eval.quality import greedy_agreement, nda_prompts, teacher_forced
from sfcl.library.index import AnchorIndex
from sfcl.model.loader import load_model, model_fingerprint
from sfcl.model.quant import parse_weight_format, quantize_weights, weight_bytes


def step_ms(lm, lib, batch: int, steps: int, ids: list[int]) -> float:
    eng = make_llm_engine(lm, lib, EngineConfig(), SnapshotConfig())
    for i in range(batch):
        eng.add_request(f"r{i}", ids, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True,
                                                     snapshot_mode="triggered"))
    times = []
    while eng.has_work():
        t = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t) * 1e3)
    d = sorted(times[5:])  # the first steps prefill
    return d[len(d) // 2]


def ppl_change_ci(nll: dict[str, list[float]], ntok: list[int], m: str, reps: int = 2000) -> tuple[float, float]:
    """95% cluster-bootstrap CI (documents resampled) of perplexity(m) / perplexity(none) - 1."""
    idx = stats.bootstrap_indices(len(ntok), reps, seed=0)
    n = np.asarray(ntok, np.float64)[idx].sum(1)
    ref = np.exp(np.asarray(nll["none"])[idx].sum(1) / n)
    got = np.exp(np.asarray(nll[m])[idx].sum(1) / n)
    return stats.percentile_ci(got / ref - 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(contractnli_path()),
                   help="ContractNLI JSON (default: $SFCL_DATA_DIR/contractnli/dev.json, else ../shared/data/contractnli/dev.json)")
    ap.add_argument("--docs", type=int, default=4, help="documents for perplexity and tap drift")
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per document")
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk for the teacher-forced pass")
    ap.add_argument("--prompts", type=int, default=8, help="greedy prompts (0: skip)")
    ap.add_argument("--gen", type=int, default=48, help="tokens generated per greedy prompt")
    ap.add_argument("--speed", action="store_true", help="also time engine steps at batch 1 and 16")
    ap.add_argument("--speed-steps", type=int, default=48, help="decode steps per speed run")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--modes", default="int8,int4",
                    help="weight formats to compare with the unquantized model: comma list of MODE[+DENSE][/HEAD] "
                         "(sfcl.model.quant.parse_weight_format), e.g. int4,int4/fp16,fp16")
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: what sfcl serve picks on this CPU)")
    ap.add_argument("--anchors", default=None,
                    help="anchor library for the tap-drift figures (default: sfcl serve's default library)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    modes = [m for m in a.modes.split(",") if m]
    try:
        formats = {m: parse_weight_format(m) for m in modes}
    except ValueError as e:
        ap.error(str(e))
    if any(f[0] == "none" for f in formats.values()):
        ap.error("--modes lists the formats compared with none")
    lm = load_model(None, dtype=a.dtype, cache_dir=default_cache_dir())
    lib = load_anchors(lm, SnapshotConfig(anchors=a.anchors), progress=True)
    index = AnchorIndex(lib)
    models = {"none": lm.model}
    for m, (mode, dense, head) in formats.items():  # packed kernel for every M
        models[m] = quantize_weights(copy.deepcopy(lm.model), mode, max_rows=1 << 30, dense=dense, lm_head=head)
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "model": lm.name,
                 "dtype": str(lm.model.embed_tokens.weight.dtype).removeprefix("torch."),
                 "cpu": torch.backends.cpu.get_cpu_capability(),
                 "threads": torch.get_num_threads(), "layer": lib.layer,
                 "fingerprint_unchanged": {m: model_fingerprint(lm.args, models[m]) == lm.fingerprint for m in modes},
                 "linear_bytes": {m: weight_bytes(models[m]) for m in models}}
    docs = read_corpus([a.data])[: max(a.docs, a.prompts)]
    sums = {m: [0.0, 0] for m in models}
    doc_nll: dict[str, list[float]] = {m: [] for m in models}  # per document, for the cluster bootstrap
    doc_tokens: list[int] = []
    cos = {m: [] for m in modes}
    top1 = {m: [0, 0] for m in modes}
    for d in tqdm(docs[: a.docs], desc="perplexity + tap drift", file=sys.stderr):
        ids = lm.tokenizer(d.text, add_special_tokens=False)["input_ids"][: a.tokens]
        taps = {}
        for m, model in models.items():
            t, n, taps[m] = teacher_forced(model, lm.args, ids, a.chunk, lib.layer, keep_taps=True)
            sums[m][0] += t
            sums[m][1] += n
            doc_nll[m].append(t)
        doc_tokens.append(n)
        ref_ids = index.search(taps["none"], 1)[1][:, 0]
        for m in modes:
            cos[m].append(torch.nn.functional.cosine_similarity(taps[m], taps["none"], dim=-1))
            top1[m][0] += int((index.search(taps[m], 1)[1][:, 0] == ref_ids).sum())
            top1[m][1] += len(ref_ids)
    ppl = {m: math.exp(t / n) for m, (t, n) in sums.items()}
    res["perplexity"] = {"tokens": sums["none"][1], "docs": len(doc_tokens), **ppl,
                         "relative_change": {m: ppl[m] / ppl["none"] - 1 for m in modes},
                         "relative_change_ci95": {m: ppl_change_ci(doc_nll, doc_tokens, m) for m in modes}}
    res["tap"] = {m: {"cos_mean": float(torch.cat(cos[m]).mean()), "cos_min": float(torch.cat(cos[m]).min()),
                      "cos_p01": float(torch.cat(cos[m]).quantile(0.01)),
                      "top1_anchor_agreement": top1[m][0] / max(1, top1[m][1])} for m in modes}
    # serving behaviour from here on: default dispatch (packed kernel only for small M)
    served = {"none": lm}
    for m, (mode, dense, head) in formats.items():
        served[m] = dataclasses.replace(lm, model=quantize_weights(copy.deepcopy(lm.model), mode, dense=dense,
                                                                   lm_head=head))
    del models
    if a.prompts:
        prompts = nda_prompts(lm.tokenizer, docs, a.prompts)
        outs = {}
        for m, slm in served.items():
            # batch 1 at a time (max_num_seqs=1): every decode step takes the packed-kernel path
            eng = make_llm_engine(slm, None, EngineConfig(max_num_seqs=1, prefix_cache_tokens=0,
                                                          max_num_batched_tokens=512))
            outs[m] = []
            for p in tqdm(prompts, desc=f"greedy {m}", file=sys.stderr):
                [ev] = run_to_completion(eng, [(p, SamplingParams(max_tokens=a.gen, snapshot_mode="off"))])
                outs[m].append("".join(e.text for e in ev if isinstance(e, TextDelta)))
        res["greedy"] = {m: greedy_agreement(lm.tokenizer, outs["none"], outs[m]) for m in modes}
    if a.speed:
        ids = lm.tokenizer.encode("Write a long story about a contract between two companies and its "
                                  "confidentiality clauses.")
        res["step_ms"] = {}
        for m, slm in tqdm(served.items(), desc="engine step timing", file=sys.stderr):
            res["step_ms"][m] = {b: step_ms(slm, lib, b, a.speed_steps, ids) for b in (1, 16)}
    report(res, modes, a)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


def report(r: dict, modes: list[str], a) -> None:
    print(f"Weight-only quantization vs {r['dtype']} weights on {r['model']} ({r['date']}, CPU {r['cpu']}, "
          f"{r['threads']} threads)")
    cols = [r["dtype"]] + modes
    print("| figure | " + " | ".join(cols) + " |\n|---|" + "---|" * len(cols))
    lb = r["linear_bytes"]
    print("| linear weights MiB (packed + kept dense) | " + " | ".join(
        f"{(lb[m]['packed'] + lb[m]['dense']) / 2**20:.0f} ({lb[m]['packed'] / 2**20:.0f} + {lb[m]['dense'] / 2**20:.0f})"
        for m in ["none"] + modes) + " |")
    pp = r["perplexity"]
    print(f"| perplexity ({pp['tokens']} tokens of {pp['docs']} NDAs, packed kernels; change [95% CI by document]) | "
          f"{pp['none']:.3f} | " + " | ".join(
        f"{pp[m]:.3f} ({100 * pp['relative_change'][m]:+.2f}% [{100 * pp['relative_change_ci95'][m][0]:+.2f}, "
        f"{100 * pp['relative_change_ci95'][m][1]:+.2f}])" for m in modes) + " |")
    t = r["tap"]
    print(f"| layer-{r['layer']} tap cosine mean / p01 / min | 1 | " + " | ".join(
        f"{t[m]['cos_mean']:.4f} / {t[m]['cos_p01']:.4f} / {t[m]['cos_min']:.4f}" for m in modes) + " |")
    print("| nearest-anchor (top-1) agreement | 100% | " + " | ".join(
        f"{100 * t[m]['top1_anchor_agreement']:.1f}%" for m in modes) + " |")
    print("| model fingerprint unchanged | yes | " + " | ".join(
        "yes" if r["fingerprint_unchanged"][m] else "NO" for m in modes) + " |")
    if "greedy" in r:
        g = r["greedy"]
        print(f"| greedy: tokens before first divergence ({g[modes[0]]['prompts']} prompts x {a.gen}) | 100% | "
              + " | ".join(f"{100 * g[m]['prefix_agreement']:.1f}%" for m in modes) + " |")
        print("| greedy: identical answers | 100% | " + " | ".join(
            f"{100 * g[m]['identical_answers']:.0f}%" for m in modes) + " |")
    if "step_ms" in r:
        s = r["step_ms"]
        for b in (1, 16):
            print(f"| engine step ms, batch {b} (median) | {s['none'][b]:.1f} | " + " | ".join(
                f"{s[m][b]:.1f} ({s['none'][b] / s[m][b]:.2f}x)" for m in modes) + " |")


if __name__ == "__main__":
    sys.exit(main())
