"""Trigger functions and entity-token detection."""

import json
import math

import numpy as np
import pytest
import torch

from sfcl.snapshot import entity
from sfcl.snapshot.triggers import (TRIGGER_NAMES, Calibration, TriggerConfig, anchor_confidence,
                                    anchor_confidence_each, attention_dispersion, dispersion_length_table, fire,
                                    token_entropy, trigger_signals, window_mean)

CAL = Calibration(surprisal_mean=2.5, surprisal_std=2.0, dispersion_mean=0.3, dispersion_std=0.1)


def fires(trigger: str, cfg: TriggerConfig = TriggerConfig(), *, logp=None, in_entity=None, d3=None, n=None,
          lookback=None, cal: Calibration = CAL) -> list[bool]:
    """One trigger's column of ``fire(trigger_signals(...))`` for a batch (the runner's rule)."""
    B = len(next(x for x in (logp, in_entity, d3, lookback) if x is not None))
    lp = torch.tensor(logp if logp is not None else [-0.01] * B, dtype=torch.float32)
    ent = torch.tensor(in_entity if in_entity is not None else [False] * B)
    d = torch.tensor(d3 if d3 is not None else [float("nan")] * B, dtype=torch.float32)
    lb = None if lookback is None else torch.tensor(lookback, dtype=torch.float32)
    sig = trigger_signals(lp, ent, d, None if n is None else torch.tensor(n), lb, cal)
    return fire(sig, cfg)[:, TRIGGER_NAMES.index(trigger)].tolist()


def test_entity_low_confidence_needs_both_conditions():
    logp = [math.log(x) for x in (0.5, 0.5, 0.9, 0.849)]
    inside = [True, False, True, True]
    assert fires("entity_low_confidence", logp=logp, in_entity=inside) == [True, False, False, True]
    assert fires("entity_low_confidence", TriggerConfig(entity_prob_threshold=0.4), logp=logp,
                 in_entity=inside) == [False, False, False, False]


def test_surprisal_trigger_is_two_sided_z_score():
    s = [2.5, 6.4, 6.6, 0.0, -1.6]  # z = 0, 1.95, 2.05, -1.25, -2.05 (a negative surprisal only in this test)
    logp = [-x for x in s]
    assert fires("surprisal_deviation", logp=logp) == [False, False, True, False, True]
    assert fires("surprisal_deviation", TriggerConfig(surprisal_z=1.0), logp=logp) == [False, True, True, True, True]


def test_dispersion_trigger_one_sided_and_undefined_before_the_window():
    d3 = [0.3, 0.41, 0.43, 0.0, float("nan")]  # z = 0, 1.1, 1.3, -3, undefined
    assert fires("attention_dispersion", d3=d3) == [False, False, True, False, False]


def test_lookback_trigger_fires_above_its_probability_and_never_without_a_model():
    assert fires("lookback_ratio", lookback=[0.2, 0.6]) == [False, True]
    assert fires("lookback_ratio", TriggerConfig(lookback_threshold=0.1), lookback=[0.2, 0.6]) == [True, True]
    assert fires("lookback_ratio", TriggerConfig(lookback_threshold=0.01), d3=[0.3, 0.3]) == [False, False]


def test_disabled_triggers_never_fire_and_cutoffs_round_trip():
    cfg = TriggerConfig(enabled=("surprisal_deviation",))
    sig = trigger_signals(torch.tensor([-9.0]), torch.tensor([True]), torch.tensor([0.9]), None, torch.tensor([0.99]),
                          CAL)
    assert fire(sig, cfg).tolist() == [[False, False, True, False, False]]
    assert fire(sig, TriggerConfig()).tolist() == [[True, True, True, True, False]]  # no number column: -inf
    c = TriggerConfig(entity_prob_threshold=0.3, dispersion_z=0.7, surprisal_z=1.5, lookback_threshold=0.8)
    assert TriggerConfig.thresholds_from_cutoffs(c.cutoffs()) == c.thresholds()


def test_window_mean_is_undefined_until_the_window_is_full():
    hist = torch.tensor([[0.0, 0.0, 0.6], [0.0, 0.3, 0.6], [0.3, 0.6, 0.9]])
    m = window_mean(hist, torch.tensor([1, 2, 3]), 3)
    assert torch.isnan(m[:2]).all() and m[2].item() == pytest.approx(0.6)


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
    w = torch.tensor([[1.0, 1.0, 1.0], [0.3, 1, 1]])
    conf = anchor_confidence(scores, w, torch.full((2, 3), lam))
    assert torch.equal(conf, anchor_confidence_each(scores, w, torch.full((2, 3), lam)).amax(-1))  # one formula
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
    # the host walk (steering, calibration) applies the same rule
    toks = [" under", " Clause", " 7", "(", "b", ")", " of", " The", " party", " Acme", " Corp"]
    table = [c(t) for t in toks]
    host = [bool(x & entity.IN_ENTITY) for x in entity.span_states(list(range(len(toks))), table)]
    assert host == walk(toks)


# -- dispersion statistics per attended length ---------------------------------------------------

def _rows(n: int, rows: int, gen: torch.Generator, k: int = 8) -> torch.Tensor:
    """Synthetic attention rows over n positions: a random share w in (0.8, 0.95) on k favoured
    positions, the rest spread with noise. Their normalised entropy falls with n (about
    (w log(k/w) + (1-w) log(n/(1-w))) / log n), as the real model's does."""
    w = 0.8 + 0.15 * torch.rand(rows, 2, 1, generator=gen)
    rest = torch.rand(rows, 2, n, generator=gen)
    p = (1 - w) * rest / rest.sum(-1, keepdim=True)
    fav = torch.randperm(n, generator=gen)[:k]
    p[:, :, fav] += w / k
    return p


def _dispersion_sample(lengths, gen) -> tuple[torch.Tensor, torch.Tensor]:
    d, ns = [], []
    for n in lengths:
        d.append(attention_dispersion(_rows(n, 4, gen), torch.full((4,), n)))
        ns.append(torch.full((4,), n))
    return torch.cat(d), torch.cat(ns)


def test_length_table_round_trip_and_interpolation():
    rng = np.random.default_rng(0)
    n = np.floor(2 ** rng.uniform(4, 12, 5000)).astype(np.int64)  # log-uniform 16 .. 4095
    d3 = 0.9 - 0.06 * np.log2(n) + rng.normal(0, 0.02, n.size)
    tab = dispersion_length_table(d3, n, min_count=64, source="synthetic")
    assert tab["source"] == "synthetic" and len(tab["log2_n"]) == 8  # buckets [16, 32) .. [2048, 4096)
    assert all(c >= 64 for c in tab["count"]) and tab["log2_n"] == sorted(tab["log2_n"])
    flat = {"surprisal_mean": 2.0, "surprisal_std": 1.0, "dispersion_mean": float(d3.mean()),
            "dispersion_std": float(d3.std())}
    cal = Calibration.from_dict(json.loads(json.dumps({**flat, "dispersion_by_length": tab})))  # manifest round trip
    assert cal.by_length and cal.dispersion_means == tuple(tab["mean"])
    # at a bucket centre: that bucket's statistics; between centres: linear in log2 n; flat outside
    x = torch.tensor(tab["log2_n"])
    n_c = (2 ** x).round().long()
    mu, sd = cal.dispersion_stats(n_c, torch.zeros(len(n_c)))
    assert torch.allclose(mu, torch.tensor(tab["mean"], dtype=torch.float32), atol=2e-3)
    mid = torch.tensor([2 ** ((tab["log2_n"][2] + tab["log2_n"][3]) / 2)])
    mu_mid, _ = cal.dispersion_stats(mid.round().long(), torch.zeros(1))
    assert mu_mid.item() == pytest.approx((tab["mean"][2] + tab["mean"][3]) / 2, abs=3e-3)
    lo, _ = cal.dispersion_stats(torch.tensor([2, 100000]), torch.zeros(2))
    assert lo.tolist() == pytest.approx([tab["mean"][0], tab["mean"][-1]], abs=1e-6)
    # with the table the trigger reads the length: the same D3 fires at a long context only
    d = [tab["mean"][0], tab["mean"][0]]
    assert fires("attention_dispersion", d3=d, n=[20, 2000], cal=cal) == [False, True]


def test_old_flat_calibration_still_loads_and_behaves_as_before():
    old = {"surprisal_mean": 2.5, "surprisal_std": 2.0, "dispersion_mean": 0.3, "dispersion_std": 0.1,
           "n_positions": 100, "share_surprisal_z2": 0.05}  # manifest of a library built before the table
    cal = Calibration.from_dict(old)
    assert not cal.by_length and cal == CAL
    d3 = [0.3, 0.41, 0.43, 0.0]
    n = [20, 200, 2000, 5000]
    assert fires("attention_dispersion", d3=d3, n=n, cal=cal) == fires("attention_dispersion", d3=d3, cal=cal) == \
        [False, False, True, False]
    mu, sd = cal.dispersion_stats(torch.tensor([5, 5000]), torch.zeros(2))
    assert mu.tolist() == pytest.approx([0.3, 0.3]) and sd.tolist() == pytest.approx([0.1, 0.1])


@pytest.mark.parametrize("table", [
    {"log2_n": [4, 5], "mean": [0.3], "std": [0.1]},  # unequal lengths
    {"log2_n": [5, 4], "mean": [0.3, 0.3], "std": [0.1, 0.1]},  # not ascending
    {"log2_n": [4, 5], "mean": [0.3, 0.3], "std": [0.1, 0.0]},  # zero std
    {"log2_n": [4], "mean": [0.3]},  # std missing
    {"log2_n": [4], "mean": ["x"], "std": [0.1]},
    [1, 2, 3],
])
def test_malformed_length_table_is_rejected(table):
    with pytest.raises(ValueError, match="dispersion_by_length"):
        Calibration.from_dict({"surprisal_mean": 2.5, "surprisal_std": 2.0, "dispersion_mean": 0.3,
                               "dispersion_std": 0.1, "dispersion_by_length": table})


def test_length_table_needs_enough_values():
    with pytest.raises(ValueError, match="bucket"):
        dispersion_length_table(np.full(10, 0.3), np.full(10, 100), min_count=64)


def test_short_context_trigger_rate_is_not_pathological():
    """Calibration on mostly long contexts (as a corpus pass is), serving on short ones (as chat
    prompts are): flat statistics fire on most short-context tokens, per-length ones do not."""
    gen = torch.Generator().manual_seed(0)
    cal_lengths = [int(2 ** (4 + 8 * i / 399)) for i in range(400)]  # 16 .. 4096, log-uniform
    cal_lengths += [int(x) for x in torch.randint(512, 4096, (400,), generator=gen)]  # long-heavy, like a corpus
    d_cal, n_cal = _dispersion_sample(cal_lengths, gen)
    flat = Calibration(surprisal_mean=2.5, surprisal_std=2.0, dispersion_mean=float(d_cal.mean()),
                       dispersion_std=float(d_cal.std()))
    table = dispersion_length_table(d_cal.numpy(), n_cal.numpy(), min_count=32)
    per_len = Calibration.from_dict({"surprisal_mean": 2.5, "surprisal_std": 2.0, "dispersion_mean": flat.dispersion_mean,
                                     "dispersion_std": flat.dispersion_std, "dispersion_by_length": table})
    short = [int(x) for x in torch.randint(40, 160, (150,), generator=gen)]
    d, n = _dispersion_sample(short, gen)
    rate_flat = float(np.mean(fires("attention_dispersion", d3=d.tolist(), n=n.tolist(), cal=flat)))
    rate_len = float(np.mean(fires("attention_dispersion", d3=d.tolist(), n=n.tolist(), cal=per_len)))
    assert rate_flat > 0.25  # the failure mode this guards against (real chat prompts: 0.31)
    assert rate_len < 0.15  # about the one-sided tail beyond 1.2 sd (~0.12 for a normal)
