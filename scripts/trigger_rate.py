"""How often the triggers fire (lookups per 1,000 generated tokens) with the served weight format,
one greedy stream at a time, over questions on ContractNLI NDAs.

    python scripts/trigger_rate.py [--prompts 40] [--tokens 96] [--chars 2000] [--json OUT]

Loads the default model and library as ``sfcl serve`` does (``--weight-quant auto``: the format
and GEMVs of this machine, ``sfcl.engine_stack.served_weights``; set ``$SFCL_INT4_KERNEL`` /
``$SFCL_INT8_KERNEL`` to compare GEMVs), then asks ``--prompts`` questions
(``sfcl.eval.quality.nda_prompts``: the first ``--chars`` characters of each NDA and a question)
one request at a time (decode batches of one row: the packed kernels), ``--tokens`` greedy tokens
each with ``snapshot_mode: triggered``. Prints the lookups per 1,000 tokens; ``--json`` writes
[lookups, tokens] per prompt, which ``--against OTHER.json`` compares with another run's: the
difference of the rates with a 95% bootstrap CI resampled by prompt (one NDA each).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from sfcl.eval.stats import bootstrap_indices, estimate, ratio_of_sums


def rate(rows: list[list[int]]) -> float:
    """Lookups per 1,000 tokens over ``rows`` ([lookups, tokens] per prompt)."""
    r = np.asarray(rows, np.float64)
    return ratio_of_sums(r[:, 0], r[:, 1], scale=1000.0)


def compare(new: list[list[int]], old: list[list[int]], reps: int = 5000) -> dict:
    """Rate difference new - old with its 95% percentile-bootstrap CI (``sfcl.eval.stats``), the
    prompts (one NDA each) resampled in pairs: {"value", "ci_lo", "ci_hi"}. Raises ValueError when
    the runs hold different numbers of prompts."""
    if len(new) != len(old):
        raise ValueError(f"the runs hold {len(new)} and {len(old)} prompts")
    a, b = np.asarray(new, np.float64), np.asarray(old, np.float64)

    def diff(idx):
        return (ratio_of_sums(a[:, 0], a[:, 1], idx, 1000.0) - ratio_of_sums(b[:, 0], b[:, 1], idx, 1000.0))

    return estimate(diff, bootstrap_indices(len(new), reps))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=96, help="greedy tokens per answer (EOS ignored)")
    ap.add_argument("--chars", type=int, default=2000, help="characters of each NDA in its prompt")
    ap.add_argument("--json", default=None, help="write [lookups, tokens] per prompt here")
    ap.add_argument("--against", default=None, help="another run's --json: print the rate difference")
    a = ap.parse_args(argv)

    from tqdm import tqdm

    from sfcl.anchors.corpus import read_corpus
    from sfcl.config import EngineConfig, SnapshotConfig, contractnli_path
    from sfcl.engine.engine import run_to_completion
    from sfcl.engine.events import Finished, SnapshotEvent
    from sfcl.engine.request import SamplingParams
    from sfcl.engine.threads import set_thread_count
    from sfcl.engine_stack import engine_threads, load_anchors, make_llm_engine, served_weights
    from sfcl.eval.quality import nda_prompts
    from sfcl.model.loader import load_model

    set_thread_count(engine_threads(None, None)[0])
    scfg = SnapshotConfig()
    lm = load_model(None, dtype="auto", cache_dir=scfg.cache_dir)
    lib = load_anchors(lm, scfg, False)
    served_weights(lm, "auto")
    eng = make_llm_engine(lm, lib, EngineConfig(max_num_seqs=1, max_model_len=4096), scfg)
    prompts = nda_prompts(lm.tokenizer, read_corpus([str(contractnli_path())]), a.prompts, chars=a.chars)
    rows = []
    for ids in tqdm(prompts, desc="prompts", file=sys.stderr):
        params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True, snapshot_mode="triggered")
        ev = run_to_completion(eng, [(ids, params)])[0]
        fin = next(e for e in ev if isinstance(e, Finished))
        rows.append([sum(isinstance(e, SnapshotEvent) for e in ev), fin.completion_tokens])
    print(f"{sum(r[0] for r in rows)} lookups / {sum(r[1] for r in rows)} tokens = "
          f"{rate(rows):.1f} per 1,000 tokens ({len(rows)} prompts)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f)
    if a.against:
        with open(a.against) as f:
            d = compare(rows, json.load(f))
        print(f"difference against {a.against}: {d['value']:+.1f} per 1,000 tokens "
              f"[95% CI {d['ci_lo']:+.1f}, {d['ci_hi']:+.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
