"""Source index and support checks of source-constrained steering (sfcl.snapshot.source)."""

from __future__ import annotations

import math

import pytest

from sfcl.snapshot.source import (JOIN_COMMA, JOIN_DOT, MAX_NUMBER_DIGITS, NUM_END, NUM_START, SourceConfig, SourceIndex, canonical_form, canonical_ids, canonical_run, canonical_table,
                                  marked, number_joiners, number_support,
                                  is_number, repeats_ngram, token_texts)


@pytest.mark.parametrize("text,form", [(" five", "5"), ("5", "5"), (" thirty", "30"), ("(5)", "5"), (" Delaware", "delaware"),
                                       (".", ""), (" ", ""), ("\n", ""), (" years", "years"), ("３", "3"), (" ٣٠", "30"),
                                       (" Five", "five"), (" Ten", "ten"), ("ten", "ten"), ("one", "one"), (" TEN", "ten")])
def test_canonical_form(text, form):
    assert canonical_form(text) == form


def test_canonical_table_folds_case_space_and_number_words(lm):
    tab = canonical_table(lm.tokenizer, lm.args.vocab_size)
    ids = lambda s: lm.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert tab[ids(" five")[0]] == tab[ids("5")[0]] == tab[ids(" 5")[-1]] != ()  # digits are single tokens
    assert tab[ids(" thirty")[0]] == tab[ids("3")[0]] + tab[ids("0")[0]]  # one canonical id per digit
    assert tab[ids(" Term")[0]] == tab[ids(" term")[0]] != ()
    assert tab[ids(".")[0]] == () and tab[ids(" 5")[0]] == () and all(tab[i] == () for i in lm.tokenizer.all_special_ids)


@pytest.mark.parametrize("word", [" Tenant", " Eighteen", " Eighty", " Fourteen", "anyone", " Soneet", " Pettenbach", "tenants"])
def test_word_pieces_that_spell_number_words_are_not_numbers(lm, word):
    """Capitalised and space-less pieces (" Ten" + "ant", " Eight" + "een", "any" + "one") were read
    as numbers: "Tenant" was 10 to the number check, "Eighteen" 8."""
    tab = canonical_table(lm.tokenizer, lm.args.vocab_size)
    pieces = lm.tokenizer(word, add_special_tokens=False)["input_ids"]
    assert len(pieces) > 1 and not any(is_number(tab[t]) for t in pieces)
    table = [tab[t] for t in range(len(tab))]
    idx = SourceIndex(lm.tokenizer(" The notice period is 30 days." * 20, add_special_tokens=False)["input_ids"], table)
    assert all(math.isnan(number_support(idx, pieces[:i], t, table)) for i, t in enumerate(pieces))


def test_longest_suffix_and_span():
    # canonical ids (words: 10+): prompt "a b c d b c e" with punctuation between d and b skipped
    table = {0: (10,), 1: (11,), 2: (12,), 3: (13,), 4: (14,)}
    prompt = [0, 1, 2, 3, 9, 1, 2, 4]
    idx = SourceIndex(prompt, [table.get(i, ()) for i in range(10)])
    assert len(idx) == 7
    assert idx.longest_suffix([10, 11, 12], cap=32) == (3, 2)  # "a b c" ends at canonical index 2
    n, end = idx.longest_suffix([13, 11, 12, 14], cap=32)  # "d b c e": the punctuation is skipped
    assert n == 4 and idx.span(end, n) == (3, 8)  # prompt positions 3..7
    assert idx.longest_suffix([14, 14], cap=32)[0] == 1  # "e e" never occurs; "e" does
    assert idx.longest_suffix([17], cap=32) == (0, -1)  # not in the prompt
    assert idx.longest_suffix([10, 11, 12, 13], cap=2)[0] == 3  # counted up to cap + 1 only
    two = SourceIndex([5, 1], [(), (11,), (), (), (), (17, 18)])  # a token with two canonical ids
    assert two.seq == [17, 18, 11] and two.where == [0, 0, 1] and two.span(2, 3) == (0, 2)


def test_numbers_are_delimited_in_canonical_runs():
    # tokens: 0 " in", 1 "2", 2 "0", 3 "1", 4 ".", 5 " ", 6 " days"; digits are canonical ids 0-9
    table = [(20,), (2,), (0,), (1,), (), (), (26,)]
    S, E = NUM_START, NUM_END
    seq, src = canonical_run([0, 1, 2, 3, 3, 4, 5, 3, 3, 6], table)  # " in 2011. 11 days"
    assert seq == [20, S, 2, 0, 1, 1, E, S, 1, 1, E, 26]
    assert src == [0, 1, 1, 2, 3, 4, 4, 7, 7, 8, 8, 9]
    assert canonical_run([0, 3, 3], table, closed=False)[0] == [20, S, 1, 1]  # an answer's number may go on
    assert canonical_run([3, 4, 1], table)[0] == [S, 1, E, S, 2, E]  # "1.2": two numbers
    idx = SourceIndex([0, 1, 2, 3, 3, 4], table)  # " in 2011."
    assert idx.longest_suffix([S, 1, 1], cap=32)[0] < 3  # "11" is not a number of this prompt
    assert idx.longest_suffix([S, 2, 0, 1, 1, E], cap=32)[0] == 6
    assert is_number((2, 0)) and not is_number((20,)) and not is_number(())
    # one token's share of a run (the rule canonical_run applies and source steering asks of candidates)
    assert marked((1,), False) == [S, 1] and marked((1,), True) == [1]
    assert marked((26,), True) == [E, 26] and marked((), True) == [E] and marked((26,), False) == [26]


def test_number_support_asks_whether_the_number_so_far_begins_a_prompt_number():
    # tokens: 0 " in", 1 "2", 2 "0", 3 "1", 4 ".", 5 " ", 6 " days"; digits are canonical ids 0-9
    table = [(20,), (2,), (0,), (1,), (), (), (26,)]
    idx = SourceIndex([0, 1, 2, 3, 3, 4, 5, 3, 2, 5, 6], table)  # " in 2011. 10 days"
    assert number_support(idx, [0], 3, table, 0) == 0.0  # "1" begins "10"
    assert number_support(idx, [0, 3], 2, table, 0) == 0.0  # "10"
    assert number_support(idx, [0, 3], 3, table, 0) == 1.0  # "11": only inside "2011", no number begins with 11
    assert number_support(idx, [0, 1, 2, 3], 3, table, 0) == 0.0  # "2011"
    assert number_support(idx, [0, 1, 2, 3, 3], 3, table, 0) == 1.0  # "20111"
    assert number_support(idx, [0, 3, 4], 3, table, 0) == 0.0  # after "." a new number starts: "1"
    assert math.isnan(number_support(idx, [0, 3], 6, table, 0))  # not a number token
    assert math.isnan(number_support(idx, [0], 99, table, 0))  # outside the table
    assert idx.number_prefixes == {(2,), (2, 0), (2, 0, 1), (2, 0, 1, 1), (1,), (1, 0)}
    assert math.isnan(number_support(idx, [0], 3, table))  # an 11-token prompt has no document (default minimum 64)
    assert math.isnan(number_support(idx, [0, 3, 3], 3, table, 0, max_digits=2))  # its start is not read


def test_number_support_reads_dotted_and_grouped_numbers_whole():
    # tokens: 0 " in", 1 "2", 2 "0", 3 "1", 4 ".", 5 " ", 6 " days", 7 "3", 8 ","
    table = [(20,), (2,), (0,), (1,), (), (), (26,), (3,), ()]
    joiners = {4: JOIN_DOT, 8: JOIN_COMMA}
    idx = SourceIndex([0, 1, 4, 3, 4, 7, 5, 3, 8, 2, 2, 2, 5, 6, 4, 5, 7, 4], table, joiners)  # " in 2.1.3 1,000 days. 3."
    D, C = JOIN_DOT, JOIN_COMMA
    assert idx.number_prefixes == {(2,), (2, D, 1), (2, D, 1, D, 3), (1,), (1, C, 0), (1, C, 0, 0), (1, C, 0, 0, 0), (3,)}
    assert number_support(idx, [0, 1, 4, 3, 4], 7, table, 0) == 0.0  # "2.1.3"
    assert number_support(idx, [0, 1, 4, 3, 4], 1, table, 0) == 1.0  # "2.1.2": its parts are prompt numbers, it is not
    assert number_support(idx, [0, 3, 8], 2, table, 0) == 0.0  # "1,0"
    assert number_support(idx, [0, 3, 8, 5], 2, table, 0) == 1.0  # "1, 0": a list, "0" starts no prompt number
    assert number_support(idx, [0, 7, 4, 5], 3, table, 0) == 0.0  # "3. 1": a sentence end, then the number 1
    plain = SourceIndex([0, 1, 4, 3, 4, 7], table)  # without joiners: three numbers 2, 1, 3
    assert plain.number_prefixes == {(2,), (1,), (3,)} and number_support(plain, [0, 1, 4, 3, 4], 7, table, 0) == 0.0


def test_canonical_table_digits_are_ids_0_to_9(lm):
    tab = canonical_table(lm.tokenizer, lm.args.vocab_size)
    ids = lambda s: lm.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert [tab[ids(str(d))[0]] for d in range(10)] == [(d,) for d in range(10)]
    assert tab[ids(" twelve")[0]] == (1, 2) and not is_number(tab[ids(" Term")[0]])
    j = number_joiners(lm.tokenizer, lm.args.vocab_size)
    assert j[ids(".")[0]] == JOIN_DOT and j[ids(",")[0]] == JOIN_COMMA and set(j.values()) == {JOIN_DOT, JOIN_COMMA}
    assert ids("2.1")[1] in j  # SmolLM2 writes "2.1" as "2", ".", "1"


def test_tables_from_one_decode_equal_their_own_decodes(lm):
    texts = token_texts(lm.tokenizer, lm.args.vocab_size)
    tab = canonical_table(lm.tokenizer, lm.args.vocab_size, texts)
    assert tab == canonical_table(lm.tokenizer, lm.args.vocab_size)
    assert number_joiners(lm.tokenizer, lm.args.vocab_size, texts) == number_joiners(lm.tokenizer, lm.args.vocab_size)
    t7 = lm.tokenizer("7", add_special_tokens=False)["input_ids"][0]
    assert canonical_ids(tab, t7) == (7,)
    assert canonical_ids(tab, -1) == () and canonical_ids(tab, len(tab)) == ()  # ids outside the table: nothing


def test_number_prefixes_stop_at_the_longest_number_the_check_reads():
    table = [(d,) for d in range(10)] + [()]
    idx = SourceIndex([7] * 5000 + [10], table)  # one 5,000-digit number: 5,000 prefixes were kept before
    assert len(idx.number_prefixes) == MAX_NUMBER_DIGITS and max(map(len, idx.number_prefixes)) == MAX_NUMBER_DIGITS
    assert number_support(idx, [7] * (MAX_NUMBER_DIGITS - 1), 7, table, 0) == 0.0  # the longest number read: found
    assert math.isnan(number_support(idx, [7] * MAX_NUMBER_DIGITS, 7, table, 0))  # one digit more is not judged


def test_repeats_ngram():
    out = [5, 6, 7, 8, 5, 6]
    assert repeats_ngram(out, 7, 3) and not repeats_ngram(out, 9, 3)
    assert not repeats_ngram([1], 2, 4)


def test_source_config_validates():
    with pytest.raises(ValueError):
        SourceConfig(top_k=0)
    with pytest.raises(ValueError):
        SourceConfig(min_ratio=0.0)
