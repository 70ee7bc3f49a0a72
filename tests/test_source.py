"""Source index and support checks of source-constrained steering (sfcl.snapshot.source)."""

from __future__ import annotations

import pytest

from sfcl.snapshot.source import SourceConfig, SourceIndex, canonical_form, canonical_table, repeats_ngram


@pytest.mark.parametrize("text,form", [(" Five", "5"), ("5", "5"), (" thirty", "30"), ("(5)", "5"), (" Delaware", "delaware"),
                                       (".", ""), (" ", ""), ("\n", ""), (" years", "years")])
def test_canonical_form(text, form):
    assert canonical_form(text) == form


def test_canonical_table_folds_case_space_and_number_words(lm):
    tab = canonical_table(lm.tokenizer, lm.args.vocab_size)
    ids = lambda s: lm.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert tab[ids(" five")[0]] == tab[ids("5")[0]] == tab[ids(" 5")[-1]] != ()  # digits are single tokens
    assert tab[ids(" thirty")[0]] == tab[ids("3")[0]] + tab[ids("0")[0]]  # one canonical id per digit
    assert tab[ids(" Term")[0]] == tab[ids(" term")[0]] != ()
    assert tab[ids(".")[0]] == () and tab[ids(" 5")[0]] == () and all(tab[i] == () for i in lm.tokenizer.all_special_ids)


def test_longest_suffix_and_span():
    # canonical ids: prompt "a b c d b c e" with punctuation (-1) between d and b skipped
    table = {0: (0,), 1: (1,), 2: (2,), 3: (3,), 4: (4,)}
    prompt = [0, 1, 2, 3, 9, 1, 2, 4]
    idx = SourceIndex(prompt, [table.get(i, ()) for i in range(10)])
    assert len(idx) == 7
    assert idx.longest_suffix([0, 1, 2], cap=32) == (3, 2)  # "a b c" ends at canonical index 2
    n, end = idx.longest_suffix([3, 1, 2, 4], cap=32)  # "d b c e": the punctuation is skipped
    assert n == 4 and idx.span(end, n) == (3, 8)  # prompt positions 3..7
    assert idx.longest_suffix([4, 4], cap=32)[0] == 1  # "e e" never occurs; "e" does
    assert idx.longest_suffix([7], cap=32) == (0, -1)  # not in the prompt
    assert idx.longest_suffix([0, 1, 2, 3], cap=2)[0] == 3  # counted up to cap + 1 only
    two = SourceIndex([5, 1], [(), (1,), (), (), (), (7, 8)])  # a token with two canonical ids (a number word)
    assert two.seq == [7, 8, 1] and two.where == [0, 0, 1] and two.span(2, 3) == (0, 2)


def test_repeats_ngram():
    out = [5, 6, 7, 8, 5, 6]
    assert repeats_ngram(out, 7, 3) and not repeats_ngram(out, 9, 3)
    assert not repeats_ngram([1], 2, 4)


def test_source_config_validates():
    with pytest.raises(ValueError):
        SourceConfig(top_k=0)
    with pytest.raises(ValueError):
        SourceConfig(min_ratio=0.0)
