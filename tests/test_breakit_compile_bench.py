"""Break-it probes of the compiled decode step (private code object per model, guard filter, C++
wrapper), the K q^T decode scores, and ``sfcl bench``'s llama.cpp single-stream interleaving."""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch

from sfcl.config import EngineConfig
from sfcl.engine.engine import run_to_completion
from sfcl.engine.events import TextDelta
from sfcl.engine.request import SamplingParams


def _texts(events):
    return ["".join(e.text for e in ev if isinstance(e, TextDelta)) for ev in events]


# ---------------------------------------------------------------- compiled decode (slow)


@pytest.mark.slow
def test_two_models_and_one_model_twice_compiled_in_one_process(cache_dir):
    """Two fp32 models of one architecture with different weights (nothing the filtered guards
    check tells them apart: only the private code object does), plus a second engine on the first
    model, all compiled in one process before any serves: each compiled engine gives its own eager
    engine's greedy text (the two models' texts differ), and serving mixed batch sizes (1 and 2)
    compiles nothing after warm-up. fp32: compiled and eager round alike (bf16 does not).
    Checked: this also passes with one shared code object (no ``_private_function``), so it pins
    the end-to-end behaviour, not the need for the private copy."""
    import copy
    import dataclasses

    from conftest import contractnli_docs

    from sfcl.model.loader import load_model
    from sfcl.serving import make_llm_engine

    fp32 = load_model(None, dtype=torch.float32, cache_dir=cache_dir)
    other = dataclasses.replace(fp32, model=copy.deepcopy(fp32.model))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in other.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05 * p.float().std())
    ids = fp32.tokenizer.encode(contractnli_docs(1)[0].text[:2000])
    prompts = [(ids[:n], SamplingParams(max_tokens=m, temperature=0, ignore_eos=True))
               for n, m in ((60, 14), (17, 20), (90, 6))]
    cfg = dict(max_num_seqs=2, max_model_len=256)
    comp = {name: make_llm_engine(m, None, EngineConfig(**cfg, compile=True)) for name, m in
            (("a", fp32), ("b", other), ("a-again", fp32))}
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    texts = {}
    for name, m in (("b", other), ("a", fp32), ("a-again", fp32)):
        eager = make_llm_engine(m, None, EngineConfig(**cfg))
        a, b = run_to_completion(eager, prompts), run_to_completion(comp[name], prompts)
        assert comp[name].runner.compiled_decode.calls > 10, name
        assert _texts(a) == _texts(b), name
        texts[name] = _texts(b)
    assert texts["a"] != texts["b"]  # the probe can tell the two models apart
    assert torch._dynamo.utils.counters["frames"]["ok"] == frames  # nothing compiled while serving
    assert not torch._dynamo.utils.counters["graph_break"]  # no nested frame with a shared code object


# ---------------------------------------------------------------- decode scores K q^T


@pytest.mark.parametrize("dtype, kv_dtype", [(torch.bfloat16, "auto"), (torch.float32, "auto"),
                                             (torch.bfloat16, "int8")])
@pytest.mark.parametrize("contiguous_rows", [True, False])
def test_decode_scores_k_qT_equal_q_kT(lm, dtype, kv_dtype, contiguous_rows):
    """decode_attn's scores as (K q^T)^T give the old q K^T figures: B = 3 rows attending to
    different lengths, rows as a slot range (views) or an index (slots 3, 0, 2; slot_range None),
    bf16/fp32 and the INT8 KV cache."""
    from sfcl.engine.kv_cache import KVCache
    from sfcl.model.llama import AttnBatch, Attention

    a = lm.args
    attn = Attention(a)
    nh, nkv, hd = a.n_heads, a.n_kv_heads, a.head_dim
    gen = torch.Generator().manual_seed(0)
    kv = KVCache(a, 4, 64, dtype, kv_dtype=kv_dtype)
    kv.ensure_initialized(4, 64)
    S, lens = 37, torch.tensor([37, 12, 25])
    slots = torch.tensor([0, 1, 2]) if contiguous_rows else torch.tensor([3, 0, 2])
    for pos in range(S - 1):  # history, one position at a time for every row
        kv.write_decode(0, torch.arange(4), torch.full((4,), pos), torch.randn(4, nkv, hd, generator=gen).to(dtype),
                        torch.randn(4, nkv, hd, generator=gen).to(dtype))
    q = torch.randn(3, nh, hd, generator=gen).to(dtype)
    k, v = (torch.randn(3, nkv, hd, generator=gen).to(dtype) for _ in range(2))
    mask = (torch.arange(S)[None, :] < lens[:, None]).view(3, 1, 1, S)
    batch = AttnBatch(is_prefill=False, slots=slots, positions=lens - 1, kv_len=S, mask=mask,
                      slot_range=(0, 3) if contiguous_rows else None)
    o, p = attn.decode_attn(q, k, v, batch, kv, 0, True)
    kk, vv = kv.read(0, slots, S)  # the old formula on the same cache
    g = nh // nkv
    s_ref = torch.matmul(q.reshape(3, nkv, g, hd), kk.transpose(-1, -2)) * attn.scale
    p_ref = s_ref.float().masked_fill(~mask.view(3, 1, 1, S), float("-inf")).softmax(-1)
    o_ref = torch.matmul(p_ref.to(vv.dtype), vv).view(3, nh * hd)
    torch.testing.assert_close(p, p_ref.view(3, nh, 1, S))
    torch.testing.assert_close(o, o_ref)
    assert (p.view(3, nh, S)[1, :, 12:] == 0).all() and (p.view(3, nh, S)[1, :, :12] > 0).all()


# ---------------------------------------------------------------- sfcl bench: llama.cpp interleaving


def _bench(monkeypatch, serve, tmp_path, argv, *, llama="up", sfcl_error=None, step_error=None, events=None,
           warmup_error=None):
    """``sfcl bench`` (via ``sfcl.cli.main``) with SFCL's server and llama.cpp's server replaced by
    the FakeEngine HTTP server: ``llama`` "up" (a fake server that records start/stop), "fail"
    (RuntimeError on start), "skip" (the real ``llamacpp_server`` with llama_cpp reported missing).
    Returns (rc, report.json or None, events)."""
    import json
    from types import SimpleNamespace

    from sfcl.bench import peers, run
    from sfcl.cli import main
    from sfcl.server.testing import FakeEngine

    url, _ = serve(FakeEngine(max_model_len=10**6))
    events = events if events is not None else []

    @contextlib.contextmanager
    def fake_llama(a, plan, res, out):
        events.append("llama start")
        if llama == "fail":
            raise RuntimeError("llamacpp exited with code 1 before it was ready")
        try:
            yield run._target("llamacpp", url, plan), SimpleNamespace(monitor=None)
        finally:
            events.append("llama stop")

    def fake_sfcl(a, plan, res, modes, out, single_peers=()):
        events.append(("sfcl", tuple(p.target.name for p in single_peers)))
        if sfcl_error is not None:
            raise sfcl_error
        targets = [(run._target(f"sfcl-{m}", url, plan, headers={"x-sfcl-snapshot": m}), k)
                   for k, m in enumerate(modes)]
        run.bench_interleaved(targets, plan, res, None, single_peers)

    real_llamacpp = run.run_llamacpp

    def spy_llamacpp(*args, **kw):
        events.append("run_llamacpp")
        if step_error is not None:
            raise step_error
        return real_llamacpp(*args, **kw)

    if llama == "skip":
        monkeypatch.setattr(peers, "llamacpp_available", lambda: "No module named 'llama_cpp'")
    else:
        monkeypatch.setattr(run, "llamacpp_server", fake_llama)
    monkeypatch.setattr(run, "run_sfcl", fake_sfcl)
    monkeypatch.setattr(run, "run_llamacpp", spy_llamacpp)
    if warmup_error is not None:
        def bad_warmup(*args, **kw):
            raise warmup_error

        monkeypatch.setattr(run, "_warmup", bad_warmup)
    out = tmp_path / "out"
    try:
        rc = main(["bench", "--quick", "--rounds", "2", "--single-requests", "2", "--out", str(out), *argv])
    finally:
        events.append("returned")
    doc = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else None
    return rc, doc, events


def _rows(doc):
    return {(r["system"], r["workload"]) for r in doc["summaries"]}


def test_bench_llamacpp_interleaved_then_rest_then_stopped(monkeypatch, serve, tmp_path):
    pytest.importorskip("matplotlib")
    rc, doc, ev = _bench(monkeypatch, serve, tmp_path,
                         ["--systems", "sfcl-off,llamacpp", "--workloads", "single,concurrent"])
    assert rc == 0
    assert ev == ["llama start", ("sfcl", ("llamacpp",)), "run_llamacpp", "llama stop", "returned"]
    assert _rows(doc) == {("sfcl-off", "single"), ("sfcl-off", "concurrent"), ("llamacpp", "single"),
                          ("llamacpp", "concurrent")}
    assert (tmp_path / "out" / "report.md").read_text().count("single stream: llamacpp ran its single-stream") == 1


def test_bench_llamacpp_missing_gives_one_skip_note(monkeypatch, serve, tmp_path):
    pytest.importorskip("matplotlib")
    for extra in ([], ["--separate-single"]):
        rc, doc, ev = _bench(monkeypatch, serve, tmp_path / str(len(extra)),
                             ["--systems", "sfcl-off,llamacpp", "--workloads", "single", *extra], llama="skip")
        assert rc == 0
        md = (tmp_path / str(len(extra)) / "out" / "report.md").read_text()
        assert md.count("llamacpp skipped") == 1, extra
        assert _rows(doc) == {("sfcl-off", "single")}


def test_bench_llamacpp_start_failure_is_a_note_and_sfcl_still_measured(monkeypatch, serve, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc, doc, ev = _bench(monkeypatch, serve, tmp_path, ["--systems", "sfcl-off,llamacpp", "--workloads", "single"],
                         llama="fail")
    assert rc == 0
    assert ev == ["llama start", ("sfcl", ()), "returned"]  # no second start attempt
    assert _rows(doc) == {("sfcl-off", "single")}
    assert "llamacpp failed: llamacpp exited" in capsys.readouterr().err
    assert (tmp_path / "out" / "report.md").read_text().count("llamacpp failed") == 1


@pytest.mark.parametrize("argv", [["--systems", "sfcl-off,llamacpp", "--workloads", "single", "--separate-single"],
                                  ["--systems", "sfcl-off,llamacpp", "--workloads", "concurrent"],
                                  ["--systems", "llamacpp", "--workloads", "single,concurrent"]])
def test_bench_llamacpp_on_its_own_when_not_interleaved(monkeypatch, serve, tmp_path, argv):
    pytest.importorskip("matplotlib")
    rc, doc, ev = _bench(monkeypatch, serve, tmp_path, argv)
    assert rc == 0
    sfcl = [e for e in ev if isinstance(e, tuple)]
    assert all(e == ("sfcl", ()) for e in sfcl)  # SFCL ran without a single-stream peer
    assert ev[-4:] == ["run_llamacpp", "llama start", "llama stop", "returned"]
    wls = argv[argv.index("--workloads") + 1].split(",")
    assert {w for s, w in _rows(doc) if s == "llamacpp"} == set(wls)


class _Unexpected(Exception):
    """An error no step of cmd_bench catches."""


def test_bench_llama_server_stopped_when_a_step_raises(monkeypatch, serve, tmp_path):
    """An error no step catches (raised by llama.cpp's remaining workloads) still stops llama.cpp's
    server before it leaves cmd_bench."""
    ev = []
    with pytest.raises(_Unexpected):
        _bench(monkeypatch, serve, tmp_path, ["--systems", "sfcl-off,llamacpp", "--workloads", "single,concurrent"],
               step_error=_Unexpected("boom"), events=ev)
    assert ev == ["llama start", ("sfcl", ("llamacpp",)), "run_llamacpp", "llama stop", "returned"]


def test_bench_llama_server_stopped_when_its_warmup_raises(monkeypatch, serve, tmp_path):
    """The warm-up right after llama.cpp's server starts (before the steps run) raises (Ctrl-C
    there): the server is stopped all the same. It used to be left running (the ExitStack was
    entered only around the steps)."""
    ev = []
    with pytest.raises(_Unexpected):
        _bench(monkeypatch, serve, tmp_path, ["--systems", "sfcl-off,llamacpp", "--workloads", "single"],
               warmup_error=_Unexpected("interrupted"), events=ev)
    assert ev == ["llama start", "llama stop", "returned"]


def test_bench_sfcl_failure_still_measures_llamacpp_single(monkeypatch, serve, tmp_path):
    """SFCL's server fails to start (RuntimeError): llama.cpp's server is up and warmed, so its
    single-stream workload must still be measured (it used to be, before the interleaving)."""
    pytest.importorskip("matplotlib")
    rc, doc, ev = _bench(monkeypatch, serve, tmp_path, ["--systems", "sfcl-off,llamacpp", "--workloads",
                                                         "single,concurrent"], sfcl_error=RuntimeError("sfcl down"))
    assert rc == 0
    assert ev[-2:] == ["llama stop", "returned"]
    assert _rows(doc) == {("llamacpp", "single"), ("llamacpp", "concurrent")}
