"""Schemathesis over the app's own OpenAPI document, against a FakeEngine app (in-process ASGI).

Every generated case (schema-valid and schema-invalid bodies and path parameters, schemathesis'
boundary "coverage" cases, and its probes with undocumented methods) must get an answer that is
not a 5xx, whose status and content type the document lists, and whose body matches the
documented schema for that status: JSON bodies, and each event of an SSE stream (its ``data``
decoded as JSON and checked too). Schema-invalid bodies must be rejected with a 4xx.

Fuzzed examples per operation: ``SFCL_FUZZ_EXAMPLES`` (default 150: about 870 cases, ~10 s; the
coverage cases come on top). The module prints how many cases it sent and their status codes::

    SFCL_FUZZ_EXAMPLES=1000 python -m pytest tests/test_fuzz_openapi.py -q   # ~3,400 cases, ~35 s
"""

from __future__ import annotations

import collections
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection,
                                 not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from sfcl.server import create_app
from sfcl.server.testing import FakeEngine

EXAMPLES = int(os.environ.get("SFCL_FUZZ_EXAMPLES", "150"))

app = create_app(FakeEngine(max_model_len=2048), ping_interval_s=5.0)
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                max_examples=EXAMPLES)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]
SEEN: collections.Counter = collections.Counter()


@schema.hook
def flatmap_case(context, case):
    """Steer 3 in 4 of the schema-valid cases to the served model: a random model name is a 404
    and a random model id too, so without this few cases would get past the model check. For
    /v1/messages also open with a user turn and fill blank turns (the route's conversation
    rules), so that generation and streaming get exercised. Schema-invalid cases are left as
    generated (steering could make them valid, and they must be rejected)."""
    if case.meta is not None and case.meta.generation.mode.is_negative:
        return st.just(case)
    return st.integers(0, 3).map(lambda k: _steer(case) if k else case)


def _steer(case):
    params = case.path_parameters
    if isinstance(params, dict) and "model_id" in params:
        alias = "default" if len(str(params["model_id"])) % 2 else "fake-model"  # both are served
        case.path_parameters = {**params, "model_id": alias}
    body = case.body
    if isinstance(body, dict) and "model" in body:
        body = {**body, "model": "fake-model"}
        messages = body.get("messages")
        if case.operation.path == "/v1/messages" and isinstance(messages, list) and messages \
                and all(isinstance(m, dict) for m in messages):
            body["messages"] = [{**m, "content": m.get("content") if _text(m) else "hello"}
                                for m in messages]
            body["messages"][0]["role"] = "user"
        case.body = body
    return case


def _text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(b.get("text", "") for b in content if isinstance(b, dict)
                          and isinstance(b.get("text"), str))
    return content.strip() if isinstance(content, str) else "?"


@pytest.fixture(scope="module", autouse=True)
def report(request):
    yield
    total = sum(SEEN.values())
    by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for (label, status), n in SEEN.items():
        by_op[label][status] += n
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    capman = request.config.pluginmanager.getplugin("capturemanager")
    if tr is None or capman is None:
        return
    with capman.global_and_fixture_disabled():
        tr.write_line(f"\nschemathesis: {total} cases ({EXAMPLES} examples per operation)")
        for label, statuses in sorted(by_op.items()):
            tr.write_line(f"  {label}: {sum(statuses.values())} cases, "
                          f"status codes {dict(sorted(statuses.items()))}")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                 HealthCheck.data_too_large])
def test_openapi_no_server_errors(case):
    response = case.call()
    SEEN[(case.operation.label, response.status_code)] += 1
    assert response.status_code < 500, (response.status_code, response.text[:500])
    case.validate_response(response, checks=CHECKS)
