"""Grounded correction of a triggered token (sfcl.snapshot.grounding) on a tiny synthetic
vocabulary: source re-ranking with its guards, the CAD contrast, and what the event records."""

from __future__ import annotations

import math

import pytest
import torch

from sfcl.snapshot import entity
from sfcl.snapshot.cad import contrast, js_divergence
from sfcl.snapshot.grounding import Grounding, SteerRow
from sfcl.snapshot.source import SourceConfig

#          0 " the"  1 "3"           2 "0"           3 "5"           4 " days" 5 " Section"
CLASSES = [0, entity.DIGIT, entity.DIGIT, entity.DIGIT, 0, entity.REFWORD | entity.CAP,
           #   6 "."                          7 " Acme"   8 " Beta"   9 " "
           entity.SENT_END | entity.CONT, entity.CAP, entity.CAP, entity.CONT]
CANON = [(20,), (3,), (0,), (5,), (24,), (25,), (), (27,), (28,), ()]  # canonical ids 0-9 are the digits
PROMPT = [0, 9, 1, 2, 4, 5, 9, 3, 7]  # " the 30 days Section 5 Acme"


def grounding(cad=None, **cfg) -> Grounding:
    g = Grounding(torch.tensor(CLASSES, dtype=torch.uint8), CANON, cad, SourceConfig(**cfg))
    g.prepare("r", PROMPT)
    return g


def logits(probs: dict[int, float]) -> torch.Tensor:
    x = torch.full((1, len(CLASSES)), -30.0)
    for t, p in probs.items():
        x[0, t] = math.log(p)
    return x


def row(output, token, mechanisms=("source",), **kw) -> SteerRow:
    return SteerRow(request_id=kw.pop("rid", "r"), mechanisms=mechanisms, prompt_ids=PROMPT, output_ids=output,
                    token=token, temperature=0.0, top_p=1.0, generator=None, **kw)


def test_unsupported_digit_is_replaced_by_the_supported_candidate():
    g = grounding()
    [(tok, info)] = g.steer([row([0, 9, 1], 3)], logits({3: 0.6, 2: 0.3, 0: 0.1}))  # " the 3" + "5" -> "35"?
    assert tok == 2 and info.changed and info.supported is True  # "30" is in the prompt
    assert info.source_span == (0, 4) and info.original_token == 3 and info.token == 2 and info.mechanism == "source"
    # (the longest suffix of the answer found in the prompt: " the 30", prompt positions 0..3)


def test_supported_token_stays_and_names_its_span():
    [(tok, info)] = grounding().steer([row([0, 9, 1], 2)], logits({2: 0.6, 3: 0.4}))
    assert tok == 2 and not info.changed and info.supported is True and info.source_span == (0, 4)


def test_no_supported_candidate_keeps_the_model_token_and_says_so():
    [(tok, info)] = grounding().steer([row([0, 9, 1], 3)], logits({3: 0.7, 8: 0.3}))
    assert tok == 3 and not info.changed and info.supported is False and info.reason == "no_supported_candidate"


def test_guards_low_probability_and_repetition():
    # "0" would make "30" but is below min_ratio x p(model token)
    [(tok, info)] = grounding(min_ratio=0.5).steer([row([0, 9, 1], 3)], logits({3: 0.8, 2: 0.2}))
    assert tok == 3 and info.supported is False
    # " Acme" is in the prompt, but "Section 5 Acme" was already said: an n-gram repeat is not promoted
    out = [5, 9, 3, 7, 0, 5, 9, 3]
    [(tok, info)] = grounding(ngram=4).steer([row(out, 8)], logits({8: 0.6, 7: 0.4}))
    assert tok == 8 and info.supported is False
    [(tok, _)] = grounding(ngram=8).steer([row(out, 8)], logits({8: 0.6, 7: 0.4}))
    assert tok == 7  # without that guard it would be
    # copy cap: "5 Acme" continues a prompt span of 3 canonical tokens
    [(tok, info)] = grounding(copy_cap=2).steer([row([5, 9, 3], 8)], logits({8: 0.6, 7: 0.4}))
    assert tok == 8 and info.supported is False


def test_not_entity_and_no_source():
    [(tok, info)] = grounding().steer([row([0], 0)], logits({0: 0.9, 1: 0.1}))
    assert tok == 0 and info.reason == "not_entity" and info.supported is None
    g = Grounding(torch.tensor(CLASSES, dtype=torch.uint8), CANON)  # no index prepared for this request
    [(tok, info)] = g.steer([row([0, 9, 1], 3, rid="other")], logits({3: 0.6, 2: 0.4}))
    assert tok == 3 and info.reason == "no_source" and info.source_span is None


class FakeSide:
    """ContextFreeSequences stand-in: fixed no-document logits."""

    def __init__(self, lg):
        self.lg, self.asked = lg, []

    def logits(self, rows):
        self.asked.extend(rows)
        return [self.lg for _ in rows]

    def release(self, rid):
        pass


def test_cad_contrasts_with_the_no_document_distribution():
    ctx = logits({3: 0.5, 2: 0.45, 0: 0.05})
    free = logits({3: 0.9, 2: 0.05, 0: 0.05})[0]  # without the document the model says "5" anyway
    side = FakeSide(free)
    g = grounding(cad=side)
    [(tok, info)] = g.steer([row([0, 9, 1], 3, ("cad",), cad_prompt_ids=[11, 12])], ctx)
    assert tok == 2 and info.changed and 0 < info.alpha <= 1 and info.mechanism == "cad"
    assert side.asked == [("r", [11, 12, 0, 9, 1])]  # no-document prompt + the answer so far
    [(tok, info)] = g.steer([row([0, 9, 1], 3, ("cad",))], ctx)  # no document found in the request
    assert tok == 3 and info.reason == "no_document" and info.alpha is None


def test_js_divergence_and_contrast():
    p = torch.log_softmax(torch.tensor([[2.0, 1.0, 0.0]]), -1)
    assert js_divergence(p, p).item() == pytest.approx(0.0, abs=1e-6)
    a, b = torch.log(torch.tensor([[1.0, 1e-30]])), torch.log(torch.tensor([[1e-30, 1.0]]))
    assert js_divergence(a, b).item() == pytest.approx(1.0, abs=1e-4)  # disjoint: 1 bit
    out = contrast(p, p, torch.tensor([0.0]))
    assert torch.allclose(out.exp(), p.exp(), atol=1e-6)  # alpha 0: the model's distribution
    p = torch.log_softmax(torch.tensor([[3.0, 2.0, -2.0]]), -1)  # token 2: p < 0.1 x the top one
    q = torch.log_softmax(torch.tensor([[0.0, 3.0, -9.0]]), -1)
    out = contrast(p, q, torch.tensor([1.0]), plausibility=0.1)
    assert out.exp().sum().item() == pytest.approx(1.0, abs=1e-5)
    assert out[0, 2].item() == float("-inf")  # below 0.1 x the top probability with the document
    assert out[0, 0] > p[0, 0]  # the token the document favours over the prior gains


def test_candidates_continuing_a_longer_prompt_span_win_the_re_rank():
    # after " the " both "5" and "3" occur in the prompt, but only "the 3" is a prompt span (" the 30 days")
    [(tok, info)] = grounding().steer([row([0, 9], 3)], logits({3: 0.6, 1: 0.3, 0: 0.1}))
    assert tok == 1 and info.changed and info.source_span == (0, 3)
    [(tok, _)] = grounding(span_bonus=0.0).steer([row([0, 9], 3)], logits({3: 0.6, 1: 0.3, 0: 0.1}))
    assert tok == 3  # without the bonus the model's (supported) token stays


def test_a_number_is_judged_by_itself_and_an_unsupported_one_is_ended():
    g = Grounding(torch.tensor(CLASSES, dtype=torch.uint8), CANON, None, SourceConfig())
    g.prepare("h", [0, 9, 3, 6, 9, 1, 2, 4])  # " the 5. 30 days": clause 5 is a heading, no "Section 5"
    # "Section " + "5": the number 5 is in the document, whatever word introduced it
    [(tok, info)] = g.steer([row([5, 9], 3, rid="h")], logits({3: 0.9, 1: 0.1}))
    assert tok == 3 and info.supported is True and not info.changed
    # "Section 5" + "3" would make clause 53, which the document does not have: "." ends the number at 5
    [(tok, info)] = g.steer([row([5, 9, 3], 1, rid="h")], logits({1: 0.7, 6: 0.2, 0: 0.1}))
    assert tok == 6 and info.changed and info.supported is True
    # "5" inside a longer number of the prompt ("35") is not a number of it: no candidate
    g.prepare("k", [0, 9, 1, 3, 4])  # " the 35 days"
    [(tok, info)] = g.steer([row([5, 9, 3], 1, rid="k")], logits({1: 0.7, 6: 0.2, 0: 0.1}))
    assert tok == 1 and info.supported is False


def test_number_signal_reads_the_request_source_and_is_silent_without_a_document():
    g = grounding(min_source_tokens=0)  # PROMPT: " the 30 days Section 5 Acme" (9 tokens)
    assert g.number_signal("r", [0, 9, 1], 2) == 0.0  # "30"
    assert g.number_signal("r", [0, 9, 1], 3) == 1.0  # "35": no prompt number begins with 35
    assert math.isnan(g.number_signal("r", [0, 9], 4))  # " days": not a number token
    assert math.isnan(g.number_signal("other", [0, 9, 1], 3))  # no index for that request
    short = grounding(min_source_tokens=10)  # a 9-token prompt has no document to ground numbers in
    assert math.isnan(short.number_signal("r", [0, 9, 1], 3))
