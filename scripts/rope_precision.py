"""What RoPE's frequencies in bf16 cost: perplexity on real NDAs of a bf16 model whose rotary
frequencies are float32 (SFCL since 2026-12-06) against one whose frequencies were rounded to bf16
(what ``model.to(torch.bfloat16)`` did to the ``inv_freq`` buffer before), with float32 beside both.

    python scripts/rope_precision.py --docs 61 --tokens 2048

- Teacher-forced over the first ``--tokens`` tokens of each ContractNLI dev NDA
  (``../shared/data/contractnli/dev.json``) in ``--chunk``-token prefill chunks, as served
  (``sfcl.eval.quality.token_nll``).
- Arms: ``bf16`` (float32 frequencies), ``bf16-rounded`` (the same bf16 weights with the tables of
  bf16-rounded frequencies), ``fp32`` (float32 weights and frequencies).
- Perplexity per arm and per position band; the relative change of ``bf16-rounded`` against
  ``bf16``, and of each against ``fp32``, with 95% percentile-bootstrap CIs resampled by document.
- Guard: how often each bf16 arm's per-position NLL is within 0.1 nats of fp32's.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from tqdm import tqdm

from sfcl.anchors.corpus import read_corpus
from sfcl.config import contractnli_path, default_cache_dir
from sfcl.eval import stats
from sfcl.eval.quality import token_nll
from sfcl.model.loader import load_model

BANDS = ((0, 256), (256, 1024), (1024, 2048), (2048, 1 << 30))


def rounded_rope(model) -> None:
    """Give ``model`` the rotary tables of its frequencies rounded to bf16 (the old behaviour)."""
    model.set_rope(model.inv_freq.to(torch.bfloat16).float(), model.a.max_position_embeddings)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(contractnli_path()), help="ContractNLI dev.json")
    ap.add_argument("--docs", type=int, default=61, help="documents (the first N)")
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per document (its first)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args()
    docs = read_corpus([a.data])[: a.docs]
    lms = {"bf16": load_model(None, dtype=torch.bfloat16, cache_dir=default_cache_dir()),
           "bf16-rounded": load_model(None, dtype=torch.bfloat16, cache_dir=default_cache_dir()),
           "fp32": load_model(None, dtype=torch.float32, cache_dir=default_cache_dir())}
    rounded_rope(lms["bf16-rounded"].model)
    tok = lms["fp32"].tokenizer
    ids = [tok(d.text, add_special_tokens=False)["input_ids"][: a.tokens] for d in docs]
    nll = {k: [] for k in lms}  # arm -> per document (n,) float32 nats
    with tqdm(total=len(ids) * len(lms), desc="teacher-forced passes", unit="doc") as bar:
        for d in ids:
            for k, lm in lms.items():
                with torch.inference_mode():
                    nll[k].append(token_nll(lm.model, lm.args, d, a.chunk)[0].numpy())
                bar.update()
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
          f"{len(ids)} NDAs, {sum(len(x) for x in nll['fp32'])} predicted tokens", file=sys.stderr)
    idx = stats.bootstrap_indices(len(ids), 2000, seed=0)
    out = {"docs": len(ids), "tokens": a.tokens, "chunk": a.chunk, "bands": {}}
    for lo, hi in BANDS:
        sums = {k: np.array([x[lo:hi].astype(np.float64).sum() for x in v]) for k, v in nll.items()}
        cnt = np.array([max(0, min(hi, len(x)) - lo) for x in nll["fp32"]], np.float64)
        if cnt.sum() == 0:
            continue
        ppl = {k: float(np.exp(s.sum() / cnt.sum())) for k, s in sums.items()}
        boot = {k: np.exp(s[idx].sum(1) / cnt[idx].sum(1)) for k, s in sums.items()}
        row = {"tokens": int(cnt.sum()), "ppl": ppl}
        for num, den in (("bf16-rounded", "bf16"), ("bf16", "fp32"), ("bf16-rounded", "fp32")):
            lo_ci, hi_ci = stats.percentile_ci(boot[num] / boot[den] - 1)
            row[f"{num} vs {den}"] = {"change": ppl[num] / ppl[den] - 1, "ci95": [lo_ci, hi_ci]}
        close = {k: float(np.mean(np.concatenate([np.abs(x[lo:hi] - f[lo:hi]) <= 0.1 for x, f in
                                                  zip(nll[k], nll["fp32"])]))) for k in ("bf16", "bf16-rounded")}
        row["within 0.1 nats of fp32"] = close
        out["bands"][f"{lo}-{hi if hi < 1 << 30 else 'end'}"] = row
        print(f"positions {lo}-{hi if hi < 1 << 30 else 'end'} ({int(cnt.sum())} tokens): perplexity "
              + ", ".join(f"{k} {v:.3f}" for k, v in ppl.items()))
        for key in ("bf16-rounded vs bf16", "bf16 vs fp32", "bf16-rounded vs fp32"):
            r = row[key]
            print(f"  {key}: {100 * r['change']:+.2f}% (95% CI {100 * r['ci95'][0]:+.2f}% to {100 * r['ci95'][1]:+.2f}%)")
        print(f"  positions within 0.1 nats of fp32: bf16 {close['bf16']:.3f}, bf16-rounded {close['bf16-rounded']:.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
