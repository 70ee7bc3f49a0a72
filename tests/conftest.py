"""Shared fixtures: the real bundled model (loaded once per session) and real-NDA anchor libraries.

Converted weights and built libraries are cached under ``$SFCL_TEST_CACHE`` (default
``<repo>/.cache/test``) so a second run skips GGUF dequantisation and anchor builds.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sfcl.config import contractnli_path

REPO = Path(__file__).resolve().parents[1]
CONTRACTNLI = contractnli_path()  # $SFCL_DATA_DIR/contractnli/dev.json or ../shared/data/contractnli/dev.json
CACHE = Path(os.environ.get("SFCL_TEST_CACHE", REPO / ".cache" / "test"))

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def contractnli_docs(n: int | None = None):
    from sfcl.anchors.corpus import read_corpus

    if not CONTRACTNLI.is_file():
        pytest.skip(f"ContractNLI data not found at {CONTRACTNLI} (expected ../shared/data/contractnli/dev.json "
                    "or $SFCL_DATA_DIR/contractnli/dev.json)")
    docs = read_corpus([CONTRACTNLI])
    return docs[:n] if n else docs


def tiny_llama(n_heads: int = 4, max_positions: int = 512):
    """A 2-layer Llama (hidden 128, head size 64, 2 KV heads, vocabulary 200) with random weights of
    seed 0 (norms in [0.8, 1.2], the rest N(0, 0.3)), float32, eval mode: (LlamaArgs, LlamaModel)."""
    from sfcl.model.llama import LlamaArgs, LlamaModel

    a = LlamaArgs(model_type="llama", vocab_size=200, hidden_size=128, intermediate_size=256, n_layers=2,
                  n_heads=n_heads, n_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=max_positions,
                  tie_word_embeddings=False, attention_bias=False, qk_norm=False)
    torch.manual_seed(0)
    m = LlamaModel(a, 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64)))
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(0, 0.3) if "norm" not in name else p.uniform_(0.8, 1.2)
    return a, m.eval()


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    return CACHE


@pytest.fixture(scope="session")
def lm(cache_dir):
    from sfcl.model.loader import load_model

    return load_model(None, dtype="auto", cache_dir=cache_dir)  # bf16 only where the CPU runs it natively


@pytest.fixture(scope="session")
def lm_fp32(lm, cache_dir):
    """The bundled model in float32 whatever the CPU (``lm`` itself where ``auto`` picked float32).

    For tests that compare greedy answers or logits across compute paths or batch compositions
    exactly: on a CPU with native bf16, ``lm`` runs in bf16, where logits lie on a 1/8 grid and a
    prompt computed in one chunk or restored from the prefix cache, or a row batched with other
    rows, rounds differently, so near ties go either way (seen on an AMD EPYC with avx512_bf16).
    The anchor libraries of ``lm`` bind to it too (the fingerprint does not depend on the dtype)."""
    from sfcl.model.loader import load_model

    if next(lm.model.parameters()).dtype == torch.float32:
        return lm
    return load_model(None, dtype=torch.float32, cache_dir=cache_dir)


def _model_layout(lm) -> tuple:
    """What a test must not change in the shared ``lm``: which model object it holds, and per
    submodule its class, instance attribute names (a method overridden on the instance shows up
    here) and hook counts."""
    return (id(lm.model), tuple(
        (name, type(m), tuple(sorted(vars(m))), len(m._forward_hooks), len(m._forward_pre_hooks))
        for name, m in lm.model.named_modules()))


@pytest.fixture(autouse=True)
def _lm_left_as_found(request):
    """The session-scoped ``lm`` is shared by every test: a test that swaps a layer, overrides a
    method on the model instance or leaves a hook on it fails here, at teardown, instead of
    changing what later tests run (``copy.deepcopy(lm.model)`` copies such changes along).
    Copy the model (``copy.deepcopy``) or patch the class with ``monkeypatch`` instead."""
    if "lm" not in request.fixturenames:
        yield
        return
    lm = request.getfixturevalue("lm")
    before = _model_layout(lm)
    yield
    assert _model_layout(lm) == before, "this test changed the shared session model `lm` in place"


SHALLOW_LAYERS = 3


@pytest.fixture
def shallow_model(cache_dir):
    """shallow_model(dtype=torch.float32) -> a fresh ``LoadedModel``: the bundled model cut to its
    first ``SHALLOW_LAYERS`` decoder blocks (its real tokenizer, embedding, final norm and head).

    For the ``torch.compile`` tests: Inductor's compile time grows with the number of blocks it
    unrolls (all 30 took ~2.5-5 min per engine on 2 cores with a cold cache), while what those tests
    check (the compiled decode step gives the eager engine's tokens, graph buckets, no recompiles,
    one code object per model) runs the same ``LlamaModel`` code at any depth. Each call loads its
    own copy, so a test may quantize or perturb it."""
    import dataclasses

    from torch import nn

    from sfcl.model.loader import load_model

    def make(dtype: torch.dtype = torch.float32):
        full = load_model(None, dtype=dtype, cache_dir=cache_dir)
        args = dataclasses.replace(full.args, n_layers=SHALLOW_LAYERS)
        full.model.layers = nn.ModuleList(list(full.model.layers)[:SHALLOW_LAYERS])
        full.model.a = args
        return dataclasses.replace(full, args=args)

    return make


@pytest.fixture(scope="session")
def nda_library(lm, cache_dir):
    """Anchors built from the first 4 ContractNLI NDAs (k-means down to 2,048 anchors)."""
    from sfcl.anchors.builder import BuildConfig, build_library, library_cache_name
    from sfcl.anchors.corpus import corpus_hash
    from sfcl.library.versions import load_library

    docs = contractnli_docs(4)
    cfg = BuildConfig(n_anchors=2048, seed=0, window_tokens=1024)
    path = cache_dir / "anchors" / ("nda-" + library_cache_name(lm.fingerprint, corpus_hash(docs), 22, 2048))
    if not (path / "manifest.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        build_library(lm, docs, path, cfg, progress=False)
    return load_library(path, expect_fingerprint=lm.fingerprint)


@pytest.fixture
def serve():
    """serve(engine=None, **create_app_kwargs) -> (base_url, engine): the HTTP app over a
    FakeEngine in a real uvicorn thread (keepalive every 0.1 s); servers stop at teardown."""
    import contextlib

    from sfcl.server import create_app
    from sfcl.server.testing import FakeEngine, serve_in_thread

    stack = contextlib.ExitStack()

    def _serve(engine: FakeEngine | None = None, **kwargs):
        engine = engine or FakeEngine()
        kwargs.setdefault("ping_interval_s", 0.1)
        return stack.enter_context(serve_in_thread(create_app(engine, **kwargs))), engine

    with stack:
        yield _serve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(nda_library, cache_dir, tmp_path_factory):
    """`sfcl serve` as a subprocess on the real model with the NDA anchors; yields (url, process)."""
    import httpx

    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # Logs go to files: an unread pipe fills up after a few hundred JSON request lines and then
    # blocks the server's event loop on its next log write.
    logs = tmp_path_factory.mktemp("server-logs")
    out, err = open(logs / "stdout.jsonl", "w"), open(logs / "stderr.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "sfcl.cli", "serve", "--anchors", str(nda_library.path), "--port", str(port),
         "--cache-dir", str(cache_dir), "--max-num-seqs", "4", "--threads", "2"],
        cwd=REPO, env=env, stdout=out, stderr=err, text=True)
    url = f"http://127.0.0.1:{port}"
    # A first start may compile SFCL's kernels (~1 min on 2 idle cores, ~3 min beside other jobs:
    # this fixture once timed out at 180 s with a load average of 5-7)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err.seek(0)
            raise RuntimeError("server exited early:\n" + err.read())
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError("server did not become healthy")
    yield url, proc
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
    out.close()
    err.close()


