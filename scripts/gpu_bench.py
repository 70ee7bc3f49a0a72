#!/usr/bin/env python
"""Decode-step speed of SFCL's model on one GPU, against the HBM bandwidth floor and HF generate().

No network, no checkpoint: a random-weight model of Llama-3.1-8B shape (hidden 4096, 32 layers,
32 heads, 8 KV heads, intermediate 14336, vocab 128256) in bf16, built with
``sfcl.model.llama.LlamaModel`` directly on the device (decode speed does not depend on weight
values). For batch 1 and 16, with our KV cache (``sfcl.model.kv_cache.KVCache``, slots zeroed,
``--context`` positions already "filled"), it times ms per decode step of:

- the decode *forward* with the snapshot tap, greedy next token on the device each step (no host
  sync per step, so the CPU may queue ahead): eager with exact shapes (what the runner's eager
  branch runs) and replayed from CUDA graphs (``sfcl.engine.graph_runner.DecodeGraphRunner``:
  padded batch / KV-length buckets, tap hidden state and attention dispersion inside the graph);
- the *engine* step, ``ModelRunner.execute`` on a pure-decode plan: forward, sampling, the three
  triggers, the fused anchor lookup (a random ``--anchors``-row library of the model's hidden
  size, searched on the device) and the step's one host transfer; eager (``--enforce-eager``) and
  with graphs, snapshots off and with every token looked up (``always``).

In the same run:

- bandwidth floor = bytes one decode step must read / measured device-to-device copy bandwidth.
  Bytes read: every weight except the embedding table (a step gathers only B of its rows) plus the
  KV read at the current length. Copy bandwidth: ``dst.copy_(src)`` of a 1 GiB buffer (``--copy-mib``)
  counted as read + write (2 x bytes), as STREAM's "Copy" does.
- HF: ``transformers.LlamaForCausalLM`` from the same config (random init, bf16, same device,
  SDPA attention, default dynamic cache), ``generate(min_new_tokens=max_new_tokens, greedy)`` with
  a prompt of ``--context`` random tokens; ms per decode step = time between the first and last
  generated token / (tokens - 1), from a StoppingCriteria clock (so prefill is excluded).

Targets (issue 3, on an H200): batch-1 step <= 1.3x the floor; >= 10x faster than HF generate();
checked on the forward (best of eager and graph) and on the engine step (graphs, snapshots off).
``--tiny`` uses a tiny shape and runs on CPU for smoke tests (targets printed as not applicable).
Writes JSON (``--out``). Prints a table and the ratios.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from sfcl.engine.graph_runner import DecodeGraphRunner  # noqa: E402
from sfcl.engine.model_runner import ModelRunner  # noqa: E402
from sfcl.engine.request import SamplingParams  # noqa: E402
from sfcl.engine.scheduler import SchedulerOutput, Sequence  # noqa: E402
from sfcl.model.kv_cache import KVCache  # noqa: E402
from sfcl.model.llama import AttnBatch, LlamaArgs, LlamaModel  # noqa: E402

LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layers=32, n_heads=32,
                  n_kv_heads=8, head_dim=128)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16)
ROPE_THETA = 500000.0


def llama_args(shape: dict) -> LlamaArgs:
    return LlamaArgs(model_type="llama", rms_norm_eps=1e-5, max_position_embeddings=131072,
                     tie_word_embeddings=False, attention_bias=False, qk_norm=False, **shape)


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_sfcl(a: LlamaArgs, dev: torch.device, dtype: torch.dtype) -> LlamaModel:
    """Random-init LlamaModel created directly in ``dtype`` on ``dev`` (no fp32 copy, no host copy)."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, a.head_dim, 2, dtype=torch.float32) / a.head_dim))
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            m = LlamaModel(a, inv_freq.to(dev))
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():  # keep activations in a sane range (speed does not depend on it)
        m.embed_tokens.weight.mul_(0.02)
    return m.eval()


def build_hf(a: LlamaArgs, dev: torch.device, dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=a.vocab_size, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
                      num_hidden_layers=a.n_layers, num_attention_heads=a.n_heads, num_key_value_heads=a.n_kv_heads,
                      head_dim=a.head_dim, rms_norm_eps=a.rms_norm_eps, rope_theta=ROPE_THETA,
                      max_position_embeddings=a.max_position_embeddings, tie_word_embeddings=False,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            m = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return m.to(dtype).eval()


def copy_bandwidth(dev: torch.device, mib: int, reps: int = 10) -> float:
    """Device copy bandwidth in bytes/s, counted as read + write (2 x buffer size), best of ``reps``."""
    n = mib * 2**20
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    src.fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(reps):
        sync(dev)
        t = time.perf_counter()
        dst.copy_(src)
        sync(dev)
        best = min(best, time.perf_counter() - t)
    del src, dst
    return 2 * n / best


def weight_bytes_read(m: LlamaModel) -> int:
    """Bytes of every parameter a decode step reads in full: all but the embedding table."""
    emb = m.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in m.parameters() if p is not emb or m.lm_head.weight is emb)


def tap_layer(a: LlamaArgs) -> int:
    return (3 * a.n_layers) // 4  # the default snapshot layer (sfcl.anchors.builder.default_layer)


def eager_forward(model: LlamaModel, kv: KVCache, tap: int, ids: torch.Tensor, pos: torch.Tensor, S: int):
    """The runner's eager decode branch: exact B and S, tap hidden state and attention weights."""
    B = ids.shape[0]
    mask = torch.arange(S, device=ids.device)[None, :] <= pos[:, None]  # (B, S)
    batch = AttnBatch(is_prefill=False, slots=torch.arange(B, device=ids.device), positions=pos, kv_len=S,
                      mask=mask.view(B, 1, 1, S), slot_range=(0, B))
    return model(ids[:, None], batch, kv, tap).logits  # (B, V)


def new_kv(a: LlamaArgs, dev, dtype, B: int, max_len: int) -> KVCache:
    kv = KVCache(a, n_slots=B, max_len=max_len, dtype=dtype, device=str(dev))
    for t in kv.k + kv.v:
        t.zero_()  # these positions count as "already filled" (finite values; see graph_runner)
    kv.hwm = [kv.max_len] * len(kv.hwm)
    return kv


def time_decode(model: LlamaModel, a: LlamaArgs, dev, dtype, B: int, context: int, steps: int, warmup: int,
                graphs: bool) -> dict:
    """ms per decode forward at batch B after ``context`` positions, eager or CUDA-graph replay."""
    kv = new_kv(a, dev, dtype, B, context + warmup + steps + 1)
    tap = tap_layer(a)
    g = DecodeGraphRunner(model, kv, tap, capture=True) if graphs else None
    ids = torch.randint(0, a.vocab_size, (B,), device=dev)
    pos0 = torch.full((B,), context, dtype=torch.long, device=dev)

    def one(i: int):
        nonlocal ids
        if g is not None:
            logits = g.run(ids, [context + i] * B).logits
        else:
            logits = eager_forward(model, kv, tap, ids, pos0 + i, context + i + 1)
        ids = logits.argmax(-1)  # greedy on the device, no host sync

    for i in range(warmup):
        one(i)
    sync(dev)
    t = time.perf_counter()
    for i in range(warmup, warmup + steps):
        one(i)
    sync(dev)
    ms = (time.perf_counter() - t) * 1e3 / steps
    kv_read = B * (context + warmup + steps // 2) * kv.bytes_per_token
    captured = g.graphs.captured if g is not None else []
    if g is not None and g.graphs.failed:
        print(f"graph capture failed: {g.graphs.failed}", file=sys.stderr)
    return {"ms_per_step": ms, "kv_bytes_read": kv_read, "captured": captured}


def random_snapshotter(a: LlamaArgs, dev, n: int, root: Path):
    """A Snapshotter over a random ``n``-anchor library of the model's hidden size (search speed
    does not depend on the vectors), with no entity classes and a neutral calibration."""
    from sfcl.library.store import save_library
    from sfcl.library.versions import load_library
    from sfcl.snapshot.snapshotter import Snapshotter

    g = torch.Generator().manual_seed(0)
    z = torch.zeros(n, dtype=torch.int32)
    path = save_library(root / "anchors", vectors=torch.randn(n, a.hidden_size, generator=g), counts=z + 1,
                        weights=torch.ones(n), decay=torch.full((n,), 10.0),
                        next_ids=torch.randint(0, a.vocab_size, (n, 8), generator=g), next_probs=torch.full((n, 8), 0.125),
                        kinds=z.clone(), span_doc=z.clone(), span_start=z.clone(), span_end=z + 1,
                        span_texts=["random"] * n, doc_ids=["random"], model_fingerprint="random",
                        model_name="random-8b-shape", layer=tap_layer(a), build={"random": True},
                        corpus_hash="random", calibration={"surprisal_mean": 5.0, "surprisal_std": 2.0,
                                                           "dispersion_mean": 0.5, "dispersion_std": 0.1})
    lib = load_library(path)
    snap = Snapshotter(lib, torch.zeros(a.vocab_size, dtype=torch.uint8, device=dev))
    if dev.type == "cuda":
        snap.device_index(dev)
    return snap


def time_engine(model: LlamaModel, a: LlamaArgs, dev, dtype, B: int, context: int, steps: int, warmup: int,
                graphs: bool, snap, mode: str) -> dict:
    """ms per engine step (``ModelRunner.execute`` of a pure-decode plan of B rows; each step waits
    for its one host transfer), eager or with graphs, snapshot mode ``mode``."""
    kv = new_kv(a, dev, dtype, B, context + warmup + steps + 2)
    tap = tap_layer(a)
    g = DecodeGraphRunner(model, kv, tap, capture=True) if graphs else None
    runner = ModelRunner(model, kv, tap, snap, str(dev), graphs=g, fused_lookup=dev.type == "cuda")
    gen = torch.Generator().manual_seed(B)
    seqs = []
    for i in range(B):
        s = Sequence(request_id=f"b{i}", prompt_ids=torch.randint(3, a.vocab_size, (context,), generator=gen).tolist(),
                     params=SamplingParams(max_tokens=10**6, snapshot_mode=mode, ignore_eos=True))
        s.slot, s.num_computed = i, context
        runner.admit(s.request_id)
        seqs.append(s)
    plan = SchedulerOutput(moves=[], prefill=[], decode=seqs, finished=[])
    lookups = 0

    def one():
        nonlocal lookups
        out = runner.execute(plan)
        lookups += out.lookups
        for s in seqs:
            s.output_ids.append(out.results[s.request_id].token_id)

    for _ in range(warmup):
        one()
    sync(dev)
    lookups = 0
    t = time.perf_counter()
    for _ in range(steps):
        one()
    ms = (time.perf_counter() - t) * 1e3 / steps
    replays = g.graphs.replays if g is not None else 0
    return {"ms_per_step": ms, "lookups_per_step": lookups / steps, "graph_replays": replays}


def time_hf(hf, a: LlamaArgs, dev, B: int, context: int, steps: int) -> float:
    """ms per decode step of HF generate() (prefill excluded), batch B, greedy, EOS ignored."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            sync(dev)
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    ids = torch.randint(3, a.vocab_size, (B, context), device=dev)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        hf.generate(input_ids=ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=3, min_new_tokens=3,
                    do_sample=False, pad_token_id=0)  # warm-up
        stamps.clear()
        hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=steps + 1, min_new_tokens=steps + 1,
                    do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([Clock()]))
    return (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1)


def check(name: str, value: float | None, op: str, thr: float, applicable: bool) -> dict:
    ok = None if value is None else (value <= thr if op == "<=" else value >= thr)
    mark = ("PASS" if ok else "FAIL") if (ok is not None and applicable) else "n/a"
    return {"name": name, "value": value, "op": op, "threshold": thr, "passed": ok if applicable else None,
            "mark": mark}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny model shape (smoke test; CPU is fine)")
    ap.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available, else cpu)")
    ap.add_argument("--batch", default="1,16", help="comma-separated decode batch sizes")
    ap.add_argument("--context", type=int, default=512, help="tokens already in the KV cache per sequence")
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps")
    ap.add_argument("--warmup", type=int, default=8, help="untimed decode steps first (includes graph capture)")
    ap.add_argument("--copy-mib", type=int, default=1024, help="buffer size of the copy-bandwidth measurement")
    ap.add_argument("--no-hf", action="store_true", help="skip HF generate()")
    ap.add_argument("--no-graphs", action="store_true", help="skip CUDA-graph replay (eager only)")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine-step timings (ModelRunner.execute)")
    ap.add_argument("--anchors", type=int, default=32768, help="rows of the random anchor library of the engine step")
    ap.add_argument("--out", default="gpu_bench.json", help="JSON output file")
    a = ap.parse_args(argv)
    try:
        batches = [int(x) for x in a.batch.split(",") if x.strip()]
        if not batches or min(batches) < 1 or min(a.steps, a.context) < 2 or a.warmup < 1 or a.anchors < 1:
            raise ValueError
    except ValueError:
        print("gpu_bench: error: --batch needs integers >= 1, --steps/--context >= 2, --warmup/--anchors >= 1",
              file=sys.stderr)
        return 2
    dev = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("gpu_bench: error: --device cuda but CUDA is not available", file=sys.stderr)
        return 2
    dtype = torch.bfloat16
    args = llama_args(TINY if a.tiny else LLAMA31_8B)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")
    print(f"device {dev} ({name}), shape {'tiny' if a.tiny else 'Llama-3.1-8B'}, bf16, context {a.context}",
          file=sys.stderr)
    bw = copy_bandwidth(dev, a.copy_mib if not a.tiny else min(a.copy_mib, 64))
    model = build_sfcl(args, dev, dtype)
    wbytes = weight_bytes_read(model)
    print(f"copy bandwidth {bw / 1e9:,.0f} GB/s; weights read per step {wbytes / 1e9:.2f} GB", file=sys.stderr)
    graphs_ok = dev.type == "cuda" and not a.no_graphs
    rows = []
    for B in batches:
        r: dict = {"batch": B}
        e = time_decode(model, args, dev, dtype, B, a.context, a.steps, a.warmup, graphs=False)
        r["eager_ms"] = e["ms_per_step"]
        r["graph_ms"] = (time_decode(model, args, dev, dtype, B, a.context, a.steps, a.warmup, graphs=True)["ms_per_step"]
                         if graphs_ok else None)
        r["floor_weights_ms"] = wbytes / bw * 1e3
        r["floor_ms"] = (wbytes + e["kv_bytes_read"]) / bw * 1e3
        rows.append(r)
        print(f"batch {B}: eager {r['eager_ms']:.3f} ms, graph "
              f"{'n/a' if r['graph_ms'] is None else format(r['graph_ms'], '.3f') + ' ms'}, floor {r['floor_ms']:.3f} ms",
              file=sys.stderr)
    if not a.no_engine:
        with tempfile.TemporaryDirectory() as tmp:
            snap = random_snapshotter(args, dev, min(a.anchors, 512) if a.tiny else a.anchors, Path(tmp))
            for r in rows:
                B = r["batch"]
                run = lambda graphs, mode: time_engine(model, args, dev, dtype, B, a.context, a.steps, a.warmup,  # noqa: E731
                                                       graphs, snap, mode)
                r["engine_eager_ms"] = run(False, "off")["ms_per_step"]
                g = run(True, "off") if graphs_ok else None
                r["engine_graph_ms"] = g and g["ms_per_step"]
                r["engine_graph_replays"] = g and g["graph_replays"]
                al = run(graphs_ok, "always")
                r["engine_always_ms"], r["engine_always_lookups_per_step"] = al["ms_per_step"], al["lookups_per_step"]
                print(f"batch {B}: engine step eager {r['engine_eager_ms']:.3f} ms, graphs "
                      f"{'n/a' if g is None else format(g['ms_per_step'], '.3f') + ' ms'}, "
                      f"always-lookup {al['ms_per_step']:.3f} ms ({al['lookups_per_step']:.0f} lookups/step)",
                      file=sys.stderr)
            snap.lib.close()
            del snap
    if not a.no_hf:
        del model
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        hf = build_hf(args, dev, dtype)
        for r in rows:
            r["hf_ms"] = time_hf(hf, args, dev, r["batch"], a.context, a.steps)
            print(f"batch {r['batch']}: HF generate() {r['hf_ms']:.3f} ms/step", file=sys.stderr)
        del hf
    for r in rows:
        best = min(x for x in (r["eager_ms"], r["graph_ms"]) if x is not None)
        r["best_ms"] = best
        r["best_over_floor"] = best / r["floor_ms"]
        r["hf_over_best"] = (r["hf_ms"] / best) if r.get("hf_ms") else None
        r["graph_speedup"] = (r["eager_ms"] / r["graph_ms"]) if r["graph_ms"] else None
        eng = r.get("engine_graph_ms") or r.get("engine_eager_ms")
        r["engine_over_floor"] = eng / r["floor_ms"] if eng else None
        r["hf_over_engine"] = (r["hf_ms"] / eng) if eng and r.get("hf_ms") else None
        r["engine_graph_speedup"] = (r["engine_eager_ms"] / r["engine_graph_ms"]) if r.get("engine_graph_ms") else None
    applicable = dev.type == "cuda" and not a.tiny
    b1 = next((r for r in rows if r["batch"] == 1), None)
    targets = [check("batch-1 decode step / bandwidth floor", b1 and b1["best_over_floor"], "<=", 1.3, applicable),
               check("HF generate() step / ours, batch 1", b1 and b1["hf_over_best"], ">=", 10.0, applicable)]
    if not a.no_engine:
        targets += [check("batch-1 engine step / bandwidth floor", b1 and b1["engine_over_floor"], "<=", 1.3, applicable),
                    check("HF generate() step / engine step, batch 1", b1 and b1["hf_over_engine"], ">=", 10.0,
                          applicable)]
    hdr = "| batch | eager ms | graph ms | floor ms | best / floor | HF ms | HF / best | graph speed-up |"
    lines = [hdr, "|---|---|---|---|---|---|---|---|"]
    f = lambda x, nd=3: "—" if x is None else f"{x:.{nd}f}"  # noqa: E731
    for r in rows:
        lines.append(f"| {r['batch']} | {f(r['eager_ms'])} | {f(r['graph_ms'])} | {f(r['floor_ms'])} | "
                     f"{f(r['best_over_floor'], 2)} | {f(r.get('hf_ms'))} | {f(r['hf_over_best'], 1)} | "
                     f"{f(r['graph_speedup'], 2)} |")
    if not a.no_engine:
        lines += ["", "Engine step (ModelRunner.execute: forward + sampling + triggers + fused lookup + 1 host transfer):",
                  "| batch | eager ms | graphs ms | graph speed-up | graphs / floor | HF / engine | always-lookup ms |",
                  "|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['batch']} | {f(r['engine_eager_ms'])} | {f(r['engine_graph_ms'])} | "
                         f"{f(r['engine_graph_speedup'], 2)} | {f(r['engine_over_floor'], 2)} | "
                         f"{f(r['hf_over_engine'], 1)} | {f(r['engine_always_ms'])} |")
    print("\n".join(lines))
    for t in targets:
        print(f"{t['mark']}: {t['name']} = {f(t['value'], 2)} (goal {t['op']} {t['threshold']:g})"
              + ("" if applicable else "  [not applicable: needs CUDA and the 8B shape]"))
    doc = {"device": str(dev), "device_name": name, "shape": "tiny" if a.tiny else "llama-3.1-8b", "dtype": "bfloat16",
           "context": a.context, "steps": a.steps, "copy_bandwidth_bytes_per_s": bw, "weight_bytes_read": wbytes,
           "torch": torch.__version__, "rows": rows, "targets": targets,
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
