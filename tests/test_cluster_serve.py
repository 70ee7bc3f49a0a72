"""sfcl.cluster end to end on a local Ray cluster (``ray.init(num_cpus=4)``, one per module): two
engine replicas at 0.5 CPU each (the bundled model in fp32, the NDA anchors) behind one Ray Serve
endpoint. The official SDKs stream through it; its raw SSE equals the single server's; prefix
affinity against Serve's power of two choices; a client disconnect frees the replica's slot; a
replica killed mid-run is survived and replaced. Replica counters are read from the cluster's own
``/health`` (each replica reports every ``REPORT_S`` seconds)."""

from __future__ import annotations

import json
import math
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest
import torch
from conftest import contractnli_docs, free_port

serve = pytest.importorskip("ray.serve", reason="needs the ray extra (pip install 'sfcl[ray]')")
import ray  # noqa: E402

from sfcl.cluster.app import build_app  # noqa: E402
from sfcl.cluster.config import ClusterConfig  # noqa: E402
from sfcl.cluster.ingress import REPLICA_LOST  # noqa: E402
from sfcl.config import EngineConfig, ModelConfig, SnapshotConfig  # noqa: E402
from sfcl.engine.async_engine import encode_chat  # noqa: E402
from sfcl.server.testing import parse_sse  # noqa: E402

pytestmark = pytest.mark.slow
REPORT_S = 0.25
QUESTIONS = ("Who are the parties?", "How long does the agreement last?", "Which law governs it?",
             "Can the recipient share the information with employees?", "What happens when it ends?")


@dataclass
class Cluster:
    url: str
    mcfg: ModelConfig
    ecfg: EngineConfig
    scfg: SnapshotConfig


@pytest.fixture(scope="module")
def fp32_lm(lm, cache_dir):
    """The model as the replicas run it (fp32: greedy outputs are then exact across batch shapes and
    prefix-cache hits, see test_engine), in this process for the single-server reference."""
    from sfcl.model.loader import load_model

    if next(lm.model.parameters()).dtype == torch.float32:
        return lm
    return load_model(None, dtype=torch.float32, cache_dir=cache_dir)


@pytest.fixture(scope="module")
def cluster(nda_library, cache_dir, fp32_lm):
    port = free_port()
    start_ray()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"log_level": "WARNING", "enable_access_log": False})
        c = Cluster(f"http://127.0.0.1:{port}", ModelConfig(dtype="float32", threads=1, weight_quant="none"),
                    EngineConfig(max_num_seqs=4, max_model_len=2048),
                    SnapshotConfig(anchors=str(nda_library.path), cache_dir=cache_dir))
        serve.run(build_app(c.mcfg, c.ecfg, c.scfg, ClusterConfig(replicas=2, replica_cpus=0.5,
                                                                 report_interval_s=REPORT_S)),
                  name="sfcl", route_prefix="/", blocking=False)
        fresh_health(c.url, time.time(), n_replicas=2)
        yield c
    finally:
        serve.shutdown()
        ray.shutdown()


def start_ray(attempts: int = 3) -> None:
    """``ray.init(num_cpus=4)``; retried when the raylet misses Ray's fixed 30 s start-up window,
    which happens on an overloaded machine (the shared 2-core development box)."""
    for attempt in range(attempts):
        try:
            ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
            return
        except Exception as e:
            ray.shutdown()
            if "timed out during startup" not in str(e) or attempt == attempts - 1:
                raise


def fresh_health(url: str, since: float, n_replicas: int | None = None, timeout_s: float = 120.0,
                 until=lambda h: True) -> dict:
    """/health once every replica has reported after ``since`` (wall clock) and ``until(h)`` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = httpx.get(url + "/health", timeout=30)
        if r.status_code == 200:
            h = r.json()
            if all(rep["reported_at"] > since for rep in h["replicas"]) and until(h) and (
                    n_replicas is None or h["n_replicas"] == n_replicas):
                return h
        if time.monotonic() > deadline:
            raise AssertionError(f"/health did not reach the expected state: {r.status_code} {r.text[:2000]}")
        time.sleep(REPORT_S)


def by_replica(h: dict) -> dict[str, dict]:
    return {rep["replica"]: rep for rep in h["replicas"]}


@dataclass
class Streamed:
    frames: list[dict] = field(default_factory=list)

    @property
    def events(self) -> list[str]:
        return [f["event"] for f in self.frames if f["event"] != "ping"]

    @property
    def text(self) -> str:
        return "".join(json.loads(f["data"])["delta"]["text"] for f in self.frames
                       if f["event"] == "content_block_delta")

    @property
    def output_tokens(self) -> int | None:
        deltas = [json.loads(f["data"]) for f in self.frames if f["event"] == "message_delta"]
        return deltas[-1]["usage"]["output_tokens"] if deltas else None


def stream_message(url: str, content: str, max_tokens: int, mode: str = "off", timeout_s: float = 300) -> Streamed:
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "snapshot_mode": mode, "messages": [{"role": "user", "content": content}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=timeout_s) as r:
        assert r.status_code == 200, r.read()
        return Streamed(parse_sse("".join(r.iter_text())))


def nda_excerpt(i: int, chars: int = 1200) -> str:
    text = contractnli_docs(12)[i].text
    return text[:text.rfind(" ", 0, chars)]


def test_official_sdks_stream_through_the_cluster(cluster):
    anthropic = pytest.importorskip("anthropic")
    openai = pytest.importorskip("openai")
    question = nda_excerpt(5, 600) + "\n\nWho are the parties?"
    client = anthropic.Anthropic(base_url=cluster.url, api_key="unused")
    with client.messages.stream(model="smollm2-135m-instruct", max_tokens=16, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": question}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() and final.usage.input_tokens > 100 and 0 < final.usage.output_tokens <= 16
    oa = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused")
    chunks = list(oa.chat.completions.create(
        model="smollm2-135m-instruct", max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True}, messages=[{"role": "user", "content": question}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text  # greedy, same model
    assert chunks[-1].usage.completion_tokens == final.usage.output_tokens
    models = oa.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m-instruct"]


def test_raw_sse_equals_the_single_servers_snapshot_events_included(cluster, fp32_lm, nda_library):
    """The same greedy request on a single in-process server (same model, anchors, engine settings)
    gives the same frames: snapshot_triggered events with their ids, anchors and confidences, text,
    usage. Only timings (lookup_ms), the message id and keepalive pings may differ."""
    from sfcl.engine.async_engine import AsyncEngine
    from sfcl.engine_stack import make_llm_engine
    from sfcl.metrics import PrometheusStatLogger
    from sfcl.server import create_app
    from sfcl.server.testing import serve_in_thread

    question = nda_excerpt(6, 1500) + "\n\nHow long do the confidentiality obligations last?"
    got = stream_message(cluster.url, question, 40, mode="triggered")
    engine = AsyncEngine(make_llm_engine(fp32_lm, nda_library, cluster.ecfg, cluster.scfg, decode_threads=1),
                         model_name=fp32_lm.name, max_model_len=2048, tokenizer=fp32_lm.tokenizer,
                         metrics=PrometheusStatLogger(True), num_threads=1)
    try:
        with serve_in_thread(create_app(engine)) as url:
            want = stream_message(url, question, 40, mode="triggered")
    finally:
        engine.shutdown()

    def normal(s: Streamed) -> list[tuple]:
        out = []
        for f in s.frames:
            if f["event"] == "ping":
                continue
            data = json.loads(f["data"])
            data.pop("lookup_ms", None)
            if f["event"] == "message_start":
                data["message"]["id"] = "msg"
            out.append((f["event"], f["id"], data))
        return out

    assert "snapshot_triggered" in got.events
    assert [f for f in got.frames if f["event"] == "snapshot_triggered"][0]["id"] == "0"
    assert len(normal(got)) == len(normal(want))
    for g, w in zip(normal(got), normal(want)):
        assert same_up_to_rounding(g, w), (g, w)


def same_up_to_rounding(a, b) -> bool:
    """Equal, except floats within 1e-5 relative. Why: on AVX2 code paths (float32 GEMMs) the
    replica, which has served earlier requests, and a fresh in-process server gave the same tokens,
    anchors and triggers with logprobs and scores differing in the last bits (-0.97259480 vs
    -0.97259516), consistently; a different summation order (other GEMM shapes, e.g. after prefix-
    cache restores) is the likely cause, not pinned down."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_up_to_rounding(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_up_to_rounding(x, y) for x, y in zip(a, b))
    return a == b


def affinity_run(url: str, tokenizer) -> tuple[float, list[dict]]:
    """4 NDA excerpts x 5 questions, interleaved (q0 of every document, then q1 ...), one at a time.
    Returns the share of repeat questions (q1..q4) served by the replica that prefilled their
    document AND restoring its cached blocks there (prefix-cache hit counter), and the records."""
    docs = [nda_excerpt(i) for i in (8, 9, 10, 11)]
    prefiller: dict[int, tuple[str, list[int]]] = {}
    records = []
    before = by_replica(fresh_health(url, time.time(), n_replicas=2))
    for q, question in enumerate(QUESTIONS):
        for d, doc in enumerate(docs):
            content = f"{doc}\n\nQuestion: {question} Answer briefly."
            r = httpx.post(url + "/v1/messages", timeout=300, json={
                "model": "default", "max_tokens": 2, "temperature": 0, "snapshot_mode": "off",
                "messages": [{"role": "user", "content": content}]})
            assert r.status_code == 200, r.text
            after = by_replica(fresh_health(url, time.time(), n_replicas=2))
            delta = {k: {m: after[k]["prefix_cache"][m] - before[k]["prefix_cache"][m] for m in ("queries", "hits")}
                     for k in after}
            [served] = [k for k, v in delta.items() if v["queries"] > 0]
            ids = encode_chat(tokenizer, [{"role": "user", "content": content}])
            if q == 0:
                prefiller[d] = (served, ids)
            else:
                first, first_ids = prefiller[d]
                shared = next(i for i, (a, b) in enumerate(zip(first_ids, ids)) if a != b)
                restorable = 16 * min(shared // 16, (len(first_ids) - 1) // 16)
                records.append({"doc": d, "q": q, "served": served, "prefiller": first,
                                "hit_tokens": delta[served]["hits"], "restorable": restorable,
                                "ok": served == first and delta[served]["hits"] >= 0.9 * restorable > 0})
            before = after
    return sum(r["ok"] for r in records) / len(records), records


def test_prefix_affinity_sends_repeat_questions_to_the_replica_holding_the_document(cluster, fp32_lm):
    rate, records = affinity_run(cluster.url, fp32_lm.tokenizer)
    pow2 = ClusterConfig(replicas=2, replica_cpus=0.5, router="pow2", report_interval_s=REPORT_S)
    serve.run(build_app(cluster.mcfg, cluster.ecfg, cluster.scfg, pow2), name="sfcl-pow2",
              route_prefix="/pow2", blocking=False)
    try:
        base_rate, base_records = affinity_run(cluster.url + "/pow2", fp32_lm.tokenizer)
    finally:
        serve.delete("sfcl-pow2")
    print(f"\nrepeat questions on their document's prefiller with a cache hit: affinity {rate:.0%} "
          f"({sum(r['ok'] for r in records)}/{len(records)}), power of two {base_rate:.0%} "
          f"({sum(r['ok'] for r in base_records)}/{len(base_records)})")
    assert rate >= 0.9, records
    assert base_rate < rate, base_records


def test_client_disconnect_frees_the_slot_in_its_replica(cluster):
    url = cluster.url
    tokens_before = generated_tokens(url)
    body = {"model": "default", "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True,
            "snapshot_mode": "off", "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}]}
    with httpx.stream("POST", url + "/v1/messages", json=body, timeout=120) as r:
        deltas = 0
        lines = r.iter_lines()  # held: a dropped iterator is closed at once, and with it the connection
        for line in lines:
            deltas += line == "event: content_block_delta"
            if deltas >= 3:
                break
        running = fresh_health(url, time.time(), until=lambda h: h["running"] == 1)
        assert sorted(rep["running"] for rep in running["replicas"]) == [0, 1]
    # the connection is closed: the replica aborts the request long before its 400 tokens
    fresh_health(url, time.time(), timeout_s=60, until=lambda h: all(
        rep["running"] == 0 and rep["waiting"] == 0 for rep in h["replicas"]))
    assert generated_tokens(url) - tokens_before < 400


def generated_tokens(url: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    fresh_health(url, time.time())
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "sfcl_generation_tokens_total")


def test_cluster_metrics_per_replica_on_the_endpoint_and_the_metrics_port_collector(cluster):
    """/metrics of the cluster and `--metrics-port`'s collector: every replica's series, label replica."""
    from prometheus_client.parser import text_string_to_metric_families

    from sfcl.cluster.launch import HubCollector

    replicas = set(by_replica(fresh_health(cluster.url, time.time(), n_replicas=2)))
    text = httpx.get(cluster.url + "/metrics", timeout=30).text
    labelled = {s.labels.get("replica") for fam in text_string_to_metric_families(text) for s in fam.samples
                if s.name == "sfcl_engine_steps_total"}
    assert labelled == replicas
    families = HubCollector(serve.get_deployment_handle("ReportHub", app_name="sfcl")).collect()
    steps = next(f for f in families if f.name == "sfcl_engine_steps")
    assert {s.labels["replica"] for s in steps.samples if s.name == "sfcl_engine_steps_total"} == replicas


def test_killing_a_replica_mid_run(cluster):
    url = cluster.url
    prompts = [f"Ref kill-{i}. Describe a {w} in two sentences." for i, w in enumerate(("river", "forest"))]
    completed = [stream_message(url, p, 12) for p in prompts]
    for s in completed:
        assert s.events[-1] == "message_stop" and s.output_tokens == 12 and s.text

    results: dict[int, Streamed | BaseException] = {}

    def long_stream(i: int) -> None:
        try:
            results[i] = stream_message(url, f"Ref long-{i}. Tell a long story about ship number {i}.", 200)
        except BaseException as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=long_stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    h = fresh_health(url, time.time(), n_replicas=2, until=lambda h: h["running"] == 4)
    victim = max(h["replicas"], key=lambda rep: rep["running"])
    ray.kill(ray.get_actor(victim["actor_name"], namespace="serve"), no_restart=True)

    def n_cut() -> int:
        return sum(isinstance(r, Streamed) and r.events[-1] == "error" for r in list(results.values()))

    deadline = time.monotonic() + 120
    while n_cut() < victim["running"]:  # its streams end with an error event, not a hang
        assert time.monotonic() < deadline, f"streams on the killed replica did not end: {results}"
        time.sleep(0.2)
    after = [stream_message(url, f"Ref after-{i}. Name a colour.", 6) for i in range(3)]  # served by the other
    assert all(s.events[-1] == "message_stop" and s.output_tokens == 6 for s in after)
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert not [r for r in results.values() if isinstance(r, BaseException)], results
    cut = [s for s in results.values() if s.events[-1] == "error"]
    whole = [s for s in results.values() if s.events[-1] == "message_stop"]
    assert len(cut) == victim["running"] and len(cut) + len(whole) == 4
    for s in cut:
        assert json.loads(s.frames[-1]["data"])["error"] == {"type": "api_error", "message": REPLICA_LOST}
    assert all(s.output_tokens == 200 for s in whole)

    replaced = fresh_health(url, time.time(), n_replicas=2, timeout_s=900,
                            until=lambda h: victim["replica"] not in by_replica(h))
    assert len(by_replica(replaced)) == 2
    # the requests that completed before the kill lost nothing: same greedy text again, token for token
    assert [stream_message(url, p, 12).text for p in prompts] == [s.text for s in completed]
