"""Parsing a request's ``steer`` value and finding its document (sfcl.snapshot.mechanisms)."""

from __future__ import annotations

import sys

import pytest

from sfcl.snapshot.mechanisms import DEFAULT_STEER, SHORT_SYSTEM_CHARS, no_document_messages, parse_steer


@pytest.mark.parametrize("value,expect", [
    (True, DEFAULT_STEER), (False, ()), (None, ()), ("on", DEFAULT_STEER), ("off", ()), ("source", ("source",)),
    ("CAD", ("cad",)), ("source+cad", ("cad", "source")), (["knn", "source"], ("knn", "source")), (("knn",), ("knn",)),
])
def test_parse_steer(value, expect):
    assert parse_steer(value) == expect


@pytest.mark.parametrize("bad", ["banana", "source+", "+", ["source", "x"], 3, {"m": 1}, [1], "", "  ", []])
def test_parse_steer_rejects_with_the_accepted_values(bad):
    with pytest.raises(ValueError, match="'source'"):
        parse_steer(bad)


def test_request_records_stay_torch_free():
    import subprocess

    code = "import sys, sfcl.engine.request, sfcl.snapshot.mechanisms; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_no_document_messages_keeps_the_question_and_a_short_system_prompt():
    msgs = [{"role": "user", "content": "Contract:\nThe term is 5 years.\n\nQuestion: How long is the term?"}]
    assert no_document_messages(msgs, "Answer briefly.") == (
        [{"role": "user", "content": "Question: How long is the term?"}], "Answer briefly.")
    long_system = "Retrieved documents: " + "x" * SHORT_SYSTEM_CHARS
    assert no_document_messages([{"role": "user", "content": "Q?"}], long_system) == (
        [{"role": "user", "content": "Q?"}], None)  # a long system prompt is a document
    earlier = [{"role": "user", "content": "Here is a doc."}, {"role": "assistant", "content": "OK"},
               {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What does it say?"}]
    assert no_document_messages(earlier, None) == ([{"role": "user", "content": "What does it say?"}], "Be brief.")
    assert no_document_messages([{"role": "user", "content": "What is 2+2?"}], None) is None  # nothing to remove
    assert no_document_messages([], None) is None
