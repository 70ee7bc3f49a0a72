"""sfcl.server.parsing: the lone-surrogate check of request bodies (``decode_json``,
``find_lone_surrogate``)."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from sfcl.server import parsing
from sfcl.server.errors import ApiError
from sfcl.server.parsing import decode_json, find_lone_surrogate


@pytest.mark.parametrize("value, path", [
    ({"a": [1, {"b": ["x", "y\ud800"]}]}, "a.1.b.1"),
    ([1, 2, "\udc00"], "2"),
    ({"k\ud800": 1}, "k\\ud800"),  # a key: named with the surrogate escaped
    ({"a": [[], [[]], {"c": "z\udfff"}], "d": "ok"}, "a.2.c"),
    ("\ud800", None),  # a bare string: no field to name
    ({"a": [1, 2.5, None, True], "b": {"c": "ok", "e": "\U0001f600"}}, "<none>"),  # astral, no surrogate
])
def test_find_lone_surrogate_names_the_field(value, path):
    got = find_lone_surrogate(value)
    if path == "<none>":
        assert got is None
    elif path is None:
        assert got is not None
    else:
        assert got == path


def test_find_lone_surrogate_walks_deep_nesting_and_resumes_each_parent():
    deep = json.loads("[" * 900 + '"ok"' + "]" * 900)
    assert find_lone_surrogate(deep) is None
    deep = json.loads("[" * 900 + '"ok", "\\ud800"' + "]" * 900)
    assert find_lone_surrogate(deep) == ".".join(["0"] * 899 + ["1"])
    # after a nested container is done, the walk goes on with its parent's next items
    assert find_lone_surrogate({"a": [[1, [2]], {"b": [3]}, "x\udbff"]}) == "a.2"


def test_find_lone_surrogate_memory_follows_depth_not_size():
    """BUG: a path tuple per value made a 32 MB body of 16 million array items take 37 s and
    gigabytes of memory (holding the GIL meanwhile). The walk now allocates per open container."""
    wide = [1] * 1_000_000 + [[["x"] * 1_000], "\ud800"]
    tracemalloc.start()
    try:
        assert find_lone_surrogate(wide) == "1000001"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100_000, peak  # a tuple per item would be tens of megabytes


def test_decode_json_walks_only_bodies_with_a_surrogate_escape(monkeypatch):
    """Strict UTF-8 refuses encoded surrogates, so only a \\uD800-\\uDFFF escape can make one; bodies
    without such an escape skip the walk."""
    walked = []
    real = parsing.find_lone_surrogate
    monkeypatch.setattr(parsing, "find_lone_surrogate", lambda v: walked.append(1) or real(v))
    assert decode_json(b'{"a": ["x", "\\u00e9", "\\ud7ff", "\\ue000"]}') == {"a": ["x", "é", "\ud7ff", "\ue000"]}
    assert walked == []
    assert decode_json(b'{"a": "\\\\ud800"}') == {"a": "\\ud800"}  # an escaped backslash: walked, fine
    assert decode_json('{"a": "\\uD83D\\uDE00"}'.encode()) == {"a": "\U0001f600"}  # a pair, upper case
    assert len(walked) == 2
    for raw, where in ((b'{"a": ["x", "\\uDC00"]}', "a.1"), (b'{"\\udbff": 1}', "\\udbff")):
        with pytest.raises(ApiError) as e:
            decode_json(raw)
        assert e.value.status == 400 and e.value.param == where
    assert len(walked) == 4
    with pytest.raises(ApiError, match="not valid UTF-8"):
        decode_json(b'{"a": "\xed\xa0\x80"}')  # an encoded surrogate never reaches the walk
