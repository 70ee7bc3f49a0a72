"""Questions about one document decoded together, with and without shared-prefix decode attention
(``sfcl.engine.scheduler.decode_groups``, ``sfcl.model.llama.Attention._grouped_decode``).

    python scripts/profile_shared_prefix.py [--doc-tokens 1500] [--questions 16] [--max-tokens 64]
                                            [--rounds 3] [--threads N] [--dtype auto]

Two engines on one loaded model (the default SmolLM2-135M-Instruct, ``--dtype auto``, default weight
format), identical except ``EngineConfig.shared_prefix_attention``, answer the same ``--questions``
greedy questions about one ContractNLI NDA cut to ``--doc-tokens`` tokens (``ignore_eos``: every
answer is ``--max-tokens`` long), all submitted at once, ``--rounds`` rounds in alternating order.
A fresh engine per round, so each round computes the document once (the other questions wait for
its blocks and restore them). Prints per round and system: wall seconds, decode steps, mean decode
step ms, decode tokens/s (tokens after each request's first / wall time after the last first
token), prompt tokens computed and restored; and the ratio grouped / plain per round. Answers of
the two systems are compared token for token.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--doc-tokens", type=int, default=1500)
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--anchors", default=None, help="library directory: requests take snapshots (default: none)")
    ap.add_argument("--snapshot-mode", default="off", choices=["off", "triggered", "always"])
    ap.add_argument("--steer", default="", help="steering mechanisms of every request (e.g. source)")
    ap.add_argument("--profile", action="store_true", help="cProfile the last grouped run's steps (top 25)")
    a = ap.parse_args(argv)

    import torch

    from sfcl.anchors.corpus import read_corpus
    from sfcl.config import EngineConfig, contractnli_path
    from sfcl.engine.events import Finished, TextDelta
    from sfcl.engine.request import SamplingParams
    from sfcl.engine_stack import make_llm_engine
    from sfcl.model.hardware import cpu_flags
    from sfcl.model.loader import load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    lm = load_model(None, dtype=a.dtype)
    isa = sorted(f for f in cpu_flags() if f.startswith(("avx2", "avx512", "amx")))
    print(f"CPU: {torch.backends.cpu.get_cpu_capability()} ({' '.join(isa)}); torch threads {torch.get_num_threads()}; "
          f"dtype {next(lm.model.parameters()).dtype}")
    doc = max(read_corpus([str(contractnli_path())])[:12], key=lambda d: len(d.text))
    ids = lm.tokenizer(doc.text, add_special_tokens=False)["input_ids"][:a.doc_tokens]
    text = lm.tokenizer.decode(ids)
    prompts = []
    for j in range(a.questions):
        msg = f"Contract:\n{text}\n\nQuestion {j + 1}: what does clause {j + 1} of this contract say?"
        chat = lm.tokenizer.apply_chat_template([{"role": "user", "content": msg}], tokenize=False,
                                                add_generation_prompt=True)
        prompts.append(lm.tokenizer(chat, add_special_tokens=False)["input_ids"])
    params = SamplingParams(max_tokens=a.max_tokens, snapshot_mode=a.snapshot_mode, steer=a.steer or (),
                            ignore_eos=True)
    lib = None
    if a.anchors:
        from sfcl.library.versions import load_library
        lib = load_library(a.anchors, expect_fingerprint=lm.fingerprint, expect_hidden_size=lm.args.hidden_size)
    print(f"{a.questions} questions x {a.max_tokens} tokens about {doc.doc_id} ({len(ids)} document tokens, "
          f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens)")

    def run(shared: bool, prof=None) -> dict:
        eng = make_llm_engine(lm, lib, EngineConfig(max_num_seqs=a.questions, shared_prefix_attention=shared))
        for i, p in enumerate(prompts):
            eng.add_request(f"q{i}", p, params)
        out: dict[str, int] = {}
        texts: dict[str, list[str]] = {f"q{i}": [] for i in range(len(prompts))}
        steps, step_ms, computed, restored = 0, [], 0, 0
        t0 = time.perf_counter()
        t_first = None
        while eng.has_work():
            ts = time.perf_counter()
            if prof is not None:
                prof.enable()
            events = eng.step()
            if prof is not None:
                prof.disable()
            dt = (time.perf_counter() - ts) * 1e3
            st = eng.last_stats
            computed += st.prefill_tokens
            restored += st.prefix_cache_hits
            if st.decode_batch and not st.prefill_tokens:
                steps += 1
                step_ms.append(dt)
                if t_first is None:
                    t_first = ts
            for rid, ev in events:
                if isinstance(ev, Finished):
                    out[rid] = ev.completion_tokens
                elif isinstance(ev, TextDelta):
                    texts[rid].append(ev.text)
        wall = time.perf_counter() - t0
        toks = sum(out.values()) - len(out)
        return dict(wall=wall, steps=steps, step_ms=statistics.mean(step_ms) if step_ms else float("nan"),
                    tps=toks / (time.perf_counter() - t_first) if t_first else float("nan"),
                    computed=computed, restored=restored, texts=["".join(texts[k]) for k in sorted(texts)])

    ratios, prof = [], None
    for r in range(a.rounds):
        res = {}
        for shared in ((True, False) if r % 2 == 0 else (False, True)):
            if a.profile and shared and r == a.rounds - 1:
                import cProfile
                prof = cProfile.Profile()
            res[shared] = run(shared, prof if shared else None)
            x = res[shared]
            print(f"round {r + 1} {'grouped' if shared else 'plain  '}: wall {x['wall']:.1f} s, {x['steps']} pure decode "
                  f"steps at {x['step_ms']:.1f} ms, decode {x['tps']:.1f} tok/s, prompt tokens computed "
                  f"{x['computed']}, restored {x['restored']}", flush=True)
        ratios.append(res[True]["tps"] / res[False]["tps"])
        same = sum(x == y for x, y in zip(res[True]["texts"], res[False]["texts"]))
        print(f"round {r + 1}: grouped / plain decode tok/s = {ratios[-1]:.2f}x; identical answers {same}/{len(prompts)}",
              flush=True)
    print(f"grouped / plain: mean {statistics.mean(ratios):.2f}x [min {min(ratios):.2f}, max {max(ratios):.2f}] "
          f"over {a.rounds} rounds")
    if prof is not None:
        import pstats
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
