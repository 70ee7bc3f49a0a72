"""Error answers of both APIs: validation, model, context, busy, auth, unknown routes, 500s."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from sfcl.server import create_app
from sfcl.server.testing import FakeEngine, parse_sse, serve_in_thread

MODEL = "fake-model"
USER = [{"role": "user", "content": "hello there"}]
A, O = "/v1/messages", "/v1/chat/completions"


@pytest.fixture(scope="module")
def url():
    """One shared server with a default FakeEngine (max_model_len 32) for the validation cases."""
    with serve_in_thread(create_app(FakeEngine(max_model_len=32), ping_interval_s=0.1)) as u:
        yield u


@pytest.fixture
def serve():
    stack = contextlib.ExitStack()

    def _serve(engine: FakeEngine | None = None, **kwargs):
        engine = engine or FakeEngine()
        return stack.enter_context(serve_in_thread(create_app(engine, **kwargs))), engine

    with stack:
        yield _serve


def post(base: str, path: str, body=None, *, content: bytes | None = None, headers=None):
    if content is None:
        content = json.dumps(body).encode()
    return httpx.post(base + path, content=content, timeout=10,
                      headers={"content-type": "application/json", **(headers or {})})


def anthropic_error(r: httpx.Response, status: int, error_type: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}
    assert body["error"]["type"] == error_type
    return body["error"]["message"]


def openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    return err


def a_body(**kw):
    return {"model": MODEL, "max_tokens": 5, "messages": USER, **kw}


def o_body(**kw):
    return {"model": MODEL, "messages": USER, **kw}


# -- validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("content", [b'{"model": ', b"", b"[1, 2", b'{"max_tokens": NaN}'])
def test_bad_json(url, content):
    msg = anthropic_error(post(url, A, content=content), 400, "invalid_request_error")
    assert msg.startswith("body:")
    err = openai_error(post(url, O, content=content), 400, "body")
    assert err["type"] == "invalid_request_error" and err["code"] is None


def test_invalid_utf8_body(url):
    raw = b'{"model": "fake-model", "messages": [{"role": "user", "content": "\xff\xfe"}]}'
    assert "UTF-8" in anthropic_error(post(url, A, content=raw), 400, "invalid_request_error")
    assert "UTF-8" in openai_error(post(url, O, content=raw), 400, "body")["message"]


def test_body_not_an_object(url):
    """Names what was sent, not pydantic's "instance of ChatCompletionRequest" (new-user pass)."""
    msg = anthropic_error(post(url, A, [1, 2]), 400, "invalid_request_error")
    assert msg == "body: must be a JSON object, not a JSON array"
    err = openai_error(post(url, O, "hello"), 400, "body")
    assert err["message"] == "body: must be a JSON object, not a JSON string" and "Request" not in err["message"]


@pytest.mark.parametrize("body, expected", [
    ({"model": MODEL, "messages": USER}, "max_tokens: Field required"),
    (a_body(messages=[{"role": "bot", "content": "x"}]),
     "messages.0.role: Input should be 'user' or 'assistant'"),
    (a_body(messages=[]), "messages: at least one message is required"),
    (a_body(max_tokens=0), "max_tokens: Input should be greater than or equal to 1"),
    (a_body(temperature="hot"), "temperature: Input should be a valid number"),
    (a_body(temperature=1.5), "temperature: Input should be less than or equal to 1"),
    (a_body(top_p=0), "top_p: Input should be greater than 0"),
    (a_body(functions=[]), "functions: Extra inputs are not permitted"),
    (a_body(stop_sequences=[""]), "stop"),
    (a_body(snapshot_mode="sometimes"), "snapshot_mode: Input should be 'off', 'triggered'"),
    (a_body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages.0.content.0.type: Input should be 'text'"),
    (a_body(messages=[{"role": "user", "content": 5}]),
     "messages.0.content: Input should be a valid string"),
    (a_body(messages=[{"role": "user", "content": ""}]), "messages.0.content: all messages must"),
    (a_body(messages=[{"role": "user", "content": []}]), "messages.0.content: all messages must"),
    (a_body(messages=[{"role": "assistant", "content": "hi"}, *USER]),
     "messages.0.role: the first message must use the 'user' role"),
    (a_body(messages=[*USER, {"role": "assistant", "content": "Once"}]),
     "messages.1: a final assistant message (prefill) is not supported"),
    (a_body(system=7), "system: Input should be a valid string"),
])
def test_anthropic_validation(url, body, expected):
    msg = anthropic_error(post(url, A, body), 400, "invalid_request_error")
    assert msg.startswith(expected), msg


def test_empty_message_content_follows_each_routes_api(url):
    """Empty content: a 400 on /v1/messages (Anthropic's rule, above), accepted on /v1/chat/completions
    (OpenAI's API accepts it); both documented in docs/api.md."""
    empty = [{"role": "user", "content": ""}]
    anthropic_error(post(url, A, a_body(messages=empty)), 400, "invalid_request_error")
    r = post(url, O, o_body(messages=empty, max_tokens=3))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant", r.text


@pytest.mark.parametrize("body, param, expected", [
    ({"messages": USER}, "model", "model: Field required"),
    (o_body(messages=[{"role": "bot", "content": "x"}]), "messages.0.role",
     "messages.0.role: Input should be 'system', 'developer', 'user' or 'assistant'"),
    (o_body(messages=[]), "messages", "messages: at least one message is required"),
    (o_body(max_tokens=0), "max_tokens", "max_tokens: Input should be greater than or equal to 1"),
    (o_body(temperature="hot"), "temperature", "temperature: Input should be a valid number"),
    (o_body(temperature=2.5), "temperature", "temperature: Input should be less than or equal"),
    (o_body(n=2), "n", "n: only n=1 is supported"),
    (o_body(stop=["ok", ""]), "stop", "stop: stop sequences must be non-empty"),
    (o_body(functions=[]), "functions", "functions: Extra inputs are not permitted"),
    (o_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
     "messages.0.content.0.type", "messages.0.content.0.type: Input should be 'text'"),
])
def test_openai_validation(url, body, param, expected):
    err = openai_error(post(url, O, body), 400, param)
    assert err["message"].startswith(expected), err["message"]
    assert err["type"] == "invalid_request_error"


def test_invalid_snapshot_header(url):
    h = {"x-sfcl-snapshot": "sometimes"}
    msg = anthropic_error(post(url, A, a_body(), headers=h), 400, "invalid_request_error")
    assert msg.startswith("x-sfcl-snapshot: invalid value 'sometimes'")
    err = openai_error(post(url, O, o_body(), headers=h), 400, "x-sfcl-snapshot")
    assert "off, triggered, always" in err["message"]


def test_unknown_model(url):
    msg = anthropic_error(post(url, A, a_body(model="claude-9")), 404, "not_found_error")
    assert "claude-9" in msg and msg.startswith("model:")
    err = openai_error(post(url, O, o_body(model="gpt-9")), 404, "model")
    assert err["code"] == "model_not_found" and "gpt-9" in err["message"]
    assert post(url, A, a_body(model="default")).status_code == 200


def test_prompt_too_long(url):
    long = [{"role": "user", "content": "word " * 40}]  # 42 tokens > 32
    msg = anthropic_error(post(url, A, a_body(messages=long)), 400, "invalid_request_error")
    assert msg.startswith("messages: prompt is too long: 42 tokens")
    # 4 prompt tokens + 30 > 32
    msg = anthropic_error(post(url, A, a_body(max_tokens=30)), 400, "invalid_request_error")
    assert msg.startswith("max_tokens: input length and `max_tokens` exceed context limit: 4 + 30")
    msg = anthropic_error(post(url, A, a_body(max_tokens=100)), 400, "invalid_request_error")
    assert msg.startswith("max_tokens: 100 > 32")
    err = openai_error(post(url, O, o_body(messages=long)), 400, "messages")
    assert err["code"] == "context_length_exceeded"
    err = openai_error(post(url, O, o_body(max_tokens=30)), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("template, field", [
    ('{"model": "fake-model", "max_tokens": 5, "messages": [{"role": "user", "content": "a \\ud800 b"}]}',
     "messages.0.content"),
    ('{"model": "fake-model\\udfff", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}',
     "model"),
    ('{"model": "fake-model", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages.0.content.0.text"),
    ('{"model": "fake-model", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "%s": ["\\udc00"]}',
     "%s.0"),
])
def test_lone_surrogates_are_400_naming_the_field(url, template, field):
    """json.loads accepts "\ud800" escapes; they used to reach the tokenizer / the error encoder
    and come back as a 500."""
    for path, stop in ((A, "stop_sequences"), (O, "stop")):
        raw = (template % stop if "%s" in template else template).encode()
        want = field % stop if "%s" in field else field
        r = post(url, path, content=raw)
        if path == A:
            msg = anthropic_error(r, 400, "invalid_request_error")
        else:
            msg = openai_error(r, 400, want)["message"]
        assert msg.startswith(f"{want}: string contains a lone UTF-16 surrogate"), msg
    # a valid pair is fine
    ok = '{"model": "fake-model", "max_tokens": 5, "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert post(url, A, content=ok.encode()).status_code == 200


def test_lone_surrogate_in_a_key_and_in_an_echoed_message(url):
    raw = b'{"model": "fake-model", "max_tokens": 5, "messages": [], "\\ud800x": 1}'
    err = openai_error(post(url, O, content=raw), 400, "\\ud800x")
    assert "surrogate" in err["message"]
    from sfcl.server.errors import ApiError, error_body  # never a UnicodeEncodeError on output
    body = error_body(ApiError(404, "model: x\ud800", param="m\udc00"), "openai")
    assert body["error"]["message"] == "model: x\\ud800" and body["error"]["param"] == "m\\udc00"
    json.dumps(body, ensure_ascii=False).encode("utf-8")


def test_deeply_nested_json(url):
    raw = b"[" * 100_000 + b"]" * 100_000
    assert "nested too deeply" in anthropic_error(post(url, A, content=raw), 400,
                                                  "invalid_request_error")
    openai_error(post(url, O, content=raw), 400, "body")


def test_seed_out_of_range(serve):
    url, engine = serve()
    for seed in (2**64, -2**63 - 1, 10**30):
        err = openai_error(post(url, O, o_body(seed=seed, max_tokens=3)), 400, "seed")
        assert err["message"].startswith("seed: must be an integer in")
    for seed in (2**64 - 1, -2**63, -1, 0):
        assert post(url, O, o_body(seed=seed, max_tokens=3)).status_code == 200
    assert [r.params.seed for r in engine.requests] == [2**64 - 1, -2**63, -1, 0]


def test_tiny_temperature_and_top_p_are_clamped_to_their_greedy_limit(serve):
    """0 < temperature < 1e-5 (and top_p < 1e-6) broke the sampler's float32 math: the engine step
    failed for every request in the batch. They are sampled as their greedy limit instead."""
    from sfcl.server.parsing import MIN_TOP_P
    url, engine = serve()
    assert post(url, O, o_body(temperature=1e-320, max_tokens=3)).status_code == 200
    assert post(url, A, a_body(temperature=5e-324)).status_code == 200
    assert post(url, A, a_body(temperature=0.5, top_p=1e-320)).status_code == 200
    assert post(url, O, o_body(temperature=0.5, top_p=0.3, max_tokens=3)).status_code == 200
    got = [(r.params.temperature, r.params.top_p) for r in engine.requests]
    assert got == [(0.0, 1.0), (0.0, 1.0), (0.5, MIN_TOP_P), (0.5, 0.3)]


def test_anthropic_empty_stop_sequence_names_stop_sequences(url):
    msg = anthropic_error(post(url, A, a_body(stop_sequences=["x", ""])), 400,
                          "invalid_request_error")
    assert msg == "stop_sequences: stop sequences must be non-empty strings"


class BlockedEncodeEngine(FakeEngine):
    """Tokenizing a prompt holding "slow" waits until the test releases it (a huge prompt)."""

    def __init__(self):
        super().__init__()
        self.started, self.release = threading.Event(), threading.Event()

    def encode_chat(self, messages, system=None):
        if "slow" in messages[-1]["content"]:
            self.started.set()
            self.release.wait(30)
        return super().encode_chat(messages, system)


def test_tokenizing_does_not_block_the_event_loop(serve):
    """While one request's prompt is being tokenized, /health and another request are answered: the
    tokenization is held until they are, so were it on the event loop they would time out."""
    engine = BlockedEncodeEngine()
    url, _ = serve(engine)
    slow = [{"role": "user", "content": "slow"}]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post, url, A, a_body(messages=slow))
        try:
            assert engine.started.wait(10)
            assert httpx.get(url + "/health", timeout=10).status_code == 200
            assert post(url, O, o_body(max_tokens=3)).status_code == 200
        finally:
            engine.release.set()
        assert fut.result().status_code == 200


# -- busy, engine errors, 500s --------------------------------------------------------------

def test_a_generation_cut_as_overloaded_keeps_the_engines_message(serve):
    """An overloaded_error that ends a started generation (the graceful-shutdown deadline) is
    answered as "overloaded" with the engine's words, not the queue-full message (a tester's find)."""
    url, _ = serve(FakeEngine(error_after=2, error_type="overloaded_error",
                              error_message="the server is shutting down; retry the request"))
    assert anthropic_error(post(url, A, a_body()), 529, "overloaded_error") == \
        "the server is shutting down; retry the request"
    err = openai_error(post(url, O, o_body()), 429)
    assert err["code"] == "overloaded" and err["message"] == "the server is shutting down; retry the request"


def test_busy(serve):
    url, _ = serve(FakeEngine(busy=True, retry_after_s=2))
    r = post(url, A, a_body())
    assert anthropic_error(r, 529, "overloaded_error") == "Overloaded"
    assert r.headers["retry-after"] == "2"
    r = post(url, A, a_body(stream=True))
    anthropic_error(r, 529, "overloaded_error")
    r = post(url, O, o_body(stream=True))
    openai_error(r, 429)
    assert r.headers["retry-after"] == "2"
    with anthropic.Anthropic(base_url=url, api_key="k", max_retries=0) as c, \
            pytest.raises(anthropic.APIStatusError) as exc:
        c.messages.create(model=MODEL, max_tokens=5, messages=USER)
    assert exc.value.status_code == 529
    with openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as c, \
            pytest.raises(openai.RateLimitError):
        c.chat.completions.create(model=MODEL, messages=USER)


class ExplodingEngine(FakeEngine):
    def encode_chat(self, messages, system=None):
        if "boom" in messages[-1]["content"]:
            raise RuntimeError("secret internal detail")
        if "bad" in messages[-1]["content"]:
            raise ValueError("Conversation roles must alternate")
        return super().encode_chat(messages, system)


class BrokenStreamEngine(FakeEngine):
    async def _run(self, prompt_ids, params, request_id):
        async for ev in super()._run(prompt_ids, params, request_id):
            yield ev
            if type(ev).__name__ == "TextDelta" and ev.token_index == 2:
                raise RuntimeError("secret internal detail")


def test_unexpected_exceptions_are_500_without_traceback(serve):
    url, _ = serve(ExplodingEngine())
    boom = [{"role": "user", "content": "boom"}]
    r = post(url, A, a_body(messages=boom))
    assert anthropic_error(r, 500, "api_error") == "Internal server error"
    assert "secret" not in r.text and "Traceback" not in r.text
    err = openai_error(post(url, O, o_body(messages=boom)), 500)
    assert err["type"] == "server_error" and "secret" not in err["message"]
    bad = [{"role": "user", "content": "bad"}]
    msg = anthropic_error(post(url, A, a_body(messages=bad)), 400, "invalid_request_error")
    assert msg == "messages: Conversation roles must alternate"


def test_exception_mid_stream_becomes_error_event(serve):
    url, _ = serve(BrokenStreamEngine())
    r = post(url, A, a_body(max_tokens=20, stream=True))
    frames = parse_sse(r.text)
    assert frames[-1]["event"] == "error"
    assert json.loads(frames[-1]["data"])["error"] == {"type": "api_error",
                                                       "message": "Internal server error"}
    r = post(url, O, o_body(stream=True))
    last = json.loads(parse_sse(r.text)[-1]["data"])
    assert last["error"]["type"] == "server_error" and "secret" not in r.text


def test_unknown_route_and_method(url):
    r = httpx.get(url + "/v2/nothing")
    assert openai_error(r, 404)["message"] == "Not found: GET /v2/nothing"
    r = httpx.get(url + "/v2/nothing", headers={"anthropic-version": "2023-06-01"})
    anthropic_error(r, 404, "not_found_error")
    anthropic_error(httpx.get(url + A), 405, "invalid_request_error")
    openai_error(httpx.get(url + O), 405)


def test_a_trailing_slash_is_a_404_naming_the_route(url):
    """A POST: not a bodiless 307 redirect (FastAPI's default), which clients do not follow for a POST."""
    msg = anthropic_error(post(url, A + "/", a_body()), 404, "not_found_error")
    assert msg == f"Not found: POST {A}/ (no trailing slash: POST {A})"
    assert openai_error(post(url, O + "/", o_body()), 404)["message"].endswith(f"(no trailing slash: POST {O})")
    assert openai_error(httpx.get(url + "/v2/nothing/"), 404)["message"] == "Not found: GET /v2/nothing/"
    r = httpx.get(url + "/health/?x=1")  # a GET (a browser's) is still redirected
    assert r.status_code == 307 and r.headers["location"] == url + "/health?x=1"


# -- API key --------------------------------------------------------------------------------

def test_api_key(serve):
    url, _ = serve(api_key="sekrit")
    for headers in ({}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}):
        anthropic_error(post(url, A, a_body(), headers=headers), 401, "authentication_error")
        err = openai_error(post(url, O, o_body(), headers=headers), 401)
        assert err["code"] == "invalid_api_key"
    # auth is checked before the body is parsed
    anthropic_error(post(url, A, content=b"{"), 401, "authentication_error")
    for headers in ({"x-api-key": "sekrit"}, {"authorization": "Bearer sekrit"}):
        assert post(url, A, a_body(), headers=headers).status_code == 200
        assert post(url, O, o_body(), headers=headers).status_code == 200
    with anthropic.Anthropic(base_url=url, api_key="sekrit", max_retries=0) as c:
        assert c.messages.create(model=MODEL, max_tokens=3, messages=USER).content
    with anthropic.Anthropic(base_url=url, api_key="nope", max_retries=0) as c, \
            pytest.raises(anthropic.AuthenticationError):
        c.messages.create(model=MODEL, max_tokens=3, messages=USER)
    with openai.OpenAI(base_url=url + "/v1", api_key="sekrit", max_retries=0) as c:
        assert c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3).choices
    with openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0) as c, \
            pytest.raises(openai.AuthenticationError):
        c.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert httpx.get(url + "/health").status_code == 200


def test_request_tag_header_reaches_the_engine_and_bad_tags_are_400(serve):
    base, eng = serve()
    r = post(base, "/v1/messages", a_body(), headers={"x-sfcl-tag": "high-risk"})
    assert r.status_code == 200
    r = post(base, "/v1/chat/completions", o_body(), headers={"x-sfcl-tag": "high-risk"})
    assert r.status_code == 200
    assert [q.params.tag for q in eng.requests] == ["high-risk", "high-risk"]
    r = post(base, "/v1/messages", a_body(), headers={"x-sfcl-tag": "no spaces allowed"})
    assert "x-sfcl-tag" in anthropic_error(r, 400, "invalid_request_error")
    r = post(base, "/v1/chat/completions", o_body(), headers={"x-sfcl-tag": "x" * 65})
    assert openai_error(r, 400, "x-sfcl-tag")


@pytest.mark.parametrize("header", ["x-sfcl-steer", "x-sfcl-snapshot", "x-sfcl-tag"])
def test_an_empty_sfcl_header_is_400_naming_it(url, header):
    """An empty SFCL header is refused on both APIs, naming it: before, an empty x-sfcl-steer was read
    as "off", and overrode the body's ``steer``, while the other two were 400s. (A blank one cannot be
    sent: HTTP trims a field value's surrounding whitespace, and httpx refuses it.)"""
    msg = anthropic_error(post(url, A, a_body(), headers={header: ""}), 400, "invalid_request_error")
    assert msg.startswith(header), msg
    openai_error(post(url, O, o_body(), headers={header: ""}), 400, header)
    msg = anthropic_error(post(url, A, a_body(steer=""), headers={}), 400, "invalid_request_error")
    assert msg.startswith("steer: invalid value ''"), msg


@pytest.mark.parametrize("value", [5, 1, 2.5, {"source": True}, [1, 2]])
def test_steer_of_the_wrong_json_type_names_the_accepted_values(url, value):
    """BUG: ``"steer": 5`` got pydantic's "Input should be a valid boolean", which does not say
    what steer accepts (found by a new-user check)."""
    msg = anthropic_error(post(url, A, a_body(steer=value)), 400, "invalid_request_error")
    assert msg.startswith("steer: invalid value") and "'source'" in msg and "'+' combination" in msg, msg
    err = openai_error(post(url, O, o_body(steer=value)), 400, "steer")
    assert "'source'" in err["message"], err["message"]
    assert post(url, A, a_body(steer="source+cad")).status_code == 200  # the server keeps serving
    assert post(url, O, o_body(steer=None)).status_code == 200  # null: the default, no steering


@pytest.mark.parametrize("field,value", [("max_tokens", True), ("max_tokens", "10"), ("max_tokens", 2.0),
                                         ("temperature", True), ("temperature", "0.5"), ("top_p", False),
                                         ("stream", "yes"), ("stream", 1), ("ignore_eos", "true")])
def test_scalar_fields_of_the_wrong_json_type_are_400_naming_the_field(url, field, value):
    """BUG: pydantic's lax mode read ``"max_tokens": true`` as 1 (200, one token) and ``"10"`` /
    ``2.0`` as 10 / 2 (found by a new-user check; docs/api.md promises a 4xx naming the field)."""
    msg = anthropic_error(post(url, A, a_body(**{field: value})), 400, "invalid_request_error")
    assert field in msg, msg
    openai_error(post(url, O, o_body(**{field: value})), 400, field)
    # the JSON types themselves still pass, an integer where a number is asked for included
    assert post(url, A, a_body(temperature=0, top_p=1, max_tokens=3, stream=False)).status_code == 200
    assert post(url, O, o_body(temperature=1, top_p=1, max_tokens=3, seed=7)).status_code == 200


# -- resource limits (break-it report s18) --------------------------------------------------

def test_stop_sequences_are_capped_in_count_and_length(url):
    """BUG: 1M stop strings were accepted; the engine thread checks each one per generated token,
    which slowed every stream in the batch 3.5x. Both APIs share one cap (check_stop)."""
    from sfcl.engine.request import MAX_STOP_CHARS, MAX_STOP_SEQUENCES
    many = [f"s{i}" for i in range(MAX_STOP_SEQUENCES + 1)]
    long = "x" * (MAX_STOP_CHARS + 1)
    msg = anthropic_error(post(url, A, a_body(stop_sequences=many)), 400, "invalid_request_error")
    assert msg == f"stop_sequences: at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(many)}"
    msg = anthropic_error(post(url, A, a_body(stop_sequences=["ok", long])), 400, "invalid_request_error")
    assert msg.startswith(f"stop_sequences: stop sequence 1 has {len(long)} characters; at most {MAX_STOP_CHARS}")
    assert openai_error(post(url, O, o_body(stop=many)), 400, "stop")["message"].startswith("stop: at most")
    assert openai_error(post(url, O, o_body(stop=long)), 400, "stop")["message"].startswith("stop: stop sequence 0")
    # the limits themselves are fine
    at_cap = [f"s{i}" for i in range(MAX_STOP_SEQUENCES - 1)] + ["y" * MAX_STOP_CHARS]
    assert post(url, A, a_body(stop_sequences=at_cap)).status_code == 200
    assert post(url, O, o_body(stop=at_cap, max_tokens=3)).status_code == 200


def _parse_ran_on_the_loop(monkeypatch) -> list[bool]:
    """Record, for each request body validated from now on, whether it ran on an event loop."""
    import asyncio

    from sfcl.server import parsing
    seen: list[bool] = []
    real = parsing.parse_model

    def spy(model_cls, data):
        try:
            asyncio.get_running_loop()
            seen.append(True)
        except RuntimeError:
            seen.append(False)
        return real(model_cls, data)

    monkeypatch.setattr(parsing, "parse_model", spy)
    return seen


def test_large_bodies_are_decoded_and_validated_off_the_event_loop(url, monkeypatch):
    """BUG: json.loads, the surrogate scan and pydantic ran on the event loop: a 25 MB body stalled
    /health and every open stream for ~5 s. Bodies over OFF_LOOP_BYTES go to a worker thread (the
    same errors come back); small ones stay on the loop."""
    from sfcl.server.parsing import OFF_LOOP_BYTES
    seen = _parse_ran_on_the_loop(monkeypatch)
    assert post(url, A, a_body()).status_code == 200
    big = [{"role": "user", "content": "x" * OFF_LOOP_BYTES}, {"role": "user", "content": 5}]  # within the window's count
    assert len(json.dumps(a_body(messages=big))) > OFF_LOOP_BYTES
    msg = anthropic_error(post(url, A, a_body(messages=big)), 400, "invalid_request_error")
    assert msg.startswith(f"messages.{len(big) - 1}.content:"), msg
    openai_error(post(url, O, o_body(messages=big)), 400, f"messages.{len(big) - 1}.content")
    assert seen == [True, False, False]
    # the body's own errors are the same off the loop: bad JSON, a lone surrogate
    padding = " " * OFF_LOOP_BYTES
    assert anthropic_error(post(url, A, content=b'{"model": ' + padding.encode()), 400,
                           "invalid_request_error").startswith("body: invalid JSON")
    raw = f'{{"model": "fake-model", "max_tokens": 5, "messages": [{{"role": "user", "content": "\\ud800"}}]{padding}}}'
    assert "lone UTF-16 surrogate" in openai_error(post(url, O, content=raw.encode()), 400,
                                                   "messages.0.content")["message"]


def test_large_body_does_not_stall_health(url, monkeypatch):
    """The event loop keeps answering while a multi-megabyte body is decoded: the decode is held
    until /health has answered, so were it on the loop /health would time out. (How long one
    ``json.loads`` holds the GIL is a speed matter, not this test's.)"""
    from sfcl.server import parsing
    started, release = threading.Event(), threading.Event()
    real = parsing.decode_json

    def held(raw):
        started.set()
        release.wait(30)
        return real(raw)

    monkeypatch.setattr(parsing, "decode_json", held)
    big = json.dumps(a_body(messages=[{"role": "user", "content": "x"}] * 400_000
                                     + [{"role": "user", "content": 5}])).encode()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(post, url, A, content=big)
        try:
            assert started.wait(30)
            assert httpx.get(url + "/health", timeout=10).status_code == 200
        finally:
            release.set()
        assert fut.result().status_code == 400


def test_prompt_certainly_longer_than_the_window_is_rejected_before_tokenizing(serve):
    """BUG: a 10 MB prompt was tokenized (~10 s of CPU) before the context check rejected it.
    With a bound of 4 characters per token, 200 characters are at least 50 tokens > 32."""
    url, engine = serve(FakeEngine(max_model_len=32, max_token_chars=4))
    long = [{"role": "user", "content": "y" * 200}]
    msg = anthropic_error(post(url, A, a_body(messages=long)), 400, "invalid_request_error")
    assert msg == "messages: prompt is too long: at least 50 tokens > 31 maximum"
    err = openai_error(post(url, O, o_body(messages=long)), 400, "messages")
    assert err["code"] == "context_length_exceeded" and "at least 50 tokens" in err["message"]
    msg = anthropic_error(post(url, A, a_body(messages=[{"role": "user", "content": "y" * 100}],
                                              system="z" * 28)), 400, "invalid_request_error")
    assert "at least 32 tokens" in msg  # the system prompt counts too
    assert engine.encoded == []  # none of them was tokenized
    # under the bound: tokenized and checked as before (one word token here)
    assert post(url, A, a_body(messages=[{"role": "user", "content": "y" * 120}])).status_code == 200
    assert len(engine.encoded) == 1


def test_client_disconnect_during_upload_is_logged_as_499_without_traceback(serve, caplog):
    """BUG: a client that left while sending its body (Content-Length 500, 13 bytes sent) was
    logged as a 500 "unhandled error" with a ~50-line traceback (starlette's ClientDisconnect)."""
    import logging
    import socket
    from urllib.parse import urlsplit

    caplog.set_level(logging.INFO, logger="sfcl.requests")
    url, engine = serve()
    host, port = urlsplit(url).hostname, urlsplit(url).port
    for path in (O, A):
        with socket.create_connection((host, port)) as sock:
            sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: 500\r\n\r\n{{\"model\":\"x\"}}".encode())
            time.sleep(0.2)
    deadline = time.monotonic() + 5
    lines: list[dict] = []
    while len(lines) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "sfcl.requests"]
    assert [(line["route"], line["status"], line["error"]) for line in lines] == [
        (O, 499, "client_closed"), (A, 499, "client_closed")]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "Traceback" not in caplog.text and engine.requests == []
    assert post(url, O, o_body(max_tokens=3)).status_code == 200  # the server is fine


def test_error_messages_clip_the_values_they_quote(url):
    """BUG: ``"steer": "source+" * 2000000`` got a 400 whose message quoted the 14 MB value in
    full. Quoted values are clipped to QUOTE_CHARS (sfcl.text.quote), keys and model names too."""
    from sfcl.text import QUOTE_CHARS
    r = post(url, A, a_body(steer="source+" * 200_000))
    msg = anthropic_error(r, 400, "invalid_request_error")
    assert msg.startswith("steer: invalid value 'source+source+") and "…; expected true, false" in msg
    assert len(r.content) < 600
    err = openai_error(post(url, O, o_body(steer=["cad"] * 100_000 + ["nope"])), 400, "steer")
    assert len(err["message"]) < 400
    err = openai_error(post(url, O, o_body(model="m" * 100_000)), 404, "model")
    assert "m" * QUOTE_CHARS + "…" in err["message"] and len(err["message"]) < 300
    msg = anthropic_error(post(url, A, a_body(model="m" * 100_000)), 404, "not_found_error")
    assert len(msg) < 300
    key = "k" * 100_000
    err = openai_error(post(url, O, {**o_body(), key: 1}), 400)
    assert err["param"] == "k" * QUOTE_CHARS + "…" and len(err["message"]) < 300
    raw = '{"model": "fake-model", "max_tokens": 5, "messages": [], "%s\\ud800": 1}' % key
    err = openai_error(post(url, O, content=raw.encode()), 400)
    assert len(err["param"]) == QUOTE_CHARS + 1 and "surrogate" in err["message"]
    r = httpx.get(url + "/" + "p" * 10_000, timeout=10)
    assert r.status_code == 404 and len(r.content) < 400
    r = httpx.get(url + "/v1/models/" + "m" * 5_000, timeout=10)  # the model id is clipped too
    assert r.status_code == 404 and len(r.content) < 400


def test_more_messages_than_the_window_has_tokens_are_refused_before_validation(url, monkeypatch):
    """BUG: ~600,000 messages in a 25 MB body spent ~1.5 s in pydantic (holding the GIL, off the event
    loop or not) before any answer; every message takes at least one token, so more messages than
    the window (32 tokens here) cannot fit and are refused on their count."""
    from sfcl.server import parsing
    validated = []
    real = parsing.parse_model
    monkeypatch.setattr(parsing, "parse_model", lambda *a: validated.append(1) or real(*a))
    many = USER * 33
    msg = anthropic_error(post(url, A, a_body(messages=many)), 400, "invalid_request_error")
    assert msg == "messages: 33 messages cannot fit the context window of 32 tokens (each message takes at least one token)"
    assert openai_error(post(url, O, o_body(messages=many)), 400, "messages")["message"].startswith("messages: 33")
    assert validated == []
    assert post(url, A, a_body(messages=[{"role": "user", "content": "hi"}])).status_code == 200
    assert validated == [1]


def test_health_answers_head(url):
    r = httpx.head(url + "/health", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"


def test_openapi_schema_builds_without_warnings():
    """GET and HEAD /health on one route gave FastAPI's "Duplicate Operation ID" warning on every
    /openapi.json (in the server's stderr)."""
    import warnings

    app = create_app(FakeEngine())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = app.openapi()
    assert set(schema["paths"]["/health"]) == {"get"}


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://127.0.0.1:1", "https://127.0.0.1", "not a url",
                                    "http://evil.example\\@127.0.0.1:{port}", "http://127.0.0.1:{port}/x"])
def test_a_browsers_request_from_another_origin_is_refused(url, origin):
    """A web page can POST to a local server without an API key with no preflight (a body of no content
    type, or text/plain): a request whose Origin is not the server's own is refused (403) in the route's
    format before its body is read, on both generation routes and the admin reload. An Origin is only
    ``scheme://host[:port]``: user info (which ``urlsplit`` reads the host after) or a path do not pass."""
    headers = {"origin": origin.format(port=url.rsplit(":", 1)[1])}
    msg = anthropic_error(post(url, A, a_body(), headers=headers), 403, "permission_error")
    assert msg.startswith("cross-origin request refused")
    assert openai_error(post(url, O, o_body(), headers=headers), 403)["code"] == "cross_origin"
    r = httpx.post(url + O, content=json.dumps(o_body()).encode(), headers=headers, timeout=10)  # no content type
    openai_error(r, 403)
    openai_error(httpx.post(url + "/admin/anchors/reload", headers=headers, timeout=10), 403)


def test_a_second_origin_header_is_refused(url):
    r = httpx.post(url + O, content=json.dumps(o_body()).encode(), timeout=10,
                   headers=[("content-type", "application/json"), ("origin", url), ("origin", "http://evil.example")])
    openai_error(r, 403)


def test_a_same_origin_request_and_one_without_origin_are_served(url):
    port = url.rsplit(":", 1)[1]  # serve_in_thread's URL: http://127.0.0.1:PORT
    for headers in ({}, {"origin": url}, {"origin": f"http://LocalHost:{port}", "host": f"localhost:{port}"},
                    {"origin": "http://127.0.0.1", "host": "127.0.0.1:80"}):
        r = post(url, O, o_body(max_tokens=2), headers=headers)
        assert r.status_code == 200, (headers, r.text)


def test_a_page_on_a_domain_name_needs_the_api_key(serve):
    """DNS rebinding: a page at rebind.example points its name at 127.0.0.1 after it loaded, and the browser
    sends that name as both Origin and Host, same-origin by the headers. A server without an API key serves
    browser pages only from localhost or an IP address; with a key (which such a page does not have) a page
    on a domain name is served, also behind a proxy that rewrites Host (X-Forwarded-Host)."""
    url, _ = serve()
    port = url.rsplit(":", 1)[1]
    rebind = {"origin": f"http://rebind.example:{port}", "host": f"rebind.example:{port}"}
    msg = anthropic_error(post(url, A, a_body(), headers=rebind), 403, "permission_error")
    assert "DNS rebinding" in msg and "--api-key" in msg
    openai_error(post(url, O, o_body(), headers=rebind), 403)
    openai_error(httpx.post(url + "/admin/anchors/reload", headers=rebind, timeout=10), 403)
    url, _ = serve(api_key="k")
    port = url.rsplit(":", 1)[1]
    for headers in ({"origin": f"http://rebind.example:{port}", "host": f"rebind.example:{port}"},
                    {"origin": "https://app.example", "x-forwarded-host": "app.example"}):
        r = post(url, O, o_body(max_tokens=2), headers={**headers, "x-api-key": "k"})
        assert r.status_code == 200, (headers, r.text)
    openai_error(post(url, O, o_body(), headers={"origin": "http://evil.example", "x-api-key": "k"}), 403)


def test_anchor_reload_body_must_be_json(serve):
    """A browser may POST text/plain or a form to another origin without a preflight: a reload body
    in any other content type is refused before it is read as JSON (415)."""
    url, _ = serve()
    body = json.dumps({"path": "/tmp/lib"}).encode()
    r = httpx.post(url + "/admin/anchors/reload", content=body, headers={"content-type": "text/plain"}, timeout=10)
    assert openai_error(r, 415, "body")["message"].startswith("body: expected content-type application/json")
    r = httpx.post(url + "/admin/anchors/reload", content=body, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 404  # past the check: this engine cannot reload
    assert httpx.post(url + "/admin/anchors/reload", timeout=10).status_code == 404  # no body: no content type needed


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"])
def test_generation_body_in_a_non_json_content_type_is_refused_in_the_routes_format(url, ctype):
    """A web page may POST text/plain, a form or multipart to a local server on another origin without a
    CORS preflight: generation bodies in those content types are refused before they are read (415, as
    FastAPI's JSON bodies since 0.65.2), in each route's own error format."""
    r = post(url, A, a_body(), headers={"content-type": ctype})
    assert anthropic_error(r, 415, "invalid_request_error").startswith(
        f"body: expected content-type application/json, got {ctype.split(';')[0]}")
    openai_error(post(url, O, o_body(), headers={"content-type": ctype}), 415, "body")


@pytest.mark.parametrize("ctype", [";;;", "; application/json", "application/+json", "application/jsonx", "text/json"])
def test_generation_body_in_an_empty_or_near_json_media_type_is_refused(url, ctype):
    r = post(url, O, o_body(), headers={"content-type": ctype})
    openai_error(r, 415, "body")


def test_a_second_content_type_header_must_be_json_too(url):
    """Starlette's ``headers.get`` reads the first of two headers: a second, non-JSON one passed."""
    body = json.dumps(o_body(max_tokens=2)).encode()
    for first, second in (("application/json", "text/plain"), ("", "text/plain")):
        r = httpx.post(url + O, content=body, headers=[("content-type", first), ("content-type", second)], timeout=10)
        openai_error(r, 415, "body")
    r = httpx.post(url + O, content=body, timeout=10,
                   headers=[("content-type", "application/json"), ("content-type", "application/json; charset=utf-8")])
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("ctype", [None, "application/json", "Application/JSON; charset=utf-8", "application/vnd.api+json"])
def test_generation_body_in_json_or_no_content_type_is_read(url, ctype):
    headers = {} if ctype is None else {"content-type": ctype}
    r = httpx.post(url + O, content=json.dumps(o_body(max_tokens=2)).encode(), headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"


@pytest.mark.parametrize("path, fields", [
    (O, {"presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "top_logprobs": 0, "logit_bias": {},
         "response_format": {"type": "text"}, "tools": [], "tool_choice": "none", "parallel_tool_calls": True,
         "metadata": {"k": "v"}, "store": False, "service_tier": "auto"}),
    (A, {"tools": [], "tool_choice": {"type": "none"}, "thinking": {"type": "disabled"}, "service_tier": "auto",
         "metadata": {"user_id": "u"}}),
])
def test_fields_without_a_feature_are_accepted_at_their_neutral_values(url, path, fields):
    """Clients and frameworks send some fields with their defaults (``presence_penalty: 0``,
    ``tools: []``): a 400 "Extra inputs are not permitted" for those broke them (a tester)."""
    body = o_body(max_tokens=3, **fields) if path == O else a_body(**fields)
    assert post(url, path, body).status_code == 200


@pytest.mark.parametrize("field, value, says", [
    ("presence_penalty", 0.5, "no repetition penalty"),
    ("frequency_penalty", -1, "no repetition penalty"),
    ("logprobs", True, "log probabilities"),
    ("top_logprobs", 3, "log probabilities"),
    ("logit_bias", {"50256": -100}, "logit bias"),
    ("response_format", {"type": "json_object"}, "no JSON mode"),
    ("tools", [{"type": "function", "function": {"name": "f"}}], "tool use"),
    ("tool_choice", "auto", "tool use"),
])
def test_openai_fields_without_a_feature_are_400_when_set(url, field, value, says):
    err = openai_error(post(url, O, o_body(max_tokens=3, **{field: value})), 400, field)
    assert err["message"].startswith(f"{field}: ") and says in err["message"], err


@pytest.mark.parametrize("field, value, says", [
    ("top_k", 40, "top-k"),
    ("tools", [{"name": "f", "input_schema": {"type": "object"}}], "tool use"),
    ("tool_choice", {"type": "auto"}, "tool use"),
    ("thinking", {"type": "enabled", "budget_tokens": 1024}, "extended thinking"),
])
def test_anthropic_fields_without_a_feature_are_400_when_set(url, field, value, says):
    msg = anthropic_error(post(url, A, a_body(**{field: value})), 400, "invalid_request_error")
    assert msg.startswith(f"{field}: ") and says in msg, msg


def test_fields_without_a_feature_still_check_their_json_types(url):
    openai_error(post(url, O, o_body(presence_penalty="0")), 400, "presence_penalty")
    openai_error(post(url, O, o_body(presence_penalty=3)), 400, "presence_penalty")
    openai_error(post(url, O, o_body(logprobs=0)), 400, "logprobs")
    assert anthropic_error(post(url, A, a_body(top_k="4")), 400, "invalid_request_error").startswith("top_k")
