"""CUDA tests (marked ``gpu``, skipped without CUDA; they never decide whether CI passes): the model
forward on CUDA matches the CPU; the engine's decode replayed from CUDA graphs
(``sfcl.engine.graph_runner``) matches the eager decode (bf16 and INT8 KV); the engine on CUDA with
graphs and the fused lookup matches eager / unfused and waits on the device once per step.

Run them all with ``scripts/gpu_check.sh`` (one call on a GPU machine). Random-weight models only
(``scripts/gpu_bench.py``'s builders), so nothing needs the bundled checkpoint or the network;
the CPU comparison test skips where the bundled model is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench.py"


@pytest.fixture(scope="module")
def gb():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _prefill(model, kv, slot, ids, device, tap=-1):
    from sfcl.model.llama import AttnBatch

    t = torch.tensor([ids], device=device)
    batch = AttnBatch(is_prefill=True, slots=torch.tensor([slot], device=device),
                      positions=torch.arange(len(ids), device=device), kv_len=len(ids))
    return model(t, batch, kv, tap_layer=tap, want_probs=False).logits[0]


def test_forward_on_cuda_matches_cpu(cache_dir):
    """The bundled model in fp32: prefill and a batched decode step agree between CPU and CUDA."""
    from sfcl.engine.graph_runner import DecodeGraphRunner
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.loader import ModelLoadError, load_model

    seqs = [[1, 504, 3457, 28, 253, 1823, 30], [1, 19, 2133, 314]]
    out = {}
    for dev in ("cpu", "cuda"):
        try:
            lm = load_model(None, dtype=torch.float32, device=dev, cache_dir=cache_dir)
        except (ModelLoadError, ImportError, OSError) as e:
            pytest.skip(f"bundled model not available here: {e}")
        kv = KVCache(lm.args, n_slots=2, max_len=64, dtype=torch.float32, device=dev)
        pre = [_prefill(lm.model, kv, i, s, dev).cpu() for i, s in enumerate(seqs)]
        dec = DecodeGraphRunner(lm.model, kv, 1, capture=False).run([42, 77], [len(s) for s in seqs]).logits.cpu()
        out[dev] = (pre, dec)
    for a, b in zip(out["cpu"][0], out["cuda"][0]):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out["cuda"][1], out["cpu"][1], rtol=1e-3, atol=1e-3)
    assert out["cuda"][1].argmax(-1).tolist() == out["cpu"][1].argmax(-1).tolist()


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager(gb, dtype, kv_dtype):
    """Ten decode steps, batch 3 (padded to 4) of different lengths, the same fed tokens: graph
    replay gives the eager logits, tap hidden state and dispersion (to rounding: the graph attends
    over a padded, masked bucket), and never writes the padded row's KV (a prefilling sequence)."""
    from sfcl.engine.graph_runner import DecodeGraphRunner
    from sfcl.model.kv_cache import KVCache
    from sfcl.model.llama import AttnBatch
    from sfcl.snapshot.triggers import attention_dispersion

    torch.manual_seed(0)
    dev = torch.device("cuda")
    a = gb.llama_args(dict(gb.TINY, n_layers=3, hidden_size=128, intermediate_size=256))
    model = gb.build_sfcl(a, dev, dtype)
    tap = 1
    seqs = [[5, 9, 13, 2, 7], [4, 8, 1], [3, 3, 3, 3, 3, 3, 3, 3], [6, 2, 9, 9, 4, 1]]  # the last one "prefills"
    fed = torch.randint(0, a.vocab_size, (10, 3), device=dev)  # same tokens for both runs
    runs = {}
    for graphs in (False, True):
        kv = KVCache(a, n_slots=4, max_len=64, dtype=dtype, device="cuda", kv_dtype=kv_dtype)
        for i, s in enumerate(seqs):
            _prefill(model, kv, i, s, dev, tap)
        keep = [kv.k[i][3, :, :6].clone() for i in range(a.n_layers)]
        pos = [len(s) for s in seqs[:3]]
        steps = []
        if graphs:
            g = DecodeGraphRunner(model, kv, tap, capture=True, kv_bucket=16)
            for i in range(10):
                o = g.run(fed[i], [p + i for p in pos])
                steps.append((o.logits, o.hidden, o.dispersion))
            assert g.graphs.failed is None and g.graphs.replays == 10
            assert g.graphs.captured == [(4, 16), (4, 32)]  # kv_len 9..18 crosses one 16-position bucket
        else:
            for i in range(10):
                p = torch.tensor([x + i for x in pos], device=dev)
                S = int(max(pos)) + i + 1
                kv.ensure_initialized(3, S)
                mask = torch.arange(S, device=dev)[None, :] <= p[:, None]
                batch = AttnBatch(is_prefill=False, slots=torch.arange(3, device=dev), positions=p, kv_len=S,
                                  mask=mask.view(3, 1, 1, S), slot_range=(0, 3))
                fo = model(fed[i][:, None], batch, kv, tap)
                steps.append((fo.logits, fo.tap_hidden[:, -1], attention_dispersion(fo.tap_probs[:, :, -1], p + 1)))
        assert all(torch.equal(k0, kv.k[i][3, :, :6]) for i, k0 in enumerate(keep))
        runs[graphs] = steps
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for e, g in zip(runs[False], runs[True]):
        for x, y in zip(e, g):
            torch.testing.assert_close(y, x, **tol)


def _small(gb, dev):
    """A random fp32 model with peaked logits (greedy margins far above rounding)."""
    a = gb.llama_args(dict(vocab_size=2048, hidden_size=256, intermediate_size=512, n_layers=4, n_heads=8,
                           n_kv_heads=2, head_dim=32))
    torch.manual_seed(0)
    m = gb.build_sfcl(a, dev, torch.float32)
    with torch.no_grad():
        m.lm_head.weight.mul_(20.0)
    return a, m


def _drive(gb, runner, a, dev):
    """Scheduler + runner (what LLMEngine.step does, minus detokenizing): 5 requests join at
    different steps and leave after different lengths; modes off / triggered / always.
    Returns per step (results by request id, pure decode?, host transfers)."""
    from sfcl.engine.request import SamplingParams
    from sfcl.engine.scheduler import Scheduler, SchedulerConfig, Sequence

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_model_len=256, max_num_batched_tokens=64))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, a.vocab_size, (n,), generator=gen).tolist() for n in (20, 7, 45, 12, 30)]
    joins, lengths, modes = [0, 1, 3, 6, 9], [25, 12, 30, 8, 20], ["always", "triggered", "off", "always", "always"]
    calls = [0]
    orig = runner._to_host

    def counted(t):
        calls[0] += 1
        return orig(t)

    runner._to_host = counted
    steps, step = [], 0
    while step <= max(joins) or sched.has_work():
        for i, j in enumerate(joins):
            if j == step:
                s = Sequence(f"r{i}", prompts[i], SamplingParams(max_tokens=lengths[i], snapshot_mode=modes[i],
                                                                 ignore_eos=True))
                sched.add(s)
                runner.admit(s.request_id)
        calls[0] = 0
        plan = sched.schedule()
        out = runner.execute(plan) if not plan.is_empty else None
        sched.step_done()
        rec = {}
        for seq in plan.sampled:
            r = out.results[seq.request_id]
            seq.output_ids.append(r.token_id)
            hit = r.snapshot
            rec[seq.request_id] = (r.token_id, r.logprob, r.entropy, r.dispersion,
                                   None if hit is None else (hit.anchor_ids, hit.scores, hit.confidence, hit.triggers))
            if len(seq.output_ids) >= seq.params.max_tokens:
                sched.finish(seq, "max_tokens")
                runner.release(seq.request_id)
        steps.append((rec, bool(plan.decode) and not plan.prefill, calls[0]))
        step += 1
    return steps


def test_engine_on_cuda_graphs_and_fused_lookup(gb, tmp_path):
    """The runner on CUDA three ways over the same schedule: graphs + fused lookup (the serving
    default on CUDA), graphs + unfused, eager + unfused. Same tokens and signals; fused hits equal
    the CPU search's; graphs served the pure-decode steps; one host transfer per step when fused."""
    from sfcl.engine.graph_runner import DecodeGraphRunner
    from sfcl.engine.model_runner import ModelRunner
    from sfcl.model.kv_cache import KVCache

    dev = torch.device("cuda")
    a, model = _small(gb, dev)
    snap = gb.random_snapshotter(a, dev, 4096, tmp_path)
    tap = gb.tap_layer(a)
    res = {}
    for name, graphs, fused in (("graph_fused", True, True), ("graph", True, False), ("eager", False, False)):
        kv = KVCache(a, n_slots=4, max_len=256, dtype=torch.float32, device="cuda")
        g = DecodeGraphRunner(model, kv, tap, capture=True, kv_bucket=16) if graphs else None
        runner = ModelRunner(model, kv, tap, snap, "cuda", graphs=g, fused_lookup=fused)
        res[name] = _drive(gb, runner, a, dev)
        if g is not None:
            assert g.graphs.failed is None and g.graphs.replays == sum(pd for _, pd, _ in res[name])
            assert len(g.graphs.captured) >= 3
    for x, y, z in zip(res["graph_fused"], res["graph"], res["eager"]):
        assert x[0].keys() == y[0].keys() == z[0].keys()
        for rid in x[0]:
            assert x[0][rid][0] == y[0][rid][0] == z[0][rid][0]  # tokens
            assert x[0][rid][1:4] == pytest.approx(z[0][rid][1:4], abs=1e-3)
            hx, hy = x[0][rid][4], y[0][rid][4]
            assert (hx is None) == (hy is None)
            if hx is not None:  # same hidden bits, device search vs CPU search
                assert hx[0] == hy[0] and hx[3] == hy[3]
                assert hx[1] == pytest.approx(hy[1], abs=1e-5) and hx[2] == pytest.approx(hy[2], abs=1e-5)
    assert any(x[0][rid][4] is not None for x in res["graph_fused"] for rid in x[0])
    assert all(n == (1 if rec else 0) for rec, _, n in res["graph_fused"])
    assert any(n == 2 for _, _, n in res["graph"])  # unfused: a second transfer when rows looked up


def test_pure_decode_step_synchronisations(gb, tmp_path):
    """How often a pure-decode engine step (graphs + fused lookup, greedy, every row looked up)
    makes the host wait on the device, counted with torch's sync debug mode. Expected 3: the
    packed results' one device->host transfer, plus two synchronous host->device uploads in
    ModelRunner.execute (slots, modes; see the report in the commit)."""
    from sfcl.engine.graph_runner import DecodeGraphRunner
    from sfcl.engine.model_runner import ModelRunner
    from sfcl.engine.request import SamplingParams
    from sfcl.engine.scheduler import SchedulerOutput, Sequence

    dev = torch.device("cuda")
    a, model = _small(gb, dev)
    snap = gb.random_snapshotter(a, dev, 1024, tmp_path)
    kv = gb.new_kv(a, dev, torch.float32, 4, 128)
    tap = gb.tap_layer(a)
    runner = ModelRunner(model, kv, tap, snap, "cuda", graphs=DecodeGraphRunner(model, kv, tap), fused_lookup=True)
    seqs = []
    for i in range(4):
        s = Sequence(f"s{i}", list(range(3, 40 + i)), SamplingParams(max_tokens=100, snapshot_mode="always"))
        s.slot, s.num_computed = i, len(s.prompt_ids)
        runner.admit(s.request_id)
        seqs.append(s)
    plan = SchedulerOutput(moves=[], prefill=[], decode=seqs, finished=[])
    for _ in range(3):  # capture, warm-up
        out = runner.execute(plan)
        for s in seqs:
            s.output_ids.append(out.results[s.request_id].token_id)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            out = runner.execute(plan)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    n = sum("synchroniz" in str(x.message) for x in w)
    print(f"synchronising operations in one pure-decode step: {n}")
    assert out.lookups == 4 and n <= 3


def test_gpu_bench_tiny_on_cuda_uses_graphs(gb, tmp_path):
    out = tmp_path / "g.json"
    assert gb.main(["--tiny", "--device", "cuda", "--steps", "8", "--warmup", "2", "--context", "16",
                    "--copy-mib", "64", "--anchors", "256", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(r["graph_ms"] and r["graph_ms"] > 0 and r["hf_ms"] > 0 for r in rows)
    assert all(r["engine_graph_ms"] > 0 and r["engine_graph_replays"] > 0 for r in rows)
