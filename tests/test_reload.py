"""Anchor library reload without a restart: POST /admin/anchors/reload and SIGHUP, on the real engine.

In-flight requests finish on the version they started with; new requests get the new one; the
old library object is released once its last request ends; a damaged library is refused.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import weakref

import httpx
import pytest
import torch
from conftest import REPO, free_port
from test_steering import crafted_library

from sfcl.config import EngineConfig, SnapshotConfig
from sfcl.engine.async_engine import AsyncEngine
from sfcl.engine_stack import make_llm_engine, make_reloader
from sfcl.library.versions import load_library
from sfcl.metrics import PrometheusStatLogger
from sfcl.server import create_app
from sfcl.server.testing import serve_in_thread
from sfcl.snapshot.snapshotter import library_version

KEY = "reload-key"


@pytest.fixture
def tiny_library(lm, nda_library, tmp_path):
    return crafted_library(lm, nda_library, tmp_path / "tiny-v2", torch.randn(lm.args.hidden_size), 42)


def sse_snapshots(lines):
    """Yield the data of each snapshot_triggered event of an Anthropic SSE stream."""
    for line in lines:
        if line.startswith("data:"):
            d = json.loads(line[5:])
            if d.get("type") == "snapshot_triggered":
                yield d


def test_reload_while_a_stream_runs(lm, nda_library, tiny_library, tmp_path):
    old = load_library(nda_library.path)  # our own instance: only the engine holds it
    old_version = library_version(old)
    ref = weakref.ref(old)
    eng = make_llm_engine(lm, old, EngineConfig(max_num_seqs=2))
    del old
    ae = AsyncEngine(eng, model_name=lm.name, max_model_len=eng.scheduler.cfg.max_model_len,
                     tokenizer=lm.tokenizer, metrics=PrometheusStatLogger(True),
                     reloader=make_reloader(lm, SnapshotConfig(anchors=str(nda_library.path))))
    new_version = library_version(load_library(tiny_library, verify_checksums=False))
    assert new_version != old_version
    h = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    body = {"model": "default", "max_tokens": 40, "snapshot_mode": "always", "stream": True,
            "messages": [{"role": "user", "content": "List three things an NDA protects."}]}
    try:
        with serve_in_thread(create_app(ae, api_key=KEY)) as url:
            assert httpx.get(url + "/health").json()["anchors"]["version"] == old_version
            r = httpx.post(url + "/admin/anchors/reload", json={"path": str(tiny_library)})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # key required
            before, after = [], []
            with httpx.stream("POST", url + "/v1/messages", json=body, headers=h, timeout=120) as s:
                it = sse_snapshots(s.iter_lines())
                before.append(next(it))
                r = httpx.post(url + "/admin/anchors/reload", json={"path": str(tiny_library)}, headers=h)
                assert r.status_code == 200, r.text
                info = r.json()["anchors"]
                assert info["version"] == new_version and info["previous_version"] == old_version
                assert info["n_anchors"] == 4
                after.extend(it)
            assert after, "the stream should still be running when the reload lands"
            assert {d["library_version"] for d in before + after} == {old_version}
            assert all(h["span"]["doc_id"] != "crafted" for d in before + after for h in d["top"])
            # a new request runs on the new library
            r = httpx.post(url + "/v1/messages", headers=h, timeout=120,
                           json={**body, "stream": False, "max_tokens": 3})
            evs = r.json()["sfcl"]["snapshot_events"]
            assert evs and {e["library_version"] for e in evs} == {new_version}
            assert all(0 <= e["anchor_id"] < 4 and e["top"][0]["span"]["doc_id"] == "crafted" for e in evs)
            health = httpx.get(url + "/health").json()
            assert health["anchors"]["version"] == new_version
            metrics = httpx.get(url + "/metrics", headers=h).text
            assert f'version="{new_version}"' in metrics and "sfcl_anchor_library_info" in metrics
            # the old library is released once its last request ended
            gc.collect()
            assert ref() is None
            # a damaged library is refused in the API's error format, and the current one stays
            bad = tmp_path / "damaged"
            shutil.copytree(tiny_library, bad)
            with open(bad / "anchors.safetensors", "r+b") as f:
                f.truncate(100)
            r = httpx.post(url + "/admin/anchors/reload", json={"path": str(bad)}, headers=h)
            assert r.status_code == 400 and r.json()["type"] == "error"
            assert "checksum" in r.json()["error"]["message"]
            r = httpx.post(url + "/admin/anchors/reload", json={"path": 3}, headers={"x-api-key": KEY})
            assert r.status_code == 400 and r.json()["error"]["param"] == "body"  # OpenAI format by default
            assert httpx.get(url + "/health").json()["anchors"]["version"] == new_version
    finally:
        ae.shutdown()


def test_reload_is_refused_by_an_engine_without_it(serve):
    url, _ = serve()
    r = httpx.post(url + "/admin/anchors/reload")
    assert r.status_code == 404 and "reload" in r.json()["error"]["message"]


@pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="no SIGHUP on this platform")
def test_sighup_reloads_the_configured_path(lm, nda_library, tiny_library, tmp_path, cache_dir):
    link = tmp_path / "current"
    link.symlink_to(nda_library.path)
    port = free_port()
    err = open(tmp_path / "stderr.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "sfcl.cli", "serve", "--anchors", str(link), "--port", str(port),
                             "--cache-dir", str(cache_dir), "--max-num-seqs", "2", "--threads", "1"],
                            cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=subprocess.DEVNULL,
                            stderr=err, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            try:
                h = httpx.get(url + "/health", timeout=1).json()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert h["anchors"]["version"] == library_version(nda_library)
        link.unlink()
        link.symlink_to(tiny_library)  # operators flip a "current" link, then send SIGHUP
        proc.send_signal(signal.SIGHUP)
        want = library_version(load_library(tiny_library, verify_checksums=False))
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", timeout=5).json()["anchors"]["version"] != want:
            assert proc.poll() is None and time.monotonic() < deadline, "SIGHUP did not reload"
            time.sleep(0.2)
        err.seek(0)
        assert "[ANCHOR] reloaded" in err.read()
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        err.close()


def test_reload_without_a_path_follows_the_root_current_pointer(lm, nda_library, tiny_library, tmp_path):
    root = tmp_path / "libs"
    root.mkdir()
    shutil.copytree(nda_library.path, root / "v0001")
    shutil.copytree(tiny_library, root / "v0002")
    (root / "CURRENT").write_text("v0001\n")
    reload = make_reloader(lm, SnapshotConfig(anchors=str(root)))
    lib, snap = reload(None)
    assert lib.path.name == "v0001" and snap.lib is lib and lib.n_anchors == nda_library.n_anchors
    (root / "CURRENT").write_text("v0002\n")  # a lifecycle command moved CURRENT
    lib, snap = reload(None)
    assert lib.path.name == "v0002" and lib.n_anchors == 4
    with pytest.raises(Exception, match="fingerprint|model"):
        other = tmp_path / "other"
        shutil.copytree(tiny_library, other)
        m = json.loads((other / "manifest.json").read_text())
        m["model_fingerprint"] = "0" * 12
        (other / "manifest.json").write_text(json.dumps(m))
        reload(str(other))
