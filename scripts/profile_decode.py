"""Time and profile one compiled decode step in process (no HTTP, no scheduler).

Usage: python scripts/profile_decode.py [--batch 1] [--length 200] [--weight-quant auto]
                                        [--threads 1] [--steps 100] [--profile] [--anchors DIR]
                                        [--eager] [--pack-dense] [--dtype auto]

Builds the engine as ``sfcl serve --compile`` does (default model, default anchor library),
then calls the compiled decode step on dummy rows of B sequences attending to S cache
positions, and prints the step's p50 / p90 wall time in ms, against the same step run eagerly
(``LlamaModel.forward_step``, interleaved with the compiled calls). ``--profile`` adds the
torch.profiler table of the top operators (self CPU time per step), which is how the Dynamo
guard time ("TorchDynamo Cache Lookup") and the Python-wrapper time of
``sfcl.model.compiled.compile_options`` were found. Compiling takes 30 s to a few minutes
(Inductor caches generated code under /tmp/torchinductor_$USER). ``--eager`` skips compiling:
it times the eager step alone and, with ``--profile``, prints its operator table grouped by input
shape (how the K/V copies of batched decode attention were found). ``--pack-dense`` (with ``--eager``)
holds the dense bf16 / float32 weights in oneDNN's packed layout first, as ``sfcl serve`` does without
``--compile`` (``sfcl.model.quant.pack_dense_weights``); run it with and without to compare.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=1, help="B, sequences in the step")
    ap.add_argument("--length", type=int, default=200, help="S, attended cache positions")
    ap.add_argument("--weight-quant", default="auto", choices=["auto", "none", "fp16", "int8", "int4"],
                    help="as sfcl serve's flag (auto: this machine's default, logged as [WEIGHTS])")
    ap.add_argument("--anchors", default=None, help="anchor library (default: sfcl serve's default library)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the server decodes on cores - 1)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--profile", action="store_true", help="print the torch.profiler operator table")
    ap.add_argument("--eager", action="store_true", help="no compile: time and profile the eager step only")
    ap.add_argument("--pack-dense", action="store_true", help="with --eager: pack the dense weights for oneDNN")
    ap.add_argument("--dtype", default="auto", help="model dtype, as sfcl serve's --dtype (auto: this machine's)")
    a = ap.parse_args(argv)

    from sfcl.config import EngineConfig, ModelConfig, SnapshotConfig
    from sfcl.engine_stack import load_anchors, make_llm_engine, served_weights
    from sfcl.model.compiled import dummy_decode_step
    from sfcl.model.loader import load_model

    torch.set_num_threads(a.threads)
    mcfg, scfg = ModelConfig(dtype=a.dtype), SnapshotConfig(anchors=a.anchors)
    lm = load_model(mcfg.model, dtype=mcfg.dtype, device="cpu", cache_dir=scfg.cache_dir)
    lib = load_anchors(lm, scfg, False)
    if a.pack_dense and not a.eager:
        raise SystemExit("--pack-dense needs --eager (Dynamo does not take oneDNN's packed tensors)")
    wq, n_packed = served_weights(lm, a.weight_quant, "cpu", pack_dense=a.pack_dense)  # as sfcl serve does
    if a.pack_dense:
        print(f"{n_packed} dense weights packed for oneDNN", flush=True)
    B, S = a.batch, a.length
    t0 = time.perf_counter()
    eng = make_llm_engine(lm, lib, EngineConfig(max_num_seqs=max(16, B), max_model_len=max(2048, S + 1),
                                                compile=not a.eager), scfg)
    print(f"engine built{'' if a.eager else ' and compiled'} in {time.perf_counter() - t0:.0f} s", flush=True)
    runner = eng.runner
    cd = runner.compiled_decode

    def step():
        return dummy_decode_step(B, S)

    ids = torch.zeros(1, B, dtype=torch.long)
    if a.eager:
        _eager_only(lm, eng.runner, ids, step, a, wq)
        return
    runner.kv.ensure_initialized(B, S)
    with torch.no_grad():
        for _ in range(10):
            cd(ids, step(), runner.tap_layer)
            lm.model.forward_step(ids, step(), runner.kv, runner.tap_layer)
        ts, te = [], []
        for _ in range(a.steps):  # compiled and eager in turn
            st = step()
            t = time.perf_counter()
            cd(ids, st, runner.tap_layer)
            ts.append(time.perf_counter() - t)
            st = step()
            t = time.perf_counter()
            lm.model.forward_step(ids, st, runner.kv, runner.tap_layer)
            te.append(time.perf_counter() - t)
        ts.sort()
        te.sort()
        print(f"decode step B={B} S={S} weights {wq.label} threads={a.threads}: compiled "
              f"p50 {ts[len(ts) // 2] * 1e3:.2f} ms, p90 {ts[int(len(ts) * 0.9)] * 1e3:.2f} ms; eager "
              f"p50 {te[len(te) // 2] * 1e3:.2f} ms, p90 {te[int(len(te) * 0.9)] * 1e3:.2f} ms "
              f"(compiled/eager {ts[len(ts) // 2] / te[len(te) // 2]:.2f})", flush=True)
        if a.profile:
            from torch.profiler import ProfilerActivity, profile

            n = 20
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(n):
                    cd(ids, step(), runner.tap_layer)
            print(f"(totals over {n} steps)")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


def _eager_only(lm, runner, ids, step, a, wq) -> None:
    """``--eager``: p50 / p90 of the eager step, and its operator table by input shape. When the
    engine loaded SFCL's fused kernels (``sfcl.model.decode_kernel``), three variants alternate
    step by step and all are printed: every layer in one C++ call (``sfcl.model.decode_stack``),
    the fused attention kernel inside the Python forward, and torch's operators throughout."""
    runner.kv.ensure_initialized(a.batch, a.length)
    fwd = lm.model.forward_step
    kv = runner.kv
    names = {(True, True): "fused layers + attention", (True, False): "fused attention only",
             (False, False): "torch ops"}
    variants = list(names) if kv.fused_decode else [(False, False)]
    for _ in range(10):
        for fd, fl in variants:
            kv.fused_decode, kv.fused_layers = fd, fl
            fwd(ids, step(), kv, runner.tap_layer)
    times: dict[tuple, list[float]] = {v: [] for v in variants}
    for _ in range(a.steps):
        for v in variants:
            kv.fused_decode, kv.fused_layers = v
            st = step()
            t = time.perf_counter()
            fwd(ids, st, kv, runner.tap_layer)
            times[v].append(time.perf_counter() - t)
    kv.fused_decode, kv.fused_layers = variants[0]
    for v, te in times.items():
        te.sort()
        print(f"eager decode step B={a.batch} S={a.length} weights {wq.label} threads={a.threads} "
              f"{names[v]}: p50 {te[len(te) // 2] * 1e3:.2f} ms, p90 {te[int(len(te) * 0.9)] * 1e3:.2f} ms", flush=True)
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        n = 10
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
            for _ in range(n):
                fwd(ids, step(), runner.kv, runner.tap_layer)
        print(f"(totals over {n} steps)")
        print(p.key_averages(group_by_input_shape=True).table(sort_by="self_cpu_time_total", row_limit=15,
                                                               max_shapes_column_width=60))


if __name__ == "__main__":
    main()
