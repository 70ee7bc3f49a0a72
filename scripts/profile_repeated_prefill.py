"""A long document asked several questions in process: the cold prompt, then the repeats that restore
its prefix from the prefix cache (what the bench's ``longdoc-repeat`` TTFT measures, without HTTP).

Usage: python scripts/profile_repeated_prefill.py [--questions 5] [--tokens 4000] [--snapshot-mode off]
                                                  [--plain-weights] [--profile]

Loads the bundled model as ``sfcl serve`` does (``--dtype auto``, ``--weight-quant auto``, the dense
bf16 weights packed for oneDNN unless ``--plain-weights``: ``sfcl.engine_stack.served_weights``),
then, through ``LLMEngine`` (no HTTP), the bench's long-document messages
(``sfcl.bench.workloads.long_document``: the ContractNLI NDA nearest ``--tokens`` tokens, one
question each), one at a time, each to its first token. Prints per request the prompt tokens, the
chat encoding's milliseconds and the prefill-to-first-token milliseconds (the first cold, the rest
restoring the document from the prefix cache). ``--profile``: one more repeat under torch's
profiler, its costliest operators by self CPU time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sfcl.config import EngineConfig, SnapshotConfig, contractnli_path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--snapshot-mode", default="off", choices=("off", "triggered", "always"))
    ap.add_argument("--plain-weights", action="store_true", help="leave the dense bf16 weights unpacked")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args(argv)

    from sfcl.bench.workloads import long_document
    from sfcl.engine.async_engine import encode_chat
    from sfcl.engine.request import SamplingParams
    from sfcl.engine_stack import load_anchors, make_llm_engine, served_weights
    from sfcl.model.loader import load_model

    lm = load_model(None, dtype="auto")
    scfg = SnapshotConfig()
    lib = load_anchors(lm, scfg, False)
    wq, packed = served_weights(lm, pack_dense=not a.plain_weights)
    eng = make_llm_engine(lm, lib, EngineConfig(), scfg, "cpu", decode_threads=torch.get_num_threads())
    doc = long_document(contractnli_path(), a.tokens, a.questions + 2)
    print(f"{wq.label} weights, {packed} dense weights packed for oneDNN, snapshot mode {a.snapshot_mode}, "
          f"{torch.get_num_threads()} threads", flush=True)

    def ask(i: int) -> tuple[int, float, float]:
        t0 = time.perf_counter()
        ids = encode_chat(lm.tokenizer, doc.messages(i))
        t1 = time.perf_counter()
        eng.add_request(f"q{i}", ids, SamplingParams(max_tokens=1, temperature=0.0, snapshot_mode=a.snapshot_mode))
        while eng.has_work():
            eng.step()
        return len(ids), (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

    repeats = []
    for i in range(a.questions):
        n, enc, ms = ask(i)
        if i:
            repeats.append(ms)
        print(f"question {i} ({'cold' if i == 0 else 'repeat'}): {n} prompt tokens, encode {enc:.1f} ms, "
              f"prefill to first token {ms:.1f} ms", flush=True)
    if repeats:
        print(f"repeats: median {statistics.median(repeats):.1f} ms, max {max(repeats):.1f} ms")
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            n, enc, ms = ask(a.questions)
        print(f"\nprofiled repeat: {n} prompt tokens, {ms:.1f} ms")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
