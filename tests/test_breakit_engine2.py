"""Break-it tests for the features landed on 2026-11-30: --compile with --weight-quant, per-step
thread switching, the sampler, interleaved bench rounds. (The int8 anchor-candidate pass they also
covered is gone: ``sfcl.anchors.index`` searches large libraries through IVF, tests in
tests/test_anchor_index.py.)"""

from collections import defaultdict

import os

import pytest
import torch

from sfcl.config import EngineConfig
from sfcl.engine.events import Finished, TextDelta
from sfcl.engine.request import SamplingParams


# --- 2. CompiledDecode + weight quant -----------------------------------------------------------

def _drive(engine, reqs, abort_rid=None, abort_after=None):
    """Add reqs [(rid, ids, params)], step until done; abort ``abort_rid`` after it streamed
    ``abort_after`` deltas. Returns {rid: events}."""
    ev = defaultdict(list)
    for rid, ids, p in reqs:
        for r, e in engine.add_request(rid, ids, p):
            ev[r].append(e)
    aborted = False
    while engine.has_work():
        for r, e in engine.step():
            ev[r].append(e)
        if abort_rid and not aborted and sum(isinstance(e, TextDelta) for e in ev[abort_rid]) >= abort_after:
            engine.abort(abort_rid)
            aborted = True
    return ev


def _text(events):
    return "".join(e.text for e in events if isinstance(e, TextDelta))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("SFCL_HEAVY_TESTS"), reason="~7.5 min of compiling on 2 cores; "
                    "set SFCL_HEAVY_TESTS=1 (tests/test_compiled.py covers int4 + compile in CI)")
def test_compiled_int8_weights_3_slots_sampling_stop_abort(cache_dir, lm):
    """--compile + --weight-quant int8 with max_num_seqs=3 (kernel cut 7 > slots): greedy with a
    stop string, two sampled rows (top_p < 1 and == 1), one aborted mid-decode, a 4th request
    waiting for a slot: same text as eager, nothing compiled after warm-up."""
    from conftest import contractnli_docs
    from sfcl.model.loader import load_model
    from sfcl.model.quant import quantize_weights
    from sfcl.serving import make_llm_engine

    ids = lm.tokenizer.encode(contractnli_docs(1)[0].text[:2000])
    m8 = load_model(None, dtype=torch.float32, cache_dir=cache_dir)
    quantize_weights(m8.model, "int8")
    cfg = dict(max_num_seqs=3, max_model_len=512, max_num_batched_tokens=64)
    eager = make_llm_engine(m8, None, EngineConfig(**cfg))
    probe = _drive(eager, [("p", ids[:80], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))])
    full = _text(probe["p"])
    assert len(full) >= 8
    stop = full[len(full) // 2:len(full) // 2 + 3]  # a substring of the greedy output: it must stop

    def reqs():
        return [("g", ids[:80], SamplingParams(max_tokens=24, temperature=0, stop=[stop], ignore_eos=True)),
                ("s1", ids[:40], SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)),
                ("s2", ids[:150], SamplingParams(max_tokens=20, temperature=1.0, top_p=1.0, seed=2, ignore_eos=True)),
                ("w", ids[:25], SamplingParams(max_tokens=10, temperature=0.7, seed=3, ignore_eos=True))]

    a = _drive(make_llm_engine(m8, None, EngineConfig(**cfg)), reqs(), "s2", 5)
    comp = make_llm_engine(m8, None, EngineConfig(**cfg, compile=True))
    cd = comp.runner.compiled_decode
    assert cd.batch_buckets() == [1, 2, 3]
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    b = _drive(comp, reqs(), "s2", 5)
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames  # nothing compiled while serving
    assert cd.calls > 10
    for rid in ("g", "s1", "s2", "w"):
        assert _text(a[rid]) == _text(b[rid]), rid
    fin = b["g"][-1]
    assert isinstance(fin, Finished) and fin.stop_sequence == stop and stop not in _text(b["g"])
    assert not any(isinstance(e, Finished) for e in b["s2"]) or b["s2"][-1].stop_reason != "max_tokens"
    assert isinstance(b["w"][-1], Finished) and b["w"][-1].completion_tokens == 10


def test_compiled_buckets_one_slot(lm):
    """max_num_seqs=1 with an int4 model: only the B=1 graph (cut 7 > 1 slot)."""
    import copy

    from sfcl.engine.kv_cache import KVCache
    from sfcl.model.compiled import CompiledDecode
    from sfcl.model.quant import quantize_weights

    m = quantize_weights(copy.deepcopy(lm.model), "int4")
    assert CompiledDecode(m, KVCache(lm.args, 1, 64, torch.bfloat16)).batch_buckets() == [1]
    assert CompiledDecode(m, KVCache(lm.args, 7, 64, torch.bfloat16)).batch_buckets() == [1, 2, 7]
    m0 = quantize_weights(copy.deepcopy(lm.model), "int8", max_rows=0)  # dense for every B
    assert CompiledDecode(m0, KVCache(lm.args, 3, 64, torch.bfloat16)).batch_buckets() == [1, 2, 3]


# --- 4. sampler -----------------------------------------------------------------------------------

def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_sample_empty_and_single_row():
    from sfcl.engine.sampler import sample

    assert sample(torch.zeros(0, 5), [], [], []).shape == (0,)
    assert sample(torch.tensor([[0.0, 3.0, 1.0]]), [0.0], [1.0], [None]).tolist() == [1]
    t = sample(torch.tensor([[0.0, 3.0, 1.0]]), [1.0], [0.5], [_gen(0)])
    assert t.tolist() == [1] and t.dtype == torch.int64  # nucleus 0.5 keeps only the top token (p=0.84)


def test_sample_nonfinite_rows_fall_back_to_argmax():
    """+inf in a sampled row -> that token; a NaN / all -inf sampled row returns an in-range id;
    other rows of the batch are unaffected."""
    from sfcl.engine.sampler import sample

    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[0.0, inf, 1.0, 2.0], [-inf, -inf, -inf, -inf], [nan, 1.0, 2.0, 0.0],
                           [0.0, 0.0, 50.0, 0.0], [1.0, 5.0, 2.0, 0.0]])
    out = sample(logits, [1.0, 1.0, 0.7, 1.0, 0.0], [1.0, 0.9, 0.5, 1.0, 1.0], [_gen(i) for i in range(5)])
    assert out[0] == 1 and out[3] == 2 and out[4] == 1
    assert all(0 <= int(t) < 4 for t in out)


def test_sample_mixed_batch_distribution():
    """Rows mixing greedy, plain temperature, top_p < 1 and top_p == 1: each sampled row's empirical
    distribution matches softmax(logits / T) restricted to its nucleus."""
    from sfcl.engine.sampler import sample

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]]).repeat(4, 1)
    temps, tops = [0.0, 1.0, 0.5, 1.5], [1.0, 1.0, 0.8, 0.95]
    gens = [None, _gen(1), _gen(2), _gen(3)]
    n = 3000
    counts = torch.zeros(4, 5)
    for _ in range(n):
        out = sample(logits, temps, tops, gens)
        counts[torch.arange(4), out] += 1
    assert counts[0, 0] == n  # greedy
    for r in (1, 2, 3):
        p = torch.softmax(logits[r] / temps[r], -1)
        sp, si = p.sort(descending=True)
        keep = sp.cumsum(0) - sp < tops[r]
        want = torch.zeros(5)
        want[si[keep]] = sp[keep] / sp[keep].sum()
        got = counts[r] / n
        assert (got[want == 0] == 0).all(), (r, got, want)
        assert torch.allclose(got, want, atol=0.03), (r, got, want)


def test_sample_seed_reproducible_across_batch_composition():
    """A seeded row draws the same token whatever rows share its batch (its own generator)."""
    from sfcl.engine.sampler import sample

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 50, generator=g)
    alone = sample(logits[1:2], [0.9], [0.9], [_gen(42)])
    mixed = sample(logits, [0.0, 0.9, 1.3], [1.0, 0.9, 1.0], [None, _gen(42), _gen(7)])
    assert alone[0] == mixed[1]


def test_quantlinear_int8_bf16_odd_in_features_does_not_crash():
    """BUG (same kernel): ``--weight-quant int8`` on a bf16 model whose linear in_features is not a
    multiple of 16 segfaults in torch._weight_int8pack_mm (float32/float16 inputs work). int4
    rejects K % 32 != 0 with a ValueError; int8 has no such check. Subprocess: the crash kills it."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("import torch\nfrom sfcl.model.quant import QuantLinear\n"
            "l = torch.nn.Linear(24, 8, bias=False).bfloat16()\n"
            "x = torch.randn(2, 24).bfloat16()\n"
            "try:\n    y = QuantLinear.from_linear(l, 'int8', 6)(x)\nexcept ValueError:\n    print('OK'); raise SystemExit\n"
            "assert torch.allclose(y.float(), l(x).float(), atol=0.1)\nprint('OK')\n")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, f"rc={r.returncode} stderr={r.stderr[-500:]}"


# --- 3. threads -----------------------------------------------------------------------------------

def test_engine_threads_defaults_and_explicit():
    from sfcl.serving import engine_threads

    assert engine_threads(None, None, cores=2) == (1, 2)
    assert engine_threads(None, None, cores=1) == (1, 1)
    assert engine_threads(3, None, cores=2) == (3, 3)  # prefill never below decode by default
    assert engine_threads(1, 4, cores=2) == (1, 4)
    assert engine_threads(4, 1, cores=8) == (4, 1)  # explicit prefill below decode is honoured


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_serve_threads_non_positive_is_a_clear_error(bad):
    """BUG: `sfcl serve --threads -1` loads the model, then dies with a RuntimeError traceback from
    torch.set_num_threads (exit 1); `--threads 0` silently means "default". Expected (like
    --prefill-threads 0): one line `sfcl: error: ...`, exit 2, before loading anything."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "sfcl.cli", "serve", "--threads", bad, "--port", "0",
                        "--model", "/nonexistent/model.gguf"], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "threads" in r.stderr and "Traceback" not in r.stderr, r.stderr[-400:]


@pytest.mark.parametrize("flag", ["--threads", "--prefill-threads"])
def test_serve_huge_thread_count_does_not_segfault(flag):
    """BUG: `sfcl serve --threads 100000` (or --prefill-threads) segfaults (exit 139) inside
    torch.set_num_threads' OpenMP pool. Expected: a clear `sfcl: error:` (exit 2) or a clamp."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "sfcl.cli", "serve", flag, "100000", "--port", "0",
                        "--model", "/nonexistent/model.gguf"], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("sfcl: error:"), (r.returncode, r.stderr[-300:])


def test_runner_switches_threads_per_step():
    """_use_threads: prefill count for >= PREFILL_THREADS_MIN_TOKENS prompt tokens, decode count
    otherwise, nothing when either is unset; restores the caller's count afterwards here."""
    from sfcl.engine.model_runner import PREFILL_THREADS_MIN_TOKENS, ModelRunner

    before = torch.get_num_threads()
    try:
        r = ModelRunner.__new__(ModelRunner)
        r.prefill_threads, r.decode_threads = 2, 1
        r._use_threads(PREFILL_THREADS_MIN_TOKENS)
        assert torch.get_num_threads() == 2
        r._use_threads(PREFILL_THREADS_MIN_TOKENS - 1)
        assert torch.get_num_threads() == 1
        r._use_threads(0)
        assert torch.get_num_threads() == 1
        r.prefill_threads = None
        torch.set_num_threads(2)
        r._use_threads(0)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


# --- 5. bench rounds ------------------------------------------------------------------------------

@pytest.mark.parametrize("n,rounds,wave", [(1, 1, 1), (1, 5, 1), (3, 10, 2), (5, 10, 1), (48, 2, 16),
                                           (47, 3, 16), (8, 3, 2), (100, 7, 4), (2, 0, 1), (4, 2, 0), (96, 4, 16)])
def test_split_invariants(n, rounds, wave):
    """Rounds are whole waves (multiples of the level's concurrency), as equal as whole waves
    allow; the requests that do not fill a wave ride with the last round."""
    from sfcl.bench.run import _split

    parts = _split(n, rounds, wave)
    w = max(1, wave)
    assert sum(parts) == n and 1 <= len(parts) <= max(1, rounds)
    assert all(p % w == 0 for p in parts[:-1]) and all(p >= w for p in parts if n >= w)
    waves = [p // w for p in parts]
    assert max(waves) - min(waves) <= 1


@pytest.mark.parametrize("rounds", [1, 5])
def test_bench_interleaved_rounds_edges(serve, rounds):
    """rounds=1 (one pass per mode) and rounds larger than the requests (falls back to fewer
    rounds): every request is sent once and pooled into its mode's rows."""
    from sfcl.bench import clients, workloads
    from sfcl.bench.run import Plan, Results, bench_interleaved

    url, eng = serve()
    targets = [(clients.Target(f"sfcl-{m}", url, model="fake-model", headers={"x-sfcl-snapshot": m}), k)
               for k, m in enumerate(("off", "always"))]
    plan = Plan(workloads=("single", "concurrent"), levels=(3,), single_requests=3, requests_per_level=4,
                max_tokens=2, longdoc_max_tokens=2, prompts=workloads.short_prompts(4), rounds=rounds)
    res = Results()
    bench_interleaved(targets, plan, res, None)
    assert len(eng.encoded) == 2 * (3 + 4)
    assert len(res.samples["sfcl-off|single|c1"]) == 3 and len(res.samples["sfcl-always|concurrent|c3"]) == 4
    assert all(s.error is None for v in res.samples.values() for s in v)
