"""sfcl.engine.fused_lookup and sfcl.snapshot.device_search on the CPU: the fused lookup (every row
searched "on the device", results in the step's one transfer) gives the same snapshots, steering
and tokens as the unfused path, with exactly one host transfer per step."""

from __future__ import annotations

import pytest
import torch

from sfcl.config import EngineConfig
from sfcl.engine.events import SnapshotEvent, TextDelta
from sfcl.engine.request import SamplingParams
from sfcl.engine_stack import make_llm_engine
from sfcl.library.index import AnchorIndex
from sfcl.snapshot.device_search import DeviceAnchorIndex
from sfcl.snapshot.steering import SteerConfig
from sfcl.snapshot.triggers import anchor_confidence_each


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_device_index_equals_anchor_index(nda_library, dtype):
    idx = AnchorIndex(nda_library, dtype=dtype)
    w, d = nda_library.weights.float(), nda_library.decay.float()
    di = DeviceAnchorIndex(idx, w, d, "cpu")
    g = torch.Generator().manual_seed(0)
    # queries near anchors (ties and near-ties matter) plus random ones, in bf16 like a tap
    q = torch.cat([nda_library.vectors[:20].float() + 0.05 * torch.randn(20, idx.dim, generator=g),
                   torch.randn(12, idx.dim, generator=g)]).to(torch.bfloat16)
    s, i, c = di.search(q, 3)
    for rows in (list(range(32)), [3, 17, 30]):  # the CPU path searches only the fired rows
        ws, wi = idx.search(q[rows].float(), k=3)
        assert torch.equal(i[rows], wi)
        if dtype == torch.float32:  # one GEMM over all rows vs over the fired ones: last-bit rounding
            torch.testing.assert_close(s[rows], ws, rtol=0, atol=1e-6)
        else:  # 16-bit search: scores are the per-row float32 re-score, bit for bit
            assert torch.equal(s[rows], ws) and torch.equal(c[rows], anchor_confidence_each(ws, w[wi], d[wi]))
    with pytest.raises(ValueError):
        di.search(q[:, :10], 3)


def chat(lm, text):
    t = lm.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return lm.tokenizer(t, add_special_tokens=False)["input_ids"]


CLAUSE = ("The Receiving Party shall hold the Confidential Information in strict confidence for a period of "
          "five (5) years from the Effective Date of 1 March 2021 and shall not disclose it to any third party "
          "other than its employees and advisers who need to know it. ")


def run(lm, lib, fused: bool):
    """Four concurrent requests (off, triggered, always, always + steering with context anchors);
    returns (per-step host-transfer counts, events by request id)."""
    eng = make_llm_engine(lm, lib, EngineConfig(max_num_seqs=4, prefix_cache_tokens=0, overlap_lookup=False))
    eng.runner.fused_lookup = fused
    eng.runner.snapshotter.steer = SteerConfig(lambda_max=1.0)
    calls = [0]
    orig = eng.runner._to_host

    def counted(t):
        calls[0] += 1
        return orig(t)

    eng.runner._to_host = counted
    reqs = [("off", False, "How long is the confidentiality period?"),
            ("triggered", False, "Who may receive the information and when did the agreement start?"),
            ("always", False, "Summarise the obligations in one sentence."),
            ("always", "knn", "For how many years must the information be kept confidential, and from when?")]
    events: dict[str, list] = {}
    for i, (mode, steer, q) in enumerate(reqs):
        rid = f"r{i}"
        p = SamplingParams(max_tokens=20, snapshot_mode=mode, steer=steer, ignore_eos=True,
                           temperature=1.0 if steer else 0.0, seed=3)  # sampled: the mixture changes tokens
        events[rid] = [e for _, e in eng.add_request(rid, chat(lm, CLAUSE + q), p)]
    per_step = []
    while eng.has_work():
        calls[0] = 0
        for rid, e in eng.step():
            events[rid].append(e)
        per_step.append((calls[0], eng.last_stats.generated, eng.last_stats.lookups))
    return per_step, events


def snap_view(e: SnapshotEvent):
    return (e.token_index, e.token, e.token_logprob, e.triggers, e.anchor_id, e.confidence, e.library_version,
            e.steer, [(t.anchor_id, t.score, t.kind) for t in e.top])


def test_fused_lookup_equals_unfused_with_one_transfer_per_step(lm, nda_library):
    steps_u, ev_u = run(lm, nda_library, fused=False)
    steps_f, ev_f = run(lm, nda_library, fused=True)
    assert len(steps_u) == len(steps_f)
    for rid in ev_u:
        su = [snap_view(e) for e in ev_u[rid] if isinstance(e, SnapshotEvent)]
        sf = [snap_view(e) for e in ev_f[rid] if isinstance(e, SnapshotEvent)]
        # exact in everything but the float scores: the fused path searches the device copy of the
        # library (fp32 on a CPU without native bf16), the unfused one the host copy, ~1e-6 apart
        def exact(v):
            steer = v[7] and {k: x for k, x in v[7].items() if k != "lambda"}
            return v[:5] + (v[6], steer, [(a, k) for a, _, k in v[8]])

        assert [exact(v) for v in su] == [exact(v) for v in sf]
        assert [v[5] for v in su] == pytest.approx([v[5] for v in sf], abs=1e-5)
        lam = [[v[7]["lambda"] for v in s if v[7]] for s in (su, sf)]
        assert lam[0] == pytest.approx(lam[1], abs=1e-5)
        assert [s for v in su for _, s, _ in v[8]] == pytest.approx([s for v in sf for _, s, _ in v[8]], abs=1e-5)
        text = ["".join(e.text for e in ev[rid] if isinstance(e, TextDelta)) for ev in (ev_u, ev_f)]
        assert text[0] == text[1]
    snaps = {rid: [e for e in ev_f[rid] if isinstance(e, SnapshotEvent)] for rid in ev_f}
    assert not snaps["r0"] and len(snaps["r2"]) == 20 and len(snaps["r3"]) == 20
    assert all(e.steer is not None for e in snaps["r3"]) and any(e.steer["changed"] for e in snaps["r3"])
    assert any(t.kind == "context" for e in snaps["r3"] for t in e.top)  # prompt anchors searched on the host
    assert all(e.lookup_ms > 0 for s in snaps.values() for e in s)
    # fused: one transfer in every step that sampled, lookups or not; unfused: two when a row looked up
    assert all(n == (1 if gen else 0) for n, gen, _ in steps_f)
    assert all(n == (2 if look else 1 if gen else 0) for n, gen, look in steps_u)
    assert any(look for _, _, look in steps_f)
