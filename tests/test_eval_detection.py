"""Detection metrics (sfcl.eval.detection): recall, precision, the random control and AUROC, from
the runner's trigger signals through serving's fire rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sfcl.eval.detection import AnswerSignals, detection
from sfcl.eval.labels import AnswerLabels, EntityTokens
from sfcl.snapshot.triggers import TRIGGER_NAMES, TriggerConfig

NEG = float("-inf")


def answer(doc, entity_tokens, supported, fired_tokens, n=10):
    """n tokens; one entity over entity_tokens; the entity trigger's signal -p fires (p = 0.1) on
    fired_tokens and stays quiet (p = 0.99) elsewhere inside entities."""
    sig = np.full((n, len(TRIGGER_NAMES)), NEG)
    sig[:, 2] = 0.0  # |surprisal z| = 0: never fires
    for k in entity_tokens:
        sig[k, 0] = -0.99
    for k in fired_tokens:
        sig[k, 0] = -0.1
    unsup = [(k in entity_tokens) and not supported for k in range(n)]
    lab = AnswerLabels("", unsup, [k in entity_tokens for k in range(n)],
                       [EntityTokens("number", "x", supported, list(entity_tokens))])
    return AnswerSignals(doc, sig, lab)


def test_recall_precision_random_control_and_auroc():
    answers = [answer("a", [2, 3], False, [3]),  # caught
               answer("a", [5], False, []),  # missed
               answer("b", [1, 2], True, [1]),  # a fire on a supported entity: a false alarm
               answer("b", [7, 8], False, [7])]  # caught
    d = detection(answers, TriggerConfig(), reps=200, seed=0)
    ent = d["per_trigger"]["entity_low_confidence"]
    assert ent["recall"]["value"] == pytest.approx(2 / 3) and ent["caught_entities"] == 2
    assert ent["precision"]["value"] == pytest.approx(2 / 3) and ent["fired_tokens"] == 3
    assert ent["fire_rate"]["value"] == pytest.approx(3 / 40)
    assert d["per_trigger"]["union"]["recall"]["value"] == pytest.approx(2 / 3)
    assert d["per_trigger"]["surprisal_deviation"]["fired_tokens"] == 0
    rc = d["random_control"]
    r = 3 / 40
    assert rc["rate"] == pytest.approx(r)
    assert rc["recall"]["value"] == pytest.approx(((1 - (1 - r) ** 2) * 2 + r) / 3)  # 2 two-token entities, one single
    assert rc["precision"]["value"] == pytest.approx(5 / 40)  # the share of unsupported-entity tokens
    a = d["auroc"]["entity_low_confidence"]["value"]
    # positives: 5 tokens (2 fired at -0.1, 3 quiet at -0.99); negatives: 35 (1 at -0.1, 1 at -0.99, 33 at -inf)
    pos = [-0.1, -0.1, -0.99, -0.99, -0.99]
    negs = [-0.1, -0.99] + [-math.inf] * 33
    expect = np.mean([1.0 if p > q else 0.5 if p == q else 0.0 for p in pos for q in negs])
    assert a == pytest.approx(expect)
    assert d["auroc"]["entity_low_confidence"]["ci_lo"] <= a <= d["auroc"]["entity_low_confidence"]["ci_hi"]
    assert d["n_unsupported_entities"] == 3 and d["n_documents"] == 2
