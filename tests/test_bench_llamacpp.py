"""``sfcl bench`` with llama.cpp peers (llama-cpp-python server, llama-server): interleaving, a
peer missing or failing to start, and peers stopped when a step or warm-up raises."""

from __future__ import annotations

import contextlib

import pytest


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
