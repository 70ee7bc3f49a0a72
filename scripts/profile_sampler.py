"""Time the engine step's token path on the CPU: log-softmax, entropy, sampling, token logprob.

Usage: python scripts/profile_sampler.py [--rows 16] [--vocab 49152] [--threads 1]
                                         [--compare-with OLD_SAMPLER.py]

Runs what ``ModelRunner.execute`` does after the forward, on random logits of ``rows`` x
``vocab`` (float32): greedy rows, rows at temperature 1 and 0.7 with top_p 1, and rows with
top_p 0.9 on peaked and on flat logits (flat ones need the nucleus sampler's full-sort fallback).
Prints the p50 time per step in ms. ``--compare-with`` loads another version of
``sfcl/model/sampler.py`` (``sfcl/engine/sampler.py`` before it moved; e.g. ``git show a5fbd4f:sfcl/engine/sampler.py > /tmp/old.py``) and
times both in the same process, alternating step by step: between processes these timings move
by up to 3x on this VM (the allocator hands out fresh pages for the (rows, vocab) temporaries or
reuses them), within one process the two see the same conditions.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--compare-with", help="path of another sampler.py to time alongside")
    a = ap.parse_args(argv)

    import importlib.util
    import inspect

    from sfcl.model import sampler

    samplers = {"this": sampler.sample}
    if a.compare_with:
        spec = importlib.util.spec_from_file_location("sfcl_old_sampler", a.compare_with)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        samplers["other"] = old.sample
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    flat = torch.randn(a.rows, a.vocab, generator=g) * 0.5
    peaked = torch.randn(a.rows, a.vocab, generator=g) * 6
    gens = [torch.Generator().manual_seed(i) for i in range(a.rows)]

    def token_path(sample, logits: torch.Tensor, temperature: float, top_p: float) -> None:
        n = logits.shape[0]
        logp = torch.log_softmax(logits, dim=-1)  # (N, V)
        probs = logp.exp()
        _ent = -(probs * logp).sum(-1)
        kw = {"probs": probs} if "probs" in inspect.signature(sample).parameters else {}  # older: own softmax
        tok = sample(logits, [temperature] * n, [top_p] * n, gens if temperature > 0 else [None] * n, **kw)
        logp.gather(1, tok[:, None])

    cases = [("greedy", peaked, 0.0, 1.0), ("temperature 1", peaked, 1.0, 1.0), ("temperature 0.7", peaked, 0.7, 1.0),
             ("top_p 0.9, peaked", peaked, 1.0, 0.9), ("top_p 0.9, flat", flat, 1.0, 0.9)]
    print(f"token path, {a.rows} rows x {a.vocab} vocabulary, {a.threads} thread(s); p50 ms per step"
          + (" (this / other sampler)" if len(samplers) > 1 else ""))
    for name, logits, t, p in cases:
        ts: dict[str, list[float]] = {k: [] for k in samplers}
        steps = a.steps if p == 1.0 or name.endswith("peaked") else max(5, a.steps // 10)
        for i in range(steps + 3):
            for k, fn in samplers.items():
                t0 = time.perf_counter()
                token_path(fn, logits, t, p)
                if i >= 3:
                    ts[k].append(time.perf_counter() - t0)
        p50 = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in ts.items()}
        print(f"  {name:<20} " + " / ".join(f"{x:7.2f}" for x in p50.values()))


if __name__ == "__main__":
    main()
