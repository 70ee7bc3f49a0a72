"""Token labels of answers (sfcl.eval.labels): scorer entities mapped onto generated tokens."""

from __future__ import annotations

from sfcl.eval.labels import label_answer, token_char_spans
from sfcl.eval.scorer import Source


def test_unsupported_entity_tokens_are_labelled(lm):
    tok = lm.tokenizer
    ids = tok("The term is 35 days under Section 5.", add_special_tokens=False)["input_ids"]
    text, spans = token_char_spans(tok, ids)
    assert text == "The term is 35 days under Section 5." and spans[0][0] == 0 and spans[-1][1] == len(text)
    lab = label_answer(tok, ids, Source.of("5. Term\nThe term is 30 days."))
    kinds = {e.text: (e.kind, e.supported) for e in lab.entities}
    assert kinds["35 days"] == ("duration", False) and kinds["Section 5"] == ("clause_ref", True)
    bad = [tok.decode([ids[k]]) for k in range(len(ids)) if lab.token_unsupported[k]]
    assert "".join(bad).strip() == "35 days"
    assert sum(lab.token_entity) > sum(lab.token_unsupported) > 0
