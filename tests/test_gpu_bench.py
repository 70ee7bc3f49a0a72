"""scripts/gpu_bench.py on the CPU with --tiny (smoke: it runs end to end and writes its JSON), and
the static-buffer decode (sfcl.engine.graph_runner.DecodeGraphRunner without capture) against the
model's own prefill. The CUDA-graph path itself is tested in tests/gpu/test_cuda.py (skipped
without CUDA). No timing assertions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from sfcl.engine.graph_runner import DecodeGraphRunner
from sfcl.model.kv_cache import KVCache
from sfcl.model.llama import AttnBatch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_bench.py"


@pytest.fixture(scope="module")
def gb():
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tiny_cpu_run_writes_json(gb, tmp_path, capsys):
    out = tmp_path / "g.json"
    rc = gb.main(["--tiny", "--device", "cpu", "--batch", "1,2", "--steps", "3", "--warmup", "1",
                  "--context", "4", "--copy-mib", "8", "--anchors", "64", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["shape"] == "tiny" and [r["batch"] for r in doc["rows"]] == [1, 2]
    for r in doc["rows"]:
        assert r["eager_ms"] > 0 and r["graph_ms"] is None and r["hf_ms"] > 0 and r["floor_ms"] > 0
        assert r["hf_over_best"] == pytest.approx(r["hf_ms"] / r["eager_ms"])
        assert r["engine_eager_ms"] > 0 and r["engine_graph_ms"] is None and r["engine_always_ms"] > 0
        assert r["engine_always_lookups_per_step"] == r["batch"]  # always mode: every row looked up
    assert doc["copy_bandwidth_bytes_per_s"] > 0 and doc["weight_bytes_read"] > 0
    assert [t["mark"] for t in doc["targets"]] == ["n/a"] * 4  # not an 8B run on a GPU
    assert "| 1 |" in capsys.readouterr().out


def test_bad_arguments_exit_2(gb, tmp_path):
    assert gb.main(["--tiny", "--batch", "0", "--out", str(tmp_path / "x.json")]) == 2


def test_weight_bytes_exclude_the_embedding_table(gb):
    a = gb.llama_args(gb.TINY)
    m = gb.build_sfcl(a, torch.device("cpu"), torch.bfloat16)
    total = sum(p.numel() * 2 for p in m.parameters())
    assert gb.weight_bytes_read(m) == total - a.vocab_size * a.hidden_size * 2
    assert m.lm_head.weight.dtype == torch.bfloat16 and m.inv_freq.dtype == torch.float32


def prefill(model, kv, slot: int, ids: list[int]) -> torch.Tensor:
    t = torch.tensor([ids])
    batch = AttnBatch(is_prefill=True, slots=torch.tensor([slot]), positions=torch.arange(len(ids)), kv_len=len(ids))
    return model(t, batch, kv, tap_layer=-1, want_probs=False).logits[0]  # (V,)


def test_decode_step_matches_prefill_of_the_longer_sequence(gb):
    """Two sequences of different lengths decoded in one batch: each row's logits equal those of a
    prefill of that sequence plus the new token (mask, positions and slots are built right)."""
    torch.manual_seed(0)
    a = gb.llama_args(gb.TINY)
    model = gb.build_sfcl(a, torch.device("cpu"), torch.float32)
    seqs = [[5, 9, 13, 2, 7], [4, 8, 1]]
    nxt = [11, 6]
    kv = KVCache(a, n_slots=2, max_len=16, dtype=torch.float32)
    for t in kv.k + kv.v:
        t.zero_()
    for i, s in enumerate(seqs):
        prefill(model, kv, i, s)
    dg = DecodeGraphRunner(model, kv, 1, capture=True)  # CPU: the static path, never a capture
    assert not dg.capture
    got = dg.run(nxt, [len(s) for s in seqs]).logits
    ref_kv = KVCache(a, n_slots=1, max_len=16, dtype=torch.float32)
    for i, s in enumerate(seqs):
        want = prefill(model, ref_kv, 0, s + [nxt[i]])
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
    again = dg.run(torch.tensor(nxt), [len(s) for s in seqs]).logits  # tokens as a device tensor
    torch.testing.assert_close(again, got, rtol=1e-4, atol=1e-4)  # the step rewrote the same positions
    with pytest.raises(ValueError):
        dg.run([1, 2, 3], [1, 1, 1])  # 3 rows, 2 slots
    with pytest.raises(ValueError):
        dg.run([1], [20])  # past max_len
