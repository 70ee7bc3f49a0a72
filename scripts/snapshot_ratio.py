"""Lookups per mode on one long greedy answer over one long NDA (issue #2's "must show").

    python scripts/snapshot_ratio.py --anchors LIB [--doc-id dev:590] [--max-tokens 400]

Runs the same greedy request in off / triggered / always on the engine (no HTTP), checks that
the three texts are identical, and prints generated tokens, lookups, lookups per 1,000 tokens,
the triggered/always ratio, decode wall time per mode, and lookup latency p50/p99.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sfcl.anchors.corpus import read_corpus
from sfcl.config import EngineConfig, contractnli_path, default_cache_dir
from sfcl.engine.engine import run_to_completion
from sfcl.engine.events import Finished, SnapshotEvent, TextDelta
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import make_llm_engine
from sfcl.library.versions import load_library
from sfcl.model.loader import load_model

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--anchors", required=True, help="anchor library directory")
ap.add_argument("--corpus", default=str(contractnli_path()),
                help="ContractNLI JSON (default: $SFCL_DATA_DIR/contractnli/dev.json, else ../shared/data/contractnli/dev.json)")
ap.add_argument("--doc-id", default="dev:590", help="document id in the corpus (default: a 23.7k-char NDA)")
ap.add_argument("--max-tokens", type=int, default=400)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--cache-dir", default=str(default_cache_dir()))
a = ap.parse_args()
torch.set_num_threads(a.threads)
lm = load_model(None, cache_dir=a.cache_dir)
lib = load_library(a.anchors, expect_fingerprint=lm.fingerprint)
doc = next(d for d in read_corpus([a.corpus]) if d.doc_id == a.doc_id)
q = ("List every obligation of the receiving party in this agreement with its clause number, "
     "and state the term, notice periods and governing law.")
text = lm.tokenizer.apply_chat_template([{"role": "user", "content": doc.text + "\n\n" + q}], tokenize=False,
                                        add_generation_prompt=True)
ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
eng = make_llm_engine(lm, lib, EngineConfig(max_num_seqs=1))
rows, texts = [], {}
for mode in ("off", "triggered", "always"):
    t0 = time.perf_counter()
    [ev] = run_to_completion(eng, [(ids, SamplingParams(max_tokens=a.max_tokens, snapshot_mode=mode))])
    wall = time.perf_counter() - t0
    fin = next(e for e in ev if isinstance(e, Finished))
    snaps = [e for e in ev if isinstance(e, SnapshotEvent)]
    texts[mode] = "".join(e.text for e in ev if isinstance(e, TextDelta))
    lat = sorted(s.lookup_ms for s in snaps)
    rows.append((mode, fin.completion_tokens, len(snaps), 1000 * len(snaps) / fin.completion_tokens, wall,
                 statistics.median(lat) if lat else 0.0, lat[int(0.99 * (len(lat) - 1))] if lat else 0.0,
                 dict(fin.snapshot_summary["triggers"])))
print(f"document {doc.doc_id}: {len(doc.text)} chars, prompt {len(ids)} tokens, library {lib.n_anchors} anchors "
      f"(layer {lib.layer})")
print("| mode | tokens | lookups | per 1k tok | wall s | lookup p50 ms | lookup p99 ms | triggers |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.0f} | {r[4]:.1f} | {r[5]:.2f} | {r[6]:.2f} | {r[7]} |")
print(f"identical text in all modes: {texts['off'] == texts['triggered'] == texts['always']}")
print(f"triggered/always lookups: {rows[1][2]}/{rows[2][2]} = {rows[1][2] / max(1, rows[2][2]):.3f} "
      f"(1/{rows[2][2] / max(1, rows[1][2]):.1f})")
