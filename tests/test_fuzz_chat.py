"""Hypothesis-generated request bodies for both chat routes, against a FakeEngine app (in-process).

Bodies come in three kinds: valid ones (right shape, values in range, a conversation the route
accepts), valid ones with one field or one message broken (wrong type, out of range, missing,
unknown key, lone surrogate...), and raw bytes (not JSON, not UTF-8, NaN, 1e400, deep nesting...).
Whatever the body and the reply text:

* the answer is never a 5xx: it is a 200, or a 4xx whose body is exactly that API's error format
  (Anthropic ``{"type": "error", "error": {"type", "message"}}`` with the type of its status,
  OpenAI ``{"error": {"message", "type", "param", "code"}}``);
* a 200 is a well-formed message / completion, or a well-formed event stream (events in order,
  ``[DONE]`` last) whose text deltas add up to the reply cut where the engine stopped;
* the conversation handed to ``encode_chat`` is the one the request describes (turns in order,
  content blocks joined, same-role Anthropic turns merged, ``developer`` -> ``system``).

The last tests feed conversations to the real chat template of the bundled model's tokenizer.

Examples per test: ``SFCL_FUZZ_EXAMPLES`` (default 150).
"""

from __future__ import annotations

import collections
import json
import os
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from sfcl.server import create_app
from sfcl.server.errors import anthropic_type_for
from sfcl.server.testing import DEFAULT_REPLY, FakeEngine, parse_sse

EXAMPLES = int(os.environ.get("SFCL_FUZZ_EXAMPLES", "150"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])
MODEL = "fake-model"
A, O = "/v1/messages", "/v1/chat/completions"
SEEN: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def report(request):
    yield
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if tr is None or capman is None or not SEEN:
        return
    with capman.global_and_fixture_disabled():
        for route in (A, O):
            counts = {k[1:]: n for k, n in sorted(SEEN.items()) if k[0] == route}
            tr.write_line(f"\nfuzz_chat {route}: {sum(counts.values())} requests, "
                          f"(status, streamed): {counts}")


@pytest.fixture(scope="module")
def served():
    """One app for the module; each example sets the engine's reply and clears its records."""
    engine = FakeEngine(max_model_len=256, snapshot_every=3)
    with TestClient(create_app(engine, ping_interval_s=5.0), raise_server_exceptions=False) as c:
        yield c, engine


# -- strategies -----------------------------------------------------------------------------------

WORDS = st.sampled_from(["The", "fox", "lazy", "dog.", "one", "token", "é", "你好", "👍🏽", "\n"])
# text with real words (so stop sequences and the reply meet), any unicode, and the characters
# that break naive line handling
text = st.one_of(
    st.lists(WORDS, max_size=6).map(" ".join),
    st.text(max_size=20),
    st.text(st.sampled_from("ab \n\r\t\u2028\u2029\x85\x00\"\\:<|>{}"), max_size=12))
nonblank = text.filter(lambda t: t.strip())
surrogate_text = st.builds(lambda a, s: a + s, text, st.sampled_from(["\ud800", "\udfff x"]))
junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | text | surrogate_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
    max_leaves=6)
stop_text = st.one_of(WORDS, st.sampled_from(["fox", " lazy", "s", "o", "The quick", "\u2028"]),
                      text)


def blocks(inner_text, extra: dict | None = None):
    block = st.fixed_dictionaries({"type": st.just("text"), "text": inner_text},
                                  optional=extra or {})
    return st.lists(block, min_size=1, max_size=3)


anthropic_extra = {"cache_control": st.just({"type": "ephemeral"})}


@st.composite
def anthropic_valid(draw) -> dict:
    n = draw(st.integers(1, 4))
    messages = []
    for i in range(n):
        role = "user" if i == 0 else draw(st.sampled_from(["user", "assistant"]))
        content = draw(st.one_of(nonblank, blocks(nonblank, anthropic_extra)))
        messages.append({"role": role, "content": content})
    if messages[-1]["role"] == "assistant" and draw(st.integers(0, 3)):
        messages.append({"role": "user", "content": draw(nonblank)})  # else: prefill, a 400
    if messages[-1]["role"] == "user" and draw(st.booleans()):
        messages.append({"role": "assistant", "content": draw(st.sampled_from(["", []]))})
    body = {"model": draw(st.sampled_from([MODEL, "default"])),
            "max_tokens": draw(st.integers(1, 40)), "messages": messages,
            "stream": draw(st.booleans())}
    optional = {
        "system": st.one_of(text, blocks(text, anthropic_extra)),
        "temperature": st.floats(0, 1), "top_p": st.floats(1e-9, 1).filter(lambda p: p > 0),
        "stop_sequences": st.lists(stop_text.filter(bool), max_size=3),
        "metadata": st.dictionaries(text, text, max_size=2),
        "snapshot_mode": st.sampled_from(["off", "triggered", "always"]), "steer": st.booleans(),
    }
    for key in draw(st.sets(st.sampled_from(sorted(optional)))):
        body[key] = draw(optional[key])
    return body


@st.composite
def openai_valid(draw) -> dict:
    n = draw(st.integers(1, 4))
    roles = st.sampled_from(["system", "developer", "user", "assistant"])
    messages = []
    for _ in range(n):
        message = {"role": draw(roles), "content": draw(st.one_of(text, blocks(text)))}
        if draw(st.integers(0, 4)) == 0:
            message["name"] = draw(text)
        messages.append(message)
    body = {"model": draw(st.sampled_from([MODEL, "default"])), "messages": messages,
            "stream": draw(st.booleans())}
    optional = {
        "max_tokens": st.integers(1, 40), "max_completion_tokens": st.integers(1, 40),
        "temperature": st.floats(0, 2), "top_p": st.floats(1e-9, 1).filter(lambda p: p > 0),
        "stop": st.one_of(stop_text.filter(bool), st.lists(stop_text.filter(bool), max_size=3)),
        "stream_options": st.fixed_dictionaries(
            {}, optional={"include_usage": st.booleans()}),
        "n": st.just(1), "seed": st.integers(-2**63, 2**64 - 1), "user": text,
        "snapshot_mode": st.sampled_from(["off", "triggered", "always"]), "steer": st.booleans(),
    }
    for key in draw(st.sets(st.sampled_from(sorted(optional)))):
        body[key] = draw(optional[key])
    return body


# Values that break one field: wrong types, out of range, huge, empty, surrogates.
bad_value = st.one_of(
    junk, st.sampled_from(["gpt-4o", "claude-3-5-sonnet", "fake-model ", "FAKE-MODEL"]),
    st.integers(-2**70, 0), st.integers(2**31, 2**80),
    st.sampled_from([0, -1, 1.5, 2.5, -0.0, 1e308, "", " ", "1", [], {}, [None], "nope",
                     "\ud800", 10**30, True, False]))


@st.composite
def broken(draw, valid) -> dict:
    """A valid body with one thing wrong (which may still be acceptable, e.g. an int for a
    float, or a wrong value that is also valid)."""
    body = json.loads(json.dumps(draw(valid)))  # deep copy
    how = draw(st.sampled_from(["field", "field", "drop", "unknown", "message", "block"]))
    if how == "field":
        body[draw(st.sampled_from(sorted(body)))] = draw(bad_value)
    elif how == "drop":
        del body[draw(st.sampled_from(sorted(body)))]
    elif how == "unknown":
        body[draw(st.sampled_from(["tools", "n_ctx", "foo", ""]))] = draw(junk)
    else:
        messages = body["messages"]
        i = draw(st.integers(0, len(messages) - 1))
        if how == "message":
            key = draw(st.sampled_from(["role", "content", "extra"]))
            messages[i][key] = draw(st.one_of(bad_value, st.sampled_from(
                ["system", "tool", "function", "developer", "user", "assistant", "USER"])))
        elif isinstance(messages[i]["content"], list) and messages[i]["content"]:
            block = messages[i]["content"][0]
            block[draw(st.sampled_from(["type", "text", "extra"]))] = draw(
                st.one_of(bad_value, st.sampled_from(["image", "tool_use", "text"])))
        else:
            messages[i]["content"] = draw(st.one_of(bad_value, st.just([{"type": "text"}])))
    return body


RAW = [b"", b" ", b"{", b"[]", b"null", b"42", b'"str"', b"{}", b'{"model": NaN}',
       b'{"model": "fake-model", "max_tokens": 1e400, "messages": []}',
       b'{"model": "fake-model", "temperature": Infinity}', b"\xff\xfe{}", b"\xc3(",
       b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b'{"\\udfff": 1}',
       b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
       b"\x00", "{\"model\": \"é\"}".encode("latin-1")]


def encode(body, how: str) -> bytes:
    if how == "ascii":
        return json.dumps(body).encode()
    if how == "utf8":  # lone surrogates go out as invalid UTF-8 bytes
        return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return json.dumps(body, indent=1, allow_nan=True).encode()


headers = st.fixed_dictionaries({}, optional={
    "x-sfcl-snapshot": st.sampled_from(["off", "triggered", "always", "ALWAYS ", "bogus", ""]),
    "anthropic-version": st.just("2023-06-01"),
    "content-type": st.sampled_from(["application/json", "text/plain",
                                     "application/x-www-form-urlencoded"]),
})


def request(valid):
    """(kind, body dict or None, raw bytes)."""
    how = st.sampled_from(["ascii", "ascii", "utf8", "pretty"])
    return st.one_of(
        st.tuples(valid, how).map(lambda bh: ("valid", bh[0], encode(*bh))),
        st.tuples(valid, how).map(lambda bh: ("valid", bh[0], encode(*bh))),
        st.tuples(valid, how).map(lambda bh: ("valid", bh[0], encode(*bh))),
        st.tuples(broken(valid), how).map(lambda bh: ("broken", bh[0], encode(*bh))),
        st.tuples(broken(valid), how).map(lambda bh: ("broken", bh[0], encode(*bh))),
        junk.map(lambda j: ("junk", None, json.dumps(j).encode())),
        st.one_of(st.sampled_from(RAW), st.binary(max_size=40)).map(lambda b: ("raw", None, b)))


reply = st.one_of(st.just(DEFAULT_REPLY),
                  st.lists(st.one_of(WORDS, text), max_size=8).map(" ".join))


# -- checks ---------------------------------------------------------------------------------------


def check_error(api: str, r) -> None:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:800])
    assert r.headers["content-type"].startswith("application/json"), r.headers
    body = r.json()
    if api == "anthropic":
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == anthropic_type_for(r.status_code), (r.status_code, body)
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    else:
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        err = body["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert err["type"] == "invalid_request_error", body
        assert err["param"] is None or isinstance(err["param"], str)
        assert err["code"] is None or isinstance(err["code"], str)


def expected_text(engine: FakeEngine, out: str, stop_reason: str, stop_seq: str | None,
                  stops: list[str], completion_tokens: int) -> None:
    """The text sent is the reply's tokens, cut where the engine stopped; never a stop string."""
    full = "".join(engine.tokens())
    assert full.startswith(out), (out, full)
    assert not any(s in out for s in stops), (out, stops)
    if stop_reason == "end_turn":
        assert out == full
    elif stop_reason == "stop_sequence":
        # (FakeEngine's stop check is crude: it cuts at the stop string but may already have
        # sent a token holding the stop's first characters; the real engine holds them back)
        assert stop_seq in stops and -1 < full.find(stop_seq) <= len(out), (out, stop_seq)
    else:
        assert stop_reason == "max_tokens" and out == "".join(engine.tokens()[:completion_tokens])


def anthropic_conversation(body: dict) -> tuple[list[dict], str | None]:
    """What /v1/messages must hand to encode_chat for an accepted body."""
    def join(content):
        return content if isinstance(content, str) else "\n".join(b["text"] for b in content)

    out: list[dict] = []
    messages = body["messages"]
    for i, m in enumerate(messages):
        t = join(m["content"])
        if i == len(messages) - 1 and m["role"] == "assistant":
            continue
        if out and out[-1]["role"] == m["role"]:
            out[-1]["content"] += "\n" + t
        else:
            out.append({"role": m["role"], "content": t})
    system = body.get("system")
    return out, (join(system) if system is not None else "") or None


def openai_conversation(body: dict) -> tuple[list[dict], None]:
    return [{"role": "system" if m["role"] == "developer" else m["role"],
             "content": m["content"] if isinstance(m["content"], str)
             else "\n".join(p["text"] for p in m["content"])} for m in body["messages"]], None


def check_anthropic_ok(engine: FakeEngine, body: dict, r) -> None:
    stops = body.get("stop_sequences") or []
    if r.headers["content-type"].startswith("text/event-stream"):
        assert body.get("stream")
        frames = parse_sse(r.text)
        names = [f["event"] for f in frames]
        data = [json.loads(f["data"]) for f in frames]
        assert all(d["type"] == n for d, n in zip(data, names)), names
        assert names[:3] == ["message_start", "content_block_start", "ping"], names
        assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"], names
        assert set(names[3:-3]) <= {"content_block_delta", "snapshot_triggered", "ping"}, names
        out = "".join(d["delta"]["text"] for d in data if d["type"] == "content_block_delta")
        delta = data[-2]
        stop_reason, stop_seq = delta["delta"]["stop_reason"], delta["delta"]["stop_sequence"]
        tokens = delta["usage"]["output_tokens"]
    else:
        msg = r.json()
        assert msg["type"] == "message" and msg["role"] == "assistant" and msg["model"] == MODEL
        out = "".join(b["text"] for b in msg["content"])
        stop_reason, stop_seq = msg["stop_reason"], msg["stop_sequence"]
        tokens = msg["usage"]["output_tokens"]
    assert tokens <= int(body["max_tokens"])
    expected_text(engine, out, stop_reason, stop_seq, stops, tokens)


def check_openai_ok(engine: FakeEngine, body: dict, r) -> None:
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if r.headers["content-type"].startswith("text/event-stream"):
        assert body.get("stream")
        frames = parse_sse(r.text)
        assert all(f["event"] is None for f in frames)
        assert frames[-1]["data"] == "[DONE]"
        chunks = [json.loads(f["data"]) for f in frames[:-1]]
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        with_choice = [c for c in chunks if c["choices"]]
        out = "".join(c["choices"][0]["delta"].get("content", "") for c in with_choice[1:])
        finish = [c["choices"][0]["finish_reason"] for c in with_choice]
        assert finish[-1] in ("stop", "length") and not any(finish[:-1])
        usage_chunks = [c for c in chunks if not c["choices"]]
        include = bool((body.get("stream_options") or {}).get("include_usage"))
        assert len(usage_chunks) == int(include)
        reason = finish[-1]
    else:
        resp = r.json()
        assert resp["object"] == "chat.completion" and resp["model"] == MODEL
        [choice] = resp["choices"]
        out, reason = choice["message"]["content"], choice["finish_reason"]
        assert resp["usage"]["total_tokens"] == (resp["usage"]["prompt_tokens"]
                                                 + resp["usage"]["completion_tokens"])
    full = "".join(engine.tokens())
    assert full.startswith(out) and not any(s in out for s in stops), (out, stops)
    assert reason in ("stop", "length")
    if reason == "stop" and not any(s in full for s in stops):
        assert out == full


def post(client, path: str, raw: bytes, hdrs: dict):
    return client.post(path, content=raw,
                       headers={"content-type": "application/json", **hdrs})


# -- tests ----------------------------------------------------------------------------------------


@FUZZ
@given(req=request(anthropic_valid()), hdrs=headers, reply_text=reply)
@example(req=("json", None, b'{"model": "fake-model", "max_tokens": 5, "messages": '
                            b'[{"role": "user", "content": "a\\u2028b"}], "stream": true}'),
         hdrs={}, reply_text="x\u2028y\r\nz \u0085 done")
def test_anthropic_messages_never_5xx(served, req, hdrs, reply_text):
    client, engine = served
    engine.reply, engine.encoded[:] = reply_text, []
    _kind, _body, raw = req
    r = post(client, A, raw, hdrs)
    SEEN[(A, r.status_code, r.headers.get("content-type", "").startswith("text/event-stream"))] += 1
    assert r.status_code < 500, (r.status_code, r.text[:800], raw[:300])
    if r.status_code != 200:
        check_error("anthropic", r)
        return
    body = json.loads(raw)
    check_anthropic_ok(engine, body, r)
    assert engine.encoded[-1] == anthropic_conversation(body)


@FUZZ
@given(req=request(openai_valid()), hdrs=headers, reply_text=reply)
def test_openai_chat_completions_never_5xx(served, req, hdrs, reply_text):
    client, engine = served
    engine.reply, engine.encoded[:] = reply_text, []
    _kind, _body, raw = req
    r = post(client, O, raw, hdrs)
    SEEN[(O, r.status_code, r.headers.get("content-type", "").startswith("text/event-stream"))] += 1
    assert r.status_code < 500, (r.status_code, r.text[:800], raw[:300])
    if r.status_code != 200:
        check_error("openai", r)
        return
    body = json.loads(raw)
    check_openai_ok(engine, body, r)
    assert engine.encoded[-1] == openai_conversation(body)


# -- the real chat template -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(lm):
    """The bundled model's tokenizer, as the server loads it (the session's ``lm`` fixture)."""
    tok = lm.tokenizer
    return SimpleNamespace(tokenizer=tok, unencodable=unencodable_bytes(tok))


def unencodable_bytes(tokenizer) -> set[int]:
    """Bytes the byte-level vocabulary has no token for: text holding them cannot survive the
    tokenizer (SmolLM2's lacks 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, and the lead bytes of
    U+40000-U+BFFFF), a property of the model's vocabulary, not of the server."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):  # GPT-2's bytes_to_unicode
        if b not in mapping:
            mapping[b], extra = chr(256 + extra), extra + 1
    vocab = tokenizer.get_vocab()
    return {b for b, ch in mapping.items() if ch not in vocab}


plain = st.text(st.characters(exclude_categories=["Cs"], max_codepoint=0x3FFFF), max_size=30)
conversation = st.lists(st.fixed_dictionaries({
    "role": st.sampled_from(["user", "assistant", "system"]), "content": plain}),
    min_size=1, max_size=4)


@FUZZ
@given(messages=conversation, system=st.one_of(st.none(), plain.filter(bool)))
def test_real_chat_template_keeps_every_turn(tokenizer, messages, system):
    """The engine's encode_chat (the tokenizer's template) takes any conversation the routes can
    produce, and the prompt it builds holds every turn's text, in order."""
    from sfcl.engine.async_engine import AsyncEngine

    assume(not any(tokenizer.unencodable.intersection(t.encode("utf-8"))
                   for t in [system or ""] + [m["content"] for m in messages]))
    ids = AsyncEngine.encode_chat(tokenizer, messages, system)
    tokenizer = tokenizer.tokenizer
    assert ids and all(isinstance(i, int) for i in ids)
    prompt = tokenizer.decode(ids, skip_special_tokens=False)
    pos = 0
    for m in ([{"content": system}] if system else []) + messages:
        at = prompt.find(m["content"], pos)
        assert at != -1, (m["content"], prompt)
        pos = at + len(m["content"])


SPECIAL = st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])


# Regression: encode_chat once tokenized the rendered template with special tokens enabled, so a
# client's '<|im_start|>' in message text became the control token (forged turns).
@settings(max_examples=10, deadline=None)
@given(before=plain, special=SPECIAL, after=plain)
def test_real_chat_template_message_text_cannot_forge_control_tokens(tokenizer, before, special,
                                                                      after):
    from sfcl.engine.async_engine import AsyncEngine

    user = {"role": "user", "content": before + special + after}
    clean = {"role": "user", "content": before + after}
    specials = set(tokenizer.tokenizer.all_special_ids)
    count = [sum(i in specials for i in AsyncEngine.encode_chat(tokenizer, [m]))
             for m in (user, clean)]
    assert count[0] == count[1]
