"""Lookback-ratio trigger (sfcl.snapshot.lookback): the ratio, the model as a dot product, training,
and the features the runner records on the real model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sfcl.snapshot.lookback import (RATIO_ONLY, WITH_TOKEN, LookbackModel, feature_names, features, lookback_ratios,
                                     train)
from sfcl.snapshot.triggers import RECORD_FEATURES_AT


def test_ratio_compares_mean_weight_on_prompt_and_on_answer():
    # 4 prompt positions, 2 answer tokens attended, 2 padding positions (weight 0)
    p = torch.tensor([[[0.4, 0.2, 0.1, 0.1, 0.1, 0.1, 0.0, 0.0],   # prompt mean 0.2, answer mean 0.1 -> 2/3
                       [0.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.0, 0.0]]])  # all on the answer -> 0
    lr = lookback_ratios(p, torch.tensor([6]), torch.tensor([4]))
    assert lr[0].tolist() == pytest.approx([2 / 3, 0.0], abs=1e-6)
    first = lookback_ratios(torch.full((1, 2, 4), 0.25), torch.tensor([4]), torch.tensor([4]))  # no answer yet
    assert first[0].tolist() == pytest.approx([1.0, 1.0])


def test_model_scores_as_a_dot_product_and_round_trips():
    m = LookbackModel(("a", "b"), (1.0, 0.0), (2.0, 1.0), (0.5, -1.0), 0.25, {"n_tokens": 3})
    x = torch.tensor([[3.0, 1.0], [1.0, 0.0]])
    expect = torch.sigmoid(((x - torch.tensor([1.0, 0.0])) / torch.tensor([2.0, 1.0])) @ torch.tensor([0.5, -1.0]) + 0.25)
    assert torch.allclose(m.score(x), expect)
    assert LookbackModel.from_dict(m.to_dict()) == m
    with pytest.raises(ValueError, match="lookback"):
        LookbackModel.from_dict({**m.to_dict(), "scale": [1.0, 0.0]})
    with pytest.raises(ValueError, match="lookback"):
        LookbackModel.from_dict({"features": ["a"]})
    with pytest.raises(ValueError, match="9-head"):
        m.check(9)


def test_training_finds_the_signal_and_matches_sklearn():
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    n, nh = 3000, 3
    names = feature_names(nh)
    x = rng.normal(0.5, 0.2, (n, len(names)))
    y = (rng.random(n) < 1 / (1 + np.exp(-(-3 + 6 * (0.5 - x[:, 0]))))).astype(int)  # low ratio on head 0 = risk
    groups = np.repeat(np.arange(30), n // 30)
    m = train(x, y, groups, names, RATIO_ONLY)
    assert m.training["cv_auroc_by_document"] > 0.7 and m.coef[0] < 0
    assert all(c == 0 for c, f in zip(m.coef, names) if not f.startswith("lookback"))  # ratios only
    # the stored model scores like the fitted scikit-learn model
    z = (x - x.mean(0)) / x.std(0)
    ref = LogisticRegression(class_weight="balanced", max_iter=2000).fit(z[:, :2 * nh], y)
    p = m.score(torch.tensor(x, dtype=torch.float32)).numpy()
    assert np.allclose(p, ref.predict_proba(z[:, :2 * nh])[:, 1], atol=1e-4)
    full = train(x, y, groups, names, WITH_TOKEN)
    assert full.training["subset"] == WITH_TOKEN and len(full.coef) == len(names)
    with pytest.raises(ValueError, match="positive"):
        train(x, np.zeros(n, int), groups, names)


def test_features_layout():
    f = features(torch.rand(2, 3), torch.rand(2, 3), torch.tensor([True, False]), torch.tensor([0.5, 2.0]))
    assert f.shape == (2, len(feature_names(3))) and f[:, 6].tolist() == [1.0, 0.0] and f[:, 7].tolist() == [0.5, 2.0]


def test_runner_records_lookback_features_and_fires_the_trigger(lm, nda_library):
    """On the real model: every generated token carries 2 nh + 2 lookback features, the first
    token's ratios are 1 (nothing generated to look at), and a library whose lookback model always
    says "risk" makes the fourth trigger fire (and be named in the events)."""
    import dataclasses

    from sfcl.config import EngineConfig
    from sfcl.engine.engine import run_to_completion
    from sfcl.engine.events import SnapshotEvent
    from sfcl.engine.request import SamplingParams
    from sfcl.engine_stack import make_llm_engine
    from sfcl.snapshot.snapshotter import Snapshotter

    nh = lm.args.n_heads
    eng = make_llm_engine(lm, nda_library, EngineConfig(max_num_seqs=2, max_model_len=256))
    eng.runner.record_signals = True
    seen = []
    inner = eng.runner.execute

    def spy(plan):
        out = inner(plan)
        seen.extend(r.record for r in out.results.values())
        return out
    eng.runner.execute = spy
    ids = lm.tokenizer("The term is five years. How long is the term?")["input_ids"]
    run_to_completion(eng, [(ids, SamplingParams(max_tokens=6, snapshot_mode="off", ignore_eos=True))])
    f = RECORD_FEATURES_AT
    assert len(seen) == 6 and all(len(r) == f + 2 * nh + 2 for r in seen)
    assert seen[0][f:f + nh] == pytest.approx([1.0] * nh)
    assert all(0.0 <= v <= 1.0 for r in seen for v in r[f:f + 2 * nh])
    risky = LookbackModel(tuple(feature_names(nh)), (0.0,) * (2 * nh + 2), (1.0,) * (2 * nh + 2), (0.0,) * (2 * nh + 2), 9.0)
    lib = dataclasses.replace(nda_library, manifest={**nda_library.manifest, "calibration": {
        **nda_library.calibration, "lookback": risky.to_dict()}})
    eng.runner.snapshotter = Snapshotter(lib, eng.runner.snapshotter.class_table, n_heads=nh)
    ev = run_to_completion(eng, [(ids, SamplingParams(max_tokens=4, snapshot_mode="triggered", ignore_eos=True))])[0]
    snaps = [e for e in ev if isinstance(e, SnapshotEvent)]
    assert len(snaps) == 4 and all("lookback_ratio" in e.triggers for e in snaps)
