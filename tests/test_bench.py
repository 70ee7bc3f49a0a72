"""sfcl.bench: statistics and report on synthetic samples, the streaming client against the
FakeEngine server, the process helpers on tiny subprocesses, and the CLI end to end against a
FakeEngine peer. No real benchmark runs here (no model, no timing assertions)."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

from sfcl.bench import clients, peers, report, workloads
from sfcl.bench.run import parse_peer, parse_systems
from sfcl.bench.stats import RequestSample, Summary, percentile, ratio, summarize, variance
from sfcl.server.testing import DEFAULT_REPLY, FakeEngine


# -- stats ------------------------------------------------------------------------------------

def test_percentile_interpolates_like_numpy_linear():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 95) == pytest.approx(3.85)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_variance_and_ratio():
    assert variance([1, 2, 3, 4]) == pytest.approx(1.25)
    assert variance([]) is None
    assert ratio(3.0, 2.0) == 1.5 and ratio(1.0, 0) is None and ratio(None, 1.0) is None


def sample(ttft, gaps, tokens=None, start=0.0, snaps=(), error=None):
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    n = len(times) if tokens is None else tokens
    return RequestSample(ttft_ms=ttft, e2e_ms=times[-1], chunk_times_ms=times, output_tokens=n,
                         tokens_from_usage=True, snapshot_lookup_ms=list(snaps), snapshots=len(snaps),
                         error=error, start_s=start, end_s=start + times[-1] / 1e3)


def test_sample_gaps_and_tpot():
    s = sample(100.0, [10.0, 30.0])
    assert s.gaps_ms == [10.0, 30.0]
    assert s.tpot_ms == pytest.approx(20.0)  # (140 - 100) / (3 - 1)
    assert sample(5.0, []).tpot_ms is None


def test_summarize_figures():
    ss = [sample(100.0, [10.0, 30.0], start=0.0, snaps=[0.2, 0.4]),
          sample(200.0, [20.0, 20.0], start=0.05),
          sample(50.0, [1.0], error="HTTP 500: boom")]
    sm = summarize("x", "concurrent", 2, ss, wall_s=2.0, snapshots=True, peak_rss_bytes=123)
    assert (sm.requests, sm.errors, sm.output_tokens) == (3, 1, 6)
    assert sm.tokens_per_s == pytest.approx(3.0)
    assert sm.ttft_p50_ms == pytest.approx(150.0)
    assert sm.itl_p50_ms == pytest.approx(20.0)
    assert sm.itl_var_ms2 == pytest.approx((100.0 + 0.0) / 2)  # per-request variances averaged
    assert sm.snapshots_per_1k_tokens == pytest.approx(1000 * 2 / 6)
    assert sm.lookup_p50_ms == pytest.approx(0.3) and sm.lookups == 2
    assert sm.peak_rss_bytes == 123 and sm.tokens_counted_by == "usage"
    off = summarize("x", "single", 1, ss[:2])  # wall time from the samples' own clock
    assert off.snapshots_per_1k_tokens is None and off.lookup_p99_ms is None and off.lookups is None
    assert off.wall_s == pytest.approx(0.05 + 0.24)


# -- report -----------------------------------------------------------------------------------

def row(system, workload, c, tps=None, ttft95=None, tpot=None):
    return Summary(system=system, workload=workload, concurrency=c, requests=4, errors=0, output_tokens=64,
                   wall_s=1.0, tokens_per_s=tps, ttft_p50_ms=ttft95, ttft_p95_ms=ttft95, tpot_p50_ms=tpot,
                   tpot_p95_ms=tpot, itl_p50_ms=tpot, itl_p95_ms=tpot, itl_var_ms2=4.0, peak_rss_bytes=2**30)


def synthetic_rows():
    return [row("sfcl-off", "concurrent", 16, tps=100.0), row("sfcl-triggered", "concurrent", 16, tps=99.0),
            row("sfcl-always", "concurrent", 16, tps=50.0), row("llama-server", "concurrent", 16, tps=40.0),
            row("llamacpp", "concurrent", 16, tps=20.0),
            row("sfcl-triggered", "concurrent", 32, tps=120.0), row("llama-server", "concurrent", 32, tps=80.0),
            row("sfcl-triggered", "single", 1, tpot=20.0), row("llama-server", "single", 1, tpot=10.0),
            row("sfcl-triggered", "longdoc-cold", 1, ttft95=1000.0),
            row("sfcl-triggered", "longdoc-repeat", 1, ttft95=80.0),
            row("llama-server", "longdoc-cold", 1, ttft95=2500.0)]


def test_targets_ratios_and_marks():
    c16, c32, dec, cold, pc, pc_peer, rss, trig, alw, second = report.compute_targets(synthetic_rows())
    assert c16.name.startswith("throughput at 16 streams, sfcl-triggered / llama-server")
    assert c16.value == pytest.approx(99.0 / 40.0) and c16.mark == "PASS"  # >= 1.5
    assert c32.name.startswith("throughput at 32 streams") and c32.value == pytest.approx(1.5) and c32.mark == "FAIL"
    assert dec.name.startswith("single-stream decode")
    assert dec.value == pytest.approx(0.5) and dec.mark == "FAIL"  # TPOT 20 ms vs 10 ms
    assert cold.value == pytest.approx(0.4) and cold.mark == "PASS"  # 1000 vs 2500 ms, <= 0.5
    assert pc.name.endswith("sfcl-triggered") and pc.value == pytest.approx(0.08) and pc.mark == "PASS"
    assert pc_peer.value is None and pc_peer.passed is None and pc_peer.mark == "info"
    assert rss.value == pytest.approx(1.0) and rss.mark == "PASS"  # both rows 1 GiB
    assert trig.name == "throughput sfcl-triggered / sfcl-off (16 streams)"
    assert trig.value == pytest.approx(0.99) and trig.mark == "PASS"
    assert alw.value == pytest.approx(0.5) and alw.mark == "info"
    assert second.value == pytest.approx(99.0 / 20.0) and second.mark == "info"


def test_lookup_targets_name_how_many_lookups_the_p99_rests_on():
    rows = synthetic_rows()
    rows[1].lookups, rows[1].lookup_p50_ms, rows[1].lookup_p99_ms = 250, 0.12, 0.27  # triggered, 16 streams
    rows[7].lookups, rows[7].lookup_p50_ms, rows[7].lookup_p99_ms = 21, 0.11, 0.38  # triggered, single
    rows[0].lookups, rows[0].lookup_p99_ms = 9, 5.0  # sfcl-off: not a target
    checks = report.compute_targets(rows)
    c16, single = checks[10:]
    assert c16.name == "snapshot lookup p99 ms, sfcl-triggered, concurrent at 16 stream(s)"
    assert c16.value == 0.27 and c16.mark == "PASS" and c16.detail == "250 lookups, p50 0.120 ms"
    assert single.value == 0.38 and single.mark == "FAIL" and "about their maximum" in single.detail
    assert "| 250 | 0.120 | 0.270 |" in report.markdown(rows, checks, {})


def test_targets_fall_back_to_largest_common_level():
    rows = [row("sfcl-triggered", "concurrent", 4, tps=30.0), row("llama-server", "concurrent", 4, tps=10.0),
            row("sfcl-triggered", "concurrent", 8, tps=60.0)]
    c = report.compute_targets(rows)[0]
    assert c.name.startswith("throughput at 4 streams") and c.value == pytest.approx(3.0) and c.mark == "PASS"
    assert "16 not measured" in c.detail


def test_markdown_json_and_plots_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = synthetic_rows()
    checks = report.compute_targets(rows)
    meta = {"date": "2026-01-01 00:00 UTC", "machine": "test", "model": "m", "command": "sfcl bench"}
    md = report.markdown(rows, checks, meta, ["a note"])
    assert "| sfcl-triggered | concurrent | 16 |" in md and "1,024" in md  # RSS in MiB
    assert "PASS" in md and "FAIL" in md and "- a note" in md
    samples = {"sfcl-off|concurrent|c16": [sample(100.0, [10.0, 12.0])],
               "llamacpp|concurrent|c16": [sample(300.0, [20.0, 25.0])]}
    report.write_json(tmp_path / "r.json", rows, checks, meta, samples)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert len(doc["summaries"]) == len(rows) and doc["targets"][0]["mark"] == "PASS"
    assert doc["samples"]["llamacpp|concurrent|c16"][0]["ttft_ms"] == 300.0
    pngs = report.write_plots(tmp_path, rows, samples)
    assert {p.name for p in pngs} == {"throughput_vs_concurrency.png", "latency_hist.png", "longdoc_ttft.png"}
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- argument parsing, workloads ----------------------------------------------------------------

def test_parse_systems_and_peers():
    assert parse_systems("sfcl,hf,llamacpp") == ("sfcl-off", "sfcl-triggered", "sfcl-always", "hf-bf16", "llamacpp")
    assert parse_systems("hf-fp32, sfcl-off") == ("hf-fp32", "sfcl-off")
    with pytest.raises(ValueError, match="unknown system 'vllm'"):
        parse_systems("vllm")
    assert parse_peer("srv=http://127.0.0.1:8080/") == ("srv", "http://127.0.0.1:8080")
    assert parse_peer("http://10.0.0.1:9000") == ("10.0.0.1:9000", "http://10.0.0.1:9000")
    with pytest.raises(ValueError):
        parse_peer("srv=localhost:8080")


def test_short_prompts_deterministic_varied_and_tagged():
    a, b = workloads.short_prompts(12), workloads.short_prompts(12)
    assert a == b and len({m[0]["content"] for m in a}) == 12
    t = workloads.tagged(a[:3], "m1c4")
    assert t[2][0]["content"].startswith("Ref m1c4-2. ") and a[2][0]["content"] == b[2][0]["content"]
    with pytest.raises(ValueError):
        workloads.short_prompts(0)


def test_long_document_from_contractnli():
    CONTRACTNLI = workloads.CONTRACTNLI_DEV
    if not CONTRACTNLI.is_file():
        pytest.skip("ContractNLI data not available")
    d0 = workloads.long_document(CONTRACTNLI, 4000, 4, index=0)
    d1 = workloads.long_document(CONTRACTNLI, 4000, 4, index=1)
    assert d0.doc_id != d1.doc_id and len(d0.questions) == 4
    assert 8000 < len(d0.text) < 30000
    m0, m3 = d0.messages(0)[0]["content"], d0.messages(3)[0]["content"]
    assert m0.startswith(d0.text) and m3.startswith(d0.text) and m0 != m3
    with pytest.raises(FileNotFoundError):
        workloads.long_document(CONTRACTNLI.parent / "missing.json")


# -- client against the FakeEngine server --------------------------------------------------------

def test_stream_chat_measures_tokens_ttft_and_snapshots(serve):
    url, eng = serve(FakeEngine(snapshot_every=2))
    t = clients.Target("fake", url, model="fake-model", headers={"x-sfcl-snapshot": "triggered"})

    async def go():
        import httpx

        async with httpx.AsyncClient() as c:
            return await clients.stream_chat(c, t, [{"role": "user", "content": "hi"}], 6)

    s = asyncio.run(go())
    assert s.error is None and s.tokens_from_usage and s.output_tokens == 6
    assert len(s.chunk_times_ms) == 6 and s.ttft_ms == s.chunk_times_ms[0] <= s.e2e_ms
    assert s.snapshots == 3 and s.snapshot_lookup_ms == [0.4, 0.4, 0.4]
    assert eng.requests[-1].params.snapshot_mode == "triggered"


def test_stream_chat_records_http_errors(serve):
    url, _ = serve()
    t = clients.Target("fake", url, model="no-such-model")
    s = asyncio.run(clients.sequential(t, [[{"role": "user", "content": "hi"}]], 4))[0]
    assert s.error.startswith("HTTP 404") and s.output_tokens == 0 and s.ttft_ms is None


@pytest.mark.parametrize("finish", [None, "length"])
def test_stream_cut_without_finish_reason_is_an_error(finish):
    """A stream that just stops (no finish_reason, as llama_cpp.server's interrupted streams do)
    is not a short answer but an error; with a finish_reason the same stream is fine, and with no
    usage chunk its tokens are counted from content chunks."""
    import httpx

    def chunk(delta, fr=None):
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": fr}]}) + "\n\n"

    body = chunk({"role": "assistant", "content": ""}) + chunk({"content": "a"}) + chunk({"content": " b"})
    if finish:
        body += chunk({}, finish)
    body += "data: [DONE]\n\n"

    def handler(request):
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, text=body)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await clients.stream_chat(c, clients.Target("m", "http://peer"), [{"role": "user", "content": "x"}], 4)

    s = asyncio.run(go())
    assert s.output_tokens == 2 and not s.tokens_from_usage and len(s.chunk_times_ms) == 2
    assert (s.error is None) == (finish is not None)


def _chunked_sse(chunks: list[bytes], sent: list[float], content_type: str = "text/event-stream"):
    """A MockTransport whose response body arrives as ``chunks``, one network read each; the
    monotonic time each chunk is handed to the client is appended to ``sent``."""
    import time

    import httpx

    class Body(httpx.AsyncByteStream):
        async def __aiter__(self):
            for c in chunks:
                sent.append(time.monotonic())
                yield c

    return httpx.MockTransport(lambda request: httpx.Response(200, headers={"content-type": content_type},
                                                              stream=Body()))


def test_stream_chat_times_each_chunk_when_its_read_completes_it():
    """A frame split over two reads is timed at the second; each frame is timed before the next
    read is even requested (the reader hands frames over per read, it does not buffer)."""
    import httpx

    def frame(delta, fr=None):
        return ("data: " + json.dumps({"choices": [{"index": 0, "delta": delta, "finish_reason": fr}]}) + "\n\n").encode()

    a, b = frame({"content": "a"}), frame({"content": " b"})
    chunks = [a[:9], a[9:], b, frame({}, "length") + b"data: [DONE]\n\n"]
    sent: list[float] = []

    async def go():
        async with httpx.AsyncClient(transport=_chunked_sse(chunks, sent)) as c:
            return await clients.stream_chat(c, clients.Target("m", "http://peer"), [{"role": "user", "content": "x"}], 4)

    s = asyncio.run(go())
    assert s.error is None and s.output_tokens == 2 and len(sent) == 4
    at = [s.start_s + ms / 1e3 for ms in s.chunk_times_ms]  # back to the monotonic clock
    assert sent[1] <= at[0] < sent[2] <= at[1] < sent[3]


def test_stream_chat_non_sse_response_is_an_error():
    import httpx

    async def go():
        transport = _chunked_sse([b'{"choices": []}'], [], content_type="application/json")
        async with httpx.AsyncClient(transport=transport) as c:
            return await clients.stream_chat(c, clients.Target("m", "http://peer"), [{"role": "user", "content": "x"}], 4)

    s = asyncio.run(go())
    assert s.error.startswith("SSEError: Expected response header Content-Type") and s.output_tokens == 0


def test_probe_drops_fields_the_server_rejects(serve):
    url, _ = serve()
    t = clients.Target("fake", url, model=clients.discover_model(url), extra_body={"min_tokens": 8})
    assert t.model == "fake-model"
    t = asyncio.run(clients.probe(t))
    assert t.extra_body == {} and t.include_usage  # SFCL forbids unknown fields; usage stays
    kept = asyncio.run(clients.probe(clients.Target("fake", url, model="fake-model", extra_body={"ignore_eos": True})))
    assert kept.extra_body == {"ignore_eos": True}  # a field SFCL takes is kept
    with pytest.raises(RuntimeError, match="does not answer"):
        asyncio.run(clients.probe(clients.Target("bad", url, model="nope")))


def test_closed_loop_sends_exactly_n_requests(serve):
    url, eng = serve()
    t = clients.Target("fake", url, model="fake-model")
    prompts = [[{"role": "user", "content": f"prompt {i}"}] for i in range(3)]
    done = []
    ss = asyncio.run(clients.closed_loop(t, prompts, 3, 7, 4, done.append))
    assert len(ss) == 7 == len(done) and all(s.error is None and s.output_tokens == 4 for s in ss)
    seen = [e[0][0]["content"] for e in eng.encoded]
    assert sorted(seen) == sorted(f"prompt {i % 3}" for i in range(7))
    with pytest.raises(ValueError):
        asyncio.run(clients.closed_loop(t, prompts, 0, 1, 4))


def test_sfcl_modes_run_in_interleaved_rounds_and_pool_them(serve):
    """bench_interleaved: each mode's single and concurrent requests are split into rounds of whole
    waves and the modes alternate round by round, odd rounds in reverse order (a, b, b, a); each
    mode's row pools its rounds."""
    from sfcl.bench.run import Plan, Results, _split, bench_interleaved

    assert _split(64, 2, 16) == [32, 32] and _split(96, 4, 16) == [32, 32, 16, 16]  # whole waves of 16
    assert _split(48, 2, 16) == [32, 16] and _split(20, 2, 16) == [20] and _split(8, 3, 2) == [4, 2, 2]
    assert _split(3, 4, 1) == [1, 1, 1] and _split(1, 2, 1) == [1] and _split(37, 2, 16) == [16, 21]
    url, eng = serve()
    targets = [(clients.Target(f"sfcl-{m}", url, model="fake-model", headers={"x-sfcl-snapshot": m}), k)
               for k, m in enumerate(("off", "triggered"))]
    plan = Plan(workloads=("single", "concurrent"), levels=(2,), single_requests=4, requests_per_level=8,
                max_tokens=3, longdoc_max_tokens=3, prompts=workloads.short_prompts(8), rounds=2)
    res = Results()
    bench_interleaved(targets, plan, res, None)
    tags = [e[0][0]["content"].split(".")[0] for e in eng.encoded]  # "Ref m0c2r1-3" -> run order
    runs = list(dict.fromkeys(t.rsplit("-", 1)[0] for t in tags))
    assert runs == ["Ref m0sr0", "Ref m1sr0", "Ref m1sr1", "Ref m0sr1",
                    "Ref m0c2r0", "Ref m1c2r0", "Ref m1c2r1", "Ref m0c2r1"]
    rows = {(r.system, r.workload): r for r in res.rows}
    assert set(rows) == {(f"sfcl-{m}", w) for m in ("off", "triggered") for w in ("single", "concurrent")}
    assert len(res.samples["sfcl-off|concurrent|c2"]) == 8 and len(res.samples["sfcl-triggered|single|c1"]) == 4
    assert rows[("sfcl-off", "concurrent")].snapshots_per_1k_tokens is None  # off: no snapshot columns
    assert rows[("sfcl-triggered", "single")].snapshots_per_1k_tokens is not None
    # per-round throughput of the concurrent level, pooled = tokens / summed wall time
    per = res.rounds["concurrent|c2"]
    assert set(per) == {"sfcl-off", "sfcl-triggered"} and all(len(v) == 2 and min(v) > 0 for v in per.values())
    note = [n for n in res.notes if n.startswith("per-round tok/s at 2 streams")]
    assert len(note) == 1 and "/sfcl-off: " in note[0]


def test_single_peer_takes_a_turn_in_the_single_stream_rounds_only(serve):
    """A SinglePeer (llama.cpp's server in ``sfcl bench``) runs its single-stream requests inside
    SFCL's interleaved rounds, after the modes (before them in odd rounds), and no concurrent level; its row
    has no snapshot columns and its memory comes from its own monitor."""
    from sfcl.bench.run import Plan, Results, SinglePeer, bench_interleaved

    url, eng = serve()
    targets = [(clients.Target(f"sfcl-{m}", url, model="fake-model", headers={"x-sfcl-snapshot": m}), k)
               for k, m in enumerate(("off", "triggered"))]
    peer = SinglePeer(clients.Target("llamacpp", url, model="fake-model"), "l", None)
    plan = Plan(workloads=("single", "concurrent"), levels=(2,), single_requests=4, requests_per_level=4,
                max_tokens=3, longdoc_max_tokens=3, prompts=workloads.short_prompts(4), rounds=2)
    res = Results()
    bench_interleaved(targets, plan, res, None, [peer])
    tags = [e[0][0]["content"].split(".")[0] for e in eng.encoded]
    runs = list(dict.fromkeys(t.rsplit("-", 1)[0] for t in tags))
    assert runs == ["Ref m0sr0", "Ref m1sr0", "Ref lsr0", "Ref lsr1", "Ref m1sr1", "Ref m0sr1",
                    "Ref m0c2r0", "Ref m1c2r0", "Ref m1c2r1", "Ref m0c2r1"]
    rows = {(r.system, r.workload): r for r in res.rows}
    assert ("llamacpp", "single") in rows and ("llamacpp", "concurrent") not in rows
    assert len(res.samples["llamacpp|single|c1"]) == 4
    assert rows[("llamacpp", "single")].snapshots_per_1k_tokens is None
    assert set(res.rounds["concurrent|c2"]) == {"sfcl-off", "sfcl-triggered"}
    assert any(n.startswith("single stream: llamacpp ran its single-stream requests in the same 2") for n in res.notes)


def test_round_note_gives_each_rounds_ratio_to_the_base():
    from sfcl.bench.run import round_note

    note = round_note(16, {"sfcl-off": [200.0, 220.0], "sfcl-triggered": [196.0, 231.0]}, "sfcl-off")
    assert note == ("per-round tok/s at 16 streams: sfcl-off 200.0, 220.0; "
                    "sfcl-triggered 196.0, 231.0 (/sfcl-off: 0.980, 1.050)")


# -- process helpers ------------------------------------------------------------------------------

def test_server_process_ready_rss_and_stop(tmp_path):
    pytest.importorskip("psutil")
    port = peers.free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    with peers.ServerProcess("web", argv, port, tmp_path / "logs", ready_path="/") as srv:
        srv.wait_ready(30)
        with srv.monitor.window() as w:
            pass
        assert w.peak_rss > 1_000_000  # a Python interpreter is more than 1 MB resident
    assert srv.proc.poll() is not None


def test_server_process_that_exits_early_raises(tmp_path):
    pytest.importorskip("psutil")
    argv = [sys.executable, "-c", "import sys; print('bad flag', file=sys.stderr); sys.exit(3)"]
    srv = peers.ServerProcess("dies", argv, peers.free_port(), tmp_path)
    with pytest.raises(RuntimeError, match="exited with code 3"):
        srv.wait_ready(30)
    srv.stop()
    assert "bad flag" in (tmp_path / "dies.stderr.log").read_text()


def test_gguf_eos_ids_of_bundled_model():
    from sfcl.model.loader import ModelLoadError, resolve_model

    try:
        src = resolve_model(None)
    except ModelLoadError:
        pytest.skip("bundled model not installed")
    assert peers.gguf_eos_ids(str(src.path)) == [0, 2]  # SmolLM2: <|endoftext|>, <|im_end|>


# -- the CLI end to end, with a FakeEngine server as the only (peer) system ----------------------

def test_cli_bench_against_a_peer(serve, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from sfcl.cli import main

    url, _ = serve(FakeEngine(max_model_len=10**6))
    out = tmp_path / "out"
    rc = main(["bench", "--systems", "", "--peer-url", f"fake={url}", "--quick", "--out", str(out)])
    assert rc == 0
    doc = json.loads((out / "report.json").read_text())
    got = {(r["system"], r["workload"], r["concurrency"]): r for r in doc["summaries"]}
    assert set(got) == {("fake", "single", 1), ("fake", "concurrent", 4), ("fake", "longdoc-cold", 1),
                        ("fake", "longdoc-repeat", 1)}
    assert got[("fake", "concurrent", 4)]["requests"] == 8 and got[("fake", "concurrent", 4)]["errors"] == 0
    assert got[("fake", "single", 1)]["output_tokens"] == 3 * 16  # the reply has more than 16 words
    assert len(DEFAULT_REPLY.split()) > 16
    assert "| fake | concurrent | 4 |" in capsys.readouterr().out
    assert (out / "throughput_vs_concurrency.png").is_file() and (out / "report.md").is_file()


def test_cli_bench_temperature_reaches_every_request(serve, tmp_path):
    pytest.importorskip("matplotlib")
    from sfcl.cli import main

    url, eng = serve(FakeEngine(max_model_len=10**6))
    out = tmp_path / "out"
    assert main(["bench", "--systems", "", "--peer-url", f"fake={url}", "--quick", "--workloads", "single",
                 "--temperature", "0.7", "--out", str(out)]) == 0
    timed = [r for r in eng.requests if r.params.max_tokens == 16]  # not the probe's 1-token request
    assert timed and all(r.params.temperature == 0.7 and r.params.top_p == 1.0 for r in timed)
    assert "- every request sampled at temperature 0.7, top_p 1" in (out / "report.md").read_text()


@pytest.mark.parametrize("argv, msg", [(["--systems", "vllm"], "unknown system"),
                                       (["--temperature", "1.5"], "--temperature"),
                                       (["--workloads", "single,bogus"], "unknown workload"),
                                       (["--concurrency", "4,x"], "--concurrency"),
                                       (["--peer-url", "nourl"], "--peer-url")])
def test_cli_bench_bad_arguments_exit_2(argv, msg, capsys, tmp_path):
    from sfcl.cli import main

    assert main(["bench", *argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("sfcl: error:") and msg in err[0]


def test_bench_flags_map_one_to_one_onto_bench_config():
    """Every BenchConfig field is a flag with the record's default; --concurrency is None unless
    given (so --quick can tell "not given" from the default), and --quick shrinks only what it says."""
    from sfcl.bench.config import BenchConfig
    from sfcl.bench.run import quick_sized
    from sfcl.cli import build_parser
    from sfcl.cli.bench import bench_config

    parse = build_parser().parse_args
    assert bench_config(parse(["bench"])) == BenchConfig()
    cfg = bench_config(parse(["bench", "--concurrency", "2,3", "--peer-url", "a=http://x", "--peer-url", "http://y",
                              "--quick", "--max-tokens", "9", "--no-ignore-eos"]))
    assert cfg.concurrency == "2,3" and cfg.peer_url == ("a=http://x", "http://y") and cfg.no_ignore_eos
    q = quick_sized(cfg)
    assert (q.concurrency, q.max_tokens, q.requests_per_level, q.single_requests) == ("2,3", 9, 8, 3)
    assert quick_sized(bench_config(parse(["bench", "--quick"]))).concurrency == "4"
    assert quick_sized(bench_config(parse(["bench", "--concurrency", "1,4,8,16,32", "--quick"]))).concurrency \
        == "1,4,8,16,32"  # given explicitly: kept, even when it is the default
