"""Time and profile the anchor builder's model pass (``sfcl.anchors.model_pass.run_windows``).

Usage: python scripts/profile_model_pass.py [--windows 4] [--window-tokens 1024] [--reps 2] [--profile]
       [--logit-stats both]

Runs the bundled model over ``--windows`` windows of the bundled sample corpus, prints the wall time
per batch of windows against the floor the builder prints (FLOP of the pass / the GEMM rate probed
now, ``sfcl.anchors.model_pass.gemm_rate``), and with ``--profile`` the torch.profiler table of the
top operators by self CPU time (how the share of causal SDPA in the pass was found).
``--logit-stats both`` alternates the logits' reductions rep by rep between SFCL's one-pass kernel
(``torch.ops.sfcl.logit_stats``, the default once the kernels load) and torch's operators
(``native`` / ``torch``: one of them only).
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-tokens", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--logit-stats", choices=("native", "torch", "both"), default="native")
    a = ap.parse_args(argv)

    from sfcl.anchors.corpus import read_corpus, sample_corpus_files
    from sfcl.anchors.model_pass import flops_per_token, gemm_rate, run_windows
    from sfcl.model import decode_kernel
    from sfcl.model.loader import load_model

    lm = load_model(None, dtype="auto")
    text = " ".join(d.text for d in read_corpus(sample_corpus_files()))
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    W = a.window_tokens
    wins = [ids[i * W:(i + 1) * W] for i in range(a.windows)]
    if len(wins[-1]) < W:
        raise SystemExit(f"the sample corpus has fewer than {a.windows} windows of {W} tokens")
    layer = lm.args.n_layers * 3 // 4
    run_windows(lm.model, wins[:1], layer, 8)  # warm-up
    dtype = next(lm.model.parameters()).dtype
    rate = gemm_rate(dtype)
    floor = flops_per_token(lm.args, (W + 1) / 2) * W * len(wins) / (rate * 1e9)
    native = decode_kernel.load(verbose=False)
    loaded = decode_kernel.loaded
    modes = {"native": ["native"], "torch": ["torch"], "both": ["native", "torch"]}[a.logit_stats]
    try:
        for _ in range(a.reps):
            for mode in modes:
                decode_kernel.loaded = (lambda: False) if mode == "torch" else loaded
                t = time.perf_counter()
                run_windows(lm.model, wins, layer, 8)
                dt = time.perf_counter() - t
                which = "SFCL's logit_stats" if mode == "native" and native else "torch's logits reductions"
                print(f"{len(wins)} windows x {W} tokens ({str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} "
                      f"threads, {which}): {dt:.2f} s; floor {floor:.2f} s at {rate:.0f} GFLOP/s -> {dt / floor:.2f}x",
                      flush=True)
    finally:
        decode_kernel.loaded = loaded
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as p:
            run_windows(lm.model, wins, layer, 8)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
