"""Snapshot lookup latency and recall@3 of the server's anchor index against exact search, on real
NDA hidden states.

    python scripts/anchor_search_bench.py --anchors LIB [--docs 8] [--reps 2000]

Query states: the snapshot-layer hidden states of greedy answers (and of the chat-format prompts
that asked for them) to questions about ContractNLI NDAs, from the served model; the answers are
what a server looks up. Exact reference: float32 dense search over every anchor. Candidate: the
index the server builds (``Snapshotter``'s ``AnchorIndex``: IVF on the CPU for large libraries).
Latency is measured as the server runs a lookup: on one thread with one torch thread
(``sfcl.engine.threads.set_thread_count(1)``, the lookup thread's setting), for batches of 1 and
16 rows, while (``busy``) another thread runs the model's forward on the other torch threads, as
the engine does, and while the process is otherwise idle (``idle``). Peer in the same run: the
exact dense float32 search. Prints index build time and memory, recall@3 and p50/p99 per case.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np
import torch

from sfcl.anchors.builder import CALIBRATION_INSTRUCTIONS, _paragraphs
from sfcl.anchors.corpus import read_corpus
from sfcl.anchors.model_pass import run_windows
from sfcl.config import EngineConfig, default_cache_dir
from sfcl.engine.engine import run_to_completion
from sfcl.engine.events import Finished, TextDelta
from sfcl.engine.request import SamplingParams
from sfcl.engine.threads import set_thread_count
from sfcl.engine_stack import make_llm_engine
from sfcl.library.index import AnchorIndex
from sfcl.library.versions import load_library
from sfcl.model.hardware import cpu_flags, fast_float_dtype
from sfcl.model.loader import load_model

QUESTION = "Who has to keep what confidential here, for how long, and what are the exceptions?"


def query_states(lm, docs, layer: int, max_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Snapshot-layer states (n, H) float32 of greedy answers to one chat prompt per document, and
    a bool mask (n,) of which rows are answer (generated) positions."""
    tok = lm.tokenizer
    prompts = []
    for i, d in enumerate(docs):
        para = " ".join(_paragraphs(d.text)[:2])
        text = f"{CALIBRATION_INSTRUCTIONS[i % len(CALIBRATION_INSTRUCTIONS)]}\n\n{para}\n\n{QUESTION}"
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        prompts.append(list(tok(chat, add_special_tokens=False)["input_ids"]))
    eng = make_llm_engine(lm, None, EngineConfig(max_num_seqs=len(prompts)))
    events = run_to_completion(eng, [(p, SamplingParams(max_tokens=max_tokens)) for p in prompts])
    windows, answer = [], []
    for p, ev in zip(prompts, events):
        text = "".join(e.text for e in ev if isinstance(e, TextDelta))
        assert any(isinstance(e, Finished) for e in ev)
        ans = list(tok(text, add_special_tokens=False)["input_ids"])
        windows.append(p + ans)
        answer.append(torch.arange(len(p) + len(ans) - 1) >= len(p) - 1)  # state at i predicts token i+1
    outs = run_windows(lm.model, windows, layer, 1)
    return torch.cat([o.hidden for o in outs]), torch.cat(answer)


def recall_at(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean share of each row's exact top-k ids that the candidate search returned."""
    return float(np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(ref.tolist(), got.tolist())]))


def latency(indexes: list[AnchorIndex], q: torch.Tensor, rows: int, reps: int) -> list[np.ndarray]:
    """Per-call milliseconds of each index's ``search`` on batches of ``rows`` queries, the indexes
    called in turn on the same batch (ABAB...: both see the same load)."""
    out = [np.empty(reps) for _ in indexes]
    for i in range(reps):
        s = (i * rows) % (q.shape[0] - rows)
        batch = q[s : s + rows]
        for j, ix in enumerate(indexes):
            t0 = time.perf_counter()
            ix.search(batch, 3)
            out[j][i] = (time.perf_counter() - t0) * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--anchors", required=True, help="anchor library (root or directory)")
    ap.add_argument("--corpus", default=str(Path(__file__).resolve().parents[2] / "shared/data/contractnli/dev.json"))
    ap.add_argument("--docs", type=int, default=8, help="NDAs to ask about (the last N of the corpus)")
    ap.add_argument("--max-tokens", type=int, default=64, help="greedy answer tokens per NDA")
    ap.add_argument("--reps", type=int, default=2000, help="timed searches per case")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the model (the engine's)")
    ap.add_argument("--cache-dir", default=str(default_cache_dir()))
    ap.add_argument("--nprobe", type=int, nargs="+", default=[None],
                    help="IVF cells scanned per query; several values compare them on the same queries "
                         "(default: the server's, sfcl.library.index.IVF_NPROBE)")
    ap.add_argument("--group-probe", type=int, nargs="+", default=[None],
                    help="groups of cells ranked per query; several values compare them (default: the server's, "
                         "sfcl.library.index.IVF_GROUP_PROBE)")
    ap.add_argument("--list-size", type=int, default=None,
                    help="anchors per IVF cell on average (default: the server's, sfcl.library.index.IVF_LIST_SIZE)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(None, cache_dir=a.cache_dir)
    lib = load_library(a.anchors, expect_fingerprint=lm.fingerprint)
    docs = read_corpus([a.corpus])[-a.docs:]
    t0 = time.perf_counter()
    q, is_answer = query_states(lm, docs, lib.layer, a.max_tokens)
    print(f"queries: {q.shape[0]} states ({int(is_answer.sum())} of generated answer tokens) from {len(docs)} NDAs "
          f"in {time.perf_counter() - t0:.1f} s")
    exact = AnchorIndex(lib, torch.float32)
    # what Snapshotter builds on a CPU, once per --nprobe x --group-probe value (same seed: the same cells)
    ivfs = [AnchorIndex(lib, fast_float_dtype(), approximate=True, nprobe=n, list_size=a.list_size, group_probe=g)
            for n in a.nprobe for g in a.group_probe]
    print(f"library: {lib.n_anchors} anchors x {lib.hidden_size} ({lib.path})")
    print(f"index: {ivfs[0].kind}, {ivfs[0].cells.nlist if ivfs[0].cells is not None else 0} cells "
          f"in {ivfs[0].cells.ngroups if ivfs[0].cells is not None else 0} groups, built in {ivfs[0].build_s * 1e3:.0f} ms, "
          f"{ivfs[0].memory_bytes() / 2**20:.1f} MiB beyond the mapped library; exact peer: dense float32, "
          f"{exact.memory_bytes() / 2**20:.1f} MiB")
    _, ref = exact.search(q, 3)
    for index in ivfs:
        _, got = index.search(q, 3)
        for name, m in (("answer tokens", is_answer), ("prompt tokens", ~is_answer), ("all", torch.ones_like(is_answer))):
            print(f"nprobe {index.nprobe}, group probe {index.group_probe}: recall@3 vs exact, {name}: {recall_at(ref[m], got[m]):.4f} "
                  f"({int(m.sum())} queries)")

    stop = threading.Event()

    def engine_like() -> None:  # the engine's forward on its threads while lookups run
        set_thread_count(a.threads)
        ids = lm.tokenizer(docs[0].text, add_special_tokens=False)["input_ids"][:256]
        while not stop.is_set():
            run_windows(lm.model, [ids], lib.layer, 1)

    res = {}
    for load in ("idle", "busy"):
        bg = threading.Thread(target=engine_like, daemon=True) if load == "busy" else None
        if bg:
            bg.start()
        box = {}

        def lookups() -> None:
            set_thread_count(1)  # the lookup thread's setting (sfcl.engine.model_runner)
            for rows in (1, 16):
                box[rows] = latency([exact] + ivfs, q, rows, a.reps if rows == 1 else a.reps // 4)

        t = threading.Thread(target=lookups)
        t.start()
        t.join()
        if bg:
            stop.set()
            bg.join()
        res[load] = box
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()}, avx512_bf16={'avx512_bf16' in cpu_flags()}; "
          f"lookup thread: 1 torch thread; busy = the model's forward on {a.threads} threads alongside")
    print("| load | rows | nprobe | group probe | index p50 ms | index p99 ms | exact p50 ms | exact p99 ms | p50 speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for load, box in res.items():
        for rows in (1, 16):
            e, *got = box[rows]
            for index, i in zip(ivfs, got):
                print(f"| {load} | {rows} | {index.nprobe} | {index.group_probe} | {np.percentile(i, 50):.3f} | {np.percentile(i, 99):.3f} | "
                      f"{np.percentile(e, 50):.3f} | {np.percentile(e, 99):.3f} | "
                      f"{np.percentile(e, 50) / np.percentile(i, 50):.1f}x |")


if __name__ == "__main__":
    main()
