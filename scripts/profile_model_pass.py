"""Time and profile the anchor builder's model pass (``sfcl.anchors.model_pass.run_windows``).

Usage: python scripts/profile_model_pass.py [--windows 4 | --whole-corpus] [--window-tokens 1024] [--reps 2] [--profile]
       [--logit-stats both] [--elementwise both] [--snapshot-softmax both] [--attention both] [--ops]
       [--logit-rows 128,512] [--residual both]

Runs the bundled model over ``--windows`` windows of the bundled sample corpus (or ``--corpus``, e.g.
``../shared/data/contractnli/dev.json``), prints the wall time
per batch of windows (with ``--whole-corpus``: the builder's whole model pass over the corpus'
documents, ``sfcl.anchors.builder.collect``, as ``sfcl anchors build`` runs it) against the floor the builder prints (FLOP of the pass / the GEMM rate probed
now, ``sfcl.anchors.model_pass.gemm_rate``), and with ``--profile`` the torch.profiler table of the
top operators by self CPU time (how the share of causal SDPA in the pass was found).
``--logit-stats both`` alternates the logits' reductions rep by rep between SFCL's one-pass kernel
(``torch.ops.sfcl.logit_stats``, the default once the kernels load) and torch's operators
(``native`` / ``torch``: one of them only). ``--elementwise both`` alternates, with SFCL's kernels
loaded, a decoder layer's element-wise steps between SFCL's operators (``torch.ops.sfcl.rms_norm``,
``silu_mul``, ``rope_``; ``sfcl.model.llama.native_rows``) and torch's (torch's logits reductions run
with the kernels unloaded, so with torch's element-wise operators too). ``--snapshot-softmax both``
alternates the snapshot layer's attention weights and entropies between SFCL's one-pass kernel
(``torch.ops.sfcl.causal_softmax_entropy_``; ``sfcl.anchors.model_pass.native_softmax``) and torch's
eager softmax and ``attention_dispersion``. ``--attention both`` alternates the other layers' causal
attention between SFCL's kernel (``torch.ops.sfcl.causal_attention``, on AMX tiles or AVX-512 BF16 vectors;
``sfcl.anchors.model_pass.native_attention``, where the CPU and the kernels' build have AVX-512 BF16) and torch's
causal SDPA. ``--logit-rows A,B`` alternates
``sfcl.anchors.model_pass.LOGIT_ROWS`` (rows of logits made and reduced at once) rep by rep. ``--residual both``
alternates how a layer's two projections into the residual stream add to it: inside the GEMM
(``addmm_``; ``sfcl.anchors.model_pass.RESIDUAL_IN_GEMM``, the default) or as a product written and
then added (``gemm``: ``h + o_proj(o)``, ``h + mlp(x)``). ``--ops`` first times
the snapshot layer's attention with its dispersion over one window (SFCL's weights and entropies against torch's
eager softmax), then each
element-wise step alone on one block of ``windows x window_tokens`` rows of the model's shapes, on 1
and 2 threads: SFCL's operator against the torch operators ``sfcl.model.llama`` runs without it, and
(where it runs) SFCL's causal attention over those rows as windows of 1,024 against causal SDPA.
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
    ap.add_argument("--elementwise", choices=("native", "torch", "both"), default="native")
    ap.add_argument("--snapshot-softmax", choices=("native", "torch", "both"), default="native")
    ap.add_argument("--attention", choices=("native", "torch", "both"), default="native")
    ap.add_argument("--residual", choices=("in-gemm", "gemm", "both"), default="in-gemm")
    ap.add_argument("--ops", action="store_true")
    ap.add_argument("--corpus", nargs="*", help="corpus files (as `sfcl anchors build` takes them) whose text, "
                    "joined, gives the windows (default: the bundled sample corpus)")
    ap.add_argument("--logit-rows", default="", help="comma-separated LOGIT_ROWS values to alternate")
    ap.add_argument("--whole-corpus", action="store_true", help="time the builder's whole model pass over the "
                    "corpus' documents, windowed and batched as `sfcl anchors build` does (sfcl.anchors.builder.collect), "
                    "instead of --windows consecutive windows")
    a = ap.parse_args(argv)

    from sfcl.anchors.corpus import read_corpus, sample_corpus_files
    from sfcl.anchors import model_pass
    from sfcl.anchors.model_pass import flops_per_token, gemm_rate, run_windows
    from sfcl.model import decode_kernel, llama
    from sfcl.model.loader import load_model

    from sfcl.anchors import builder

    lm = load_model(None, dtype="auto")
    docs = read_corpus(a.corpus or sample_corpus_files())
    text = " ".join(d.text for d in docs)
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    W = a.window_tokens
    wins = [ids[i * W:(i + 1) * W] for i in range(a.windows)]
    if len(wins[-1]) < W:
        raise SystemExit(f"the corpus has fewer than {a.windows} windows of {W} tokens")
    layer = builder.default_layer(lm.args.n_layers)
    if a.ops:
        _time_snapshot_attention(lm, W)
        _time_ops(lm, len(wins) * W)
    run_windows(lm.model, wins[:1], layer, 8)  # warm-up
    dtype = next(lm.model.parameters()).dtype
    rate = gemm_rate(dtype)
    floor = flops_per_token(lm.args, (W + 1) / 2) * W * len(wins) / (rate * 1e9)
    native = decode_kernel.load(verbose=False)
    loaded = decode_kernel.loaded
    native_rows = llama.native_rows
    pick = {"native": ["native"], "torch": ["torch"], "both": ["native", "torch"]}
    native_softmax, native_attention = model_pass.native_softmax, model_pass.native_attention
    modes = list(dict.fromkeys((ls, ew if ls == "native" else "torch", sm if ls == "native" else "torch",
                                at if ls == "native" else "torch")
                               for ls in pick[a.logit_stats] for ew in pick[a.elementwise]  # torch's logits
                               for sm in pick[a.snapshot_softmax] for at in pick[a.attention]))  # reductions: kernels unloaded
    with torch.inference_mode():
        native_here = native_attention(torch.empty(1, 64, dtype=dtype))
    ours = "SFCL's AMX attention" if native_here and torch.ops.sfcl.causal_attention_amx() else "SFCL's AVX-512 BF16 attention"
    row_counts = [int(r) for r in a.logit_rows.split(",") if r] or [model_pass.LOGIT_ROWS]
    default_rows, default_residual = model_pass.LOGIT_ROWS, model_pass.RESIDUAL_IN_GEMM
    residuals = {"in-gemm": [True], "gemm": [False], "both": [True, False]}[a.residual]
    try:
        for _ in range(a.reps):
            for (ls, ew, sm, at), rows, res in ((m, r, x) for m in modes for r in row_counts for x in residuals):
                model_pass.RESIDUAL_IN_GEMM = res
                decode_kernel.loaded = (lambda: False) if ls == "torch" else loaded
                llama.native_rows = (lambda *x: False) if ew == "torch" else native_rows
                model_pass.native_softmax = (lambda q: False) if sm == "torch" else native_softmax
                model_pass.native_attention = (lambda q: False) if at == "torch" else native_attention
                model_pass.LOGIT_ROWS = rows
                if a.whole_corpus:
                    st = builder.collect(lm, docs, builder.BuildConfig(), layer, progress=False)[1]
                    dt, floor, rate = st.seconds, st.floor_s, st.gemm_gflops
                else:
                    t = time.perf_counter()
                    run_windows(lm.model, wins, layer, 8)
                    dt = time.perf_counter() - t
                on = native and ls == "native"
                which = (("SFCL's logit_stats" if on else "torch's logits reductions") + ", "
                         + ("SFCL's element-wise ops" if on and ew == "native" else "torch's element-wise ops") + ", "
                         + ("SFCL's snapshot softmax" if on and sm == "native" else "torch's snapshot softmax") + ", "
                         + (ours if on and at == "native" and native_here else "torch's SDPA")
                         + f", logits {rows} rows at a time"
                         + (", residual adds in the GEMMs" if res else ", residual adds after the GEMMs"))
                what = (f"{len(docs)} documents, {st.tokens:,} tokens in {st.windows} windows" if a.whole_corpus
                        else f"{len(wins)} windows x {W} tokens")
                print(f"{what} ({str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} "
                      f"threads, {which}): {dt:.2f} s; floor {floor:.2f} s at {rate:.0f} GFLOP/s -> {dt / floor:.2f}x",
                      flush=True)
    finally:
        decode_kernel.loaded = loaded
        llama.native_rows = native_rows
        model_pass.native_softmax = native_softmax
        model_pass.native_attention = native_attention
        model_pass.LOGIT_ROWS = default_rows
        model_pass.RESIDUAL_IN_GEMM = default_residual
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as p:
            run_windows(lm.model, wins, layer, 8)
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _time_ops(lm, rows: int) -> None:
    """p50 of 30 calls of each element-wise step over ``rows`` rows: SFCL's operator vs torch's."""
    import torch.nn.functional as F

    from sfcl.anchors.model_pass import windows_attention
    from sfcl.model import decode_kernel
    from sfcl.model.llama import apply_rope

    if not decode_kernel.load(verbose=False):
        print("--ops: SFCL's kernels are not loaded here")
        return
    ar, dt = lm.args, next(lm.model.parameters()).dtype
    if dt not in (torch.bfloat16, torch.float16):
        print(f"--ops: the model runs in {dt}, where torch's operators always run")
        return
    g = torch.Generator().manual_seed(0)
    H, I, hd, nr = ar.hidden_size, ar.intermediate_size, ar.head_dim, ar.n_heads + ar.n_kv_heads
    x, w = torch.randn(rows, H, generator=g).to(dt), torch.randn(H, generator=g).to(dt)
    gu = torch.randn(rows, 2 * I, generator=g).to(dt)
    qkv = torch.randn(rows, (nr + ar.n_kv_heads) * hd, generator=g).to(dt)
    cos, sin = torch.randn(rows, hd, generator=g).to(dt), torch.randn(rows, hd, generator=g).to(dt)
    eps = ar.rms_norm_eps

    def torch_rms():
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt)

    nw = rows // 1024 or 1  # the pass's windows: attention over nw windows of rows / nw tokens
    Tw = rows // nw
    aq = torch.randn(nw, Tw, ar.n_heads, hd, generator=g).to(dt)
    ak, av = (torch.randn(nw, Tw, ar.n_kv_heads, hd, generator=g).to(dt) for _ in range(2))

    cases = {
        "RMSNorm": (lambda: torch.ops.sfcl.rms_norm(x, w, eps), torch_rms),
        "SiLU x up": (lambda: torch.ops.sfcl.silu_mul(gu), lambda: F.silu(gu[:, :I]) * gu[:, I:]),
        "rotary": (lambda: torch.ops.sfcl.rope_(qkv, cos, sin, nr, hd),
                   lambda: apply_rope(qkv[:, :nr * hd].view(rows, nr, hd), cos[:, None], sin[:, None])),
    }
    if dt == torch.bfloat16 and torch.ops.sfcl.causal_attention_ready():  # SFCL's kernel against causal SDPA
        cases[f"causal attention ({nw} windows)"] = (
            lambda: windows_attention(aq, ak, av, hd ** -0.5, True), lambda: windows_attention(aq, ak, av, hd ** -0.5, False))
    threads = torch.get_num_threads()
    try:
        with torch.inference_mode():
            for th in sorted({1, threads}):
                torch.set_num_threads(th)
                for name, (ours, theirs) in cases.items():
                    t = [_p50(f) for f in (ours, theirs)]
                    print(f"{name}, {rows} rows, {th} thread(s): SFCL's {t[0]:.2f} ms, torch's {t[1]:.2f} ms", flush=True)
    finally:
        torch.set_num_threads(threads)


def _time_snapshot_attention(lm, T: int) -> None:
    """p50 of 30 calls of the snapshot layer's attention with its dispersion over one window of T
    tokens (``sfcl.anchors.model_pass._snapshot_attention``), with SFCL's one-pass weights and
    entropies against torch's eager softmax, and causal SDPA without weights beside them."""
    import torch.nn.functional as F

    from sfcl.anchors import model_pass
    from sfcl.model import decode_kernel

    if not decode_kernel.load(verbose=False):
        print("--ops: SFCL's kernels are not loaded here")
        return
    attn = lm.model.layers[0].self_attn
    ar, dt = lm.args, next(lm.model.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, ar.n_heads, T, ar.head_dim, generator=g) * 2).to(dt)
    k, v = ((torch.randn(1, ar.n_kv_heads, T, ar.head_dim, generator=g) * 2).to(dt) for _ in range(2))
    native = model_pass.native_softmax
    try:
        with torch.inference_mode():
            ours = _p50(lambda: model_pass._snapshot_attention(attn, q, k, v))
            model_pass.native_softmax = lambda q: False
            theirs = _p50(lambda: model_pass._snapshot_attention(attn, q, k, v))
            sdpa = _p50(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    finally:
        model_pass.native_softmax = native
    print(f"snapshot attention with dispersion, one {T}-token window ({str(dt).removeprefix('torch.')}, "
          f"{torch.get_num_threads()} threads): SFCL's weights and entropies {ours:.2f} ms, torch's eager softmax "
          f"{theirs:.2f} ms (causal SDPA without weights {sdpa:.2f} ms)", flush=True)


def _p50(fn, reps: int = 30) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2] * 1e3


if __name__ == "__main__":
    main()
