"""Trigger functions and entity-token detection."""

import math

import pytest
import torch

from sfcl.snapshot import entity
from sfcl.snapshot.triggers import (Calibration, TriggerConfig, anchor_confidence, attention_dispersion,
                                    dispersion_trigger, entity_low_confidence, surprisal_trigger, token_entropy)

CAL = Calibration(surprisal_mean=2.5, surprisal_std=2.0, dispersion_mean=0.3, dispersion_std=0.1)


def test_entity_low_confidence_needs_both_conditions():
    p = torch.tensor([0.5, 0.5, 0.9, 0.849])
    inside = torch.tensor([True, False, True, True])
    assert entity_low_confidence(p, inside).tolist() == [True, False, False, True]
    assert entity_low_confidence(p, inside, threshold=0.4).tolist() == [False, False, False, False]


def test_surprisal_trigger_is_two_sided_z_score():
    s = torch.tensor([2.5, 6.4, 6.6, 0.0, -1.6])  # z = 0, 1.95, 2.05, -1.25, -2.05
    assert surprisal_trigger(s, CAL).tolist() == [False, False, True, False, True]
    assert surprisal_trigger(s, CAL, z=1.0).tolist() == [False, True, True, True, True]


def test_dispersion_trigger_one_sided():
    d3 = torch.tensor([0.3, 0.41, 0.43, 0.0])  # z = 0, 1.1, 1.3, -3
    assert dispersion_trigger(d3, CAL).tolist() == [False, False, True, False]


def test_attention_dispersion_bounds():
    S = 8
    focused = torch.zeros(1, 2, S)
    focused[..., 0] = 1.0
    uniform = torch.full((1, 2, S), 1.0 / S)
    half = torch.zeros(1, 2, S)
    half[..., :4] = 0.25  # attends 4 of 8 valid positions: log 4 / log 8 = 2/3
    d = attention_dispersion(torch.cat([focused, uniform, half]), torch.tensor([S, S, S]))
    assert d[0].item() == pytest.approx(0.0, abs=1e-6)
    assert d[1].item() == pytest.approx(1.0, abs=1e-5)
    assert d[2].item() == pytest.approx(math.log(4) / math.log(8), abs=1e-5)
    assert attention_dispersion(uniform[:, :, :1] * 8, torch.tensor([1])).item() == 0.0


def test_token_entropy_in_nats():
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.0 + 1e-30], [1.0, 1e-30, 1e-30]]))
    e = token_entropy(logp)
    assert e[0].item() == pytest.approx(math.log(2), abs=1e-5) and e[1].item() == pytest.approx(0.0, abs=1e-5)


def test_anchor_confidence_half_at_typical_spread():
    spread = 0.2
    lam = math.log(2) / spread
    scores = torch.tensor([[1 - spread, 0.1, 0.0], [1.0, 0.0, 0.0]])
    conf = anchor_confidence(scores, torch.tensor([[1.0, 1.0, 1.0], [0.3, 1, 1]]), torch.full((2, 3), lam))
    assert conf[0].item() == pytest.approx(0.5, abs=1e-5)
    assert conf[1].item() == pytest.approx(0.3, abs=1e-5)


def test_trigger_config_validation():
    with pytest.raises(ValueError):
        TriggerConfig(entity_prob_threshold=0)
    with pytest.raises(ValueError, match="unknown trigger"):
        TriggerConfig(enabled=("nope",))
    with pytest.raises(ValueError):
        Calibration.from_dict({"surprisal_mean": 1})


@pytest.mark.parametrize("text,bits", [
    (" 2025", entity.DIGIT), ("$", entity.CURRENCY), (" March", entity.MONTH | entity.CAP),
    (" Section", entity.REFWORD | entity.CAP), (" Acme", entity.CAP), (".", entity.SENT_END | entity.CONT),
    ("\n", entity.SENT_END), (" the", 0), ("b", entity.CONT), (" USD", entity.CURRENCY | entity.CAP),
])
def test_token_classes(text, bits):
    assert entity.token_classes(text) == bits


def test_entity_span_rules():
    c = entity.token_classes
    start = torch.tensor([entity.SENT_END], dtype=torch.uint8)

    def walk(tokens):
        state, inside = start, []
        for t in tokens:
            state = entity.entity_flags(torch.tensor([c(t)], dtype=torch.uint8), state)
            inside.append(bool(state[0] & entity.IN_ENTITY))
        return inside

    # capitalised word at sentence start is not a name; "Acme" mid-sentence is
    assert walk(["The", " party", " Acme", " Corp", " shall"]) == [False, False, True, True, False]
    # "Clause 7(b)": reference word, digit, then continuation tokens inside the span
    assert walk([" under", " Clause", " 7", "(", "b", ")", " of"]) == [False, True, True, True, True, True, False]
    # a lone "(" outside an entity is not an entity
    assert walk([" see", " (", "a", ")"]) == [False, False, False, False]
