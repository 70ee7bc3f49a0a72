"""CUDA tests (marked ``gpu``, skipped without CUDA; they never decide whether CI passes):
the model forward on CUDA matches the CPU, and CUDA-graph replay of the decode step matches eager.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_bench.py"


def _prefill(model, kv, slot, ids, device):
    from sfcl.model.llama import AttnBatch

    t = torch.tensor([ids], device=device)
    batch = AttnBatch(is_prefill=True, slots=torch.tensor([slot], device=device),
                      positions=torch.arange(len(ids), device=device), kv_len=len(ids))
    return model(t, batch, kv, tap_layer=-1, want_probs=False).logits[0]


def _decode(model, kv, ids, pos, device):
    from sfcl.model.cuda_graph import DecodeGraphs

    return DecodeGraphs(model, kv, enabled=False).step(torch.tensor(ids, device=device),
                                                        torch.tensor(pos, device=device), max(pos) + 1)


def test_forward_on_cuda_matches_cpu(cache_dir):
    """The bundled model in fp32: prefill and a batched decode step agree between CPU and CUDA."""
    from sfcl.engine.kv_cache import KVCache
    from sfcl.model.loader import load_model

    seqs = [[1, 504, 3457, 28, 253, 1823, 30], [1, 19, 2133, 314]]
    out = {}
    for dev in ("cpu", "cuda"):
        lm = load_model(None, dtype=torch.float32, device=dev, cache_dir=cache_dir)
        kv = KVCache(lm.args, n_slots=2, max_len=64, dtype=torch.float32, device=dev)
        for t in kv.k + kv.v:
            t.zero_()
        pre = [_prefill(lm.model, kv, i, s, dev).cpu() for i, s in enumerate(seqs)]
        dec = _decode(lm.model, kv, [42, 77], [len(s) for s in seqs], dev).cpu()
        out[dev] = (pre, dec)
    for a, b in zip(out["cpu"][0], out["cuda"][0]):
        torch.testing.assert_close(b, a, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(out["cuda"][1], out["cpu"][1], rtol=1e-3, atol=1e-3)
    assert out["cuda"][1].argmax(-1).tolist() == out["cpu"][1].argmax(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager(dtype):
    """Ten decode steps, batch 3 of different lengths, the same fed tokens: graph replay gives the
    eager logits (to rounding: the graph attends over a padded, masked bucket)."""
    from sfcl.engine.kv_cache import KVCache
    from sfcl.model.cuda_graph import DecodeGraphs

    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    gb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gb)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    a = gb.llama_args(dict(gb.TINY, n_layers=3, hidden_size=128, intermediate_size=256))
    model = gb.build_sfcl(a, dev, dtype)
    seqs = [[5, 9, 13, 2, 7], [4, 8, 1], [3, 3, 3, 3, 3, 3, 3, 3]]
    fed = torch.randint(0, a.vocab_size, (10, 3), device=dev)  # same tokens for both runs
    runs = {}
    for graphs in (False, True):
        kv = KVCache(a, n_slots=3, max_len=64, dtype=dtype, device="cuda")
        for t in kv.k + kv.v:
            t.zero_()
        for i, s in enumerate(seqs):
            _prefill(model, kv, i, s, dev)
        dg = DecodeGraphs(model, kv, enabled=graphs, bucket=16)
        pos = torch.tensor([len(s) for s in seqs], device=dev)
        steps = []
        for i in range(10):
            steps.append(dg.step(fed[i], pos + i, int(pos.max()) + i + 1).clone())
        runs[graphs] = steps
        if graphs:
            assert dg.captured == [(3, 16), (3, 32)]  # kv_len 9..18 crosses one 16-position bucket
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for e, g in zip(runs[False], runs[True]):
        torch.testing.assert_close(g, e, **tol)


def test_gpu_bench_tiny_on_cuda_uses_graphs(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_bench", SCRIPT)
    gb = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gb)
    out = tmp_path / "g.json"
    assert gb.main(["--tiny", "--device", "cuda", "--steps", "8", "--warmup", "2", "--context", "16",
                    "--copy-mib", "64", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert all(r["graph_ms"] and r["graph_ms"] > 0 and r["hf_ms"] > 0 for r in rows)
