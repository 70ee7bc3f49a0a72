"""Schemathesis over the app's own OpenAPI document, against a FakeEngine-backed app (in-process ASGI).

Every generated case (schema-valid and schema-invalid bodies, path parameters, headers) must get
an answer that is not a 5xx, whose status and content type the document lists, and whose JSON
body matches the documented schema for that status. Schema-invalid bodies must be rejected (4xx).

Examples per operation: ``SFCL_FUZZ_EXAMPLES`` (default 60, ~10 s). A full run, e.g.::

    SFCL_FUZZ_EXAMPLES=500 python -m pytest tests/test_fuzz_openapi.py -q -s

prints the number of cases it sent and their status codes.
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

EXAMPLES = int(os.environ.get("SFCL_FUZZ_EXAMPLES", "60"))

app = create_app(FakeEngine(max_model_len=512), ping_interval_s=5.0)
schema = schemathesis.openapi.from_asgi("/openapi.json", app)
schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                                max_examples=EXAMPLES)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance, negative_data_rejection]
SEEN: collections.Counter = collections.Counter()


@schema.hook
def flatmap_body(context, body):
    """Half of the generated bodies name the served model (and, for /v1/messages, open with a
    user turn), so that they get past the model check (a random string is a 404) and reach the
    conversation, context and generation code."""
    if not isinstance(body, dict) or "model" not in body:
        return st.just(body)
    served = {**body, "model": "fake-model"}
    messages = body.get("messages")
    if context.operation.path == "/v1/messages" and isinstance(messages, list) and messages \
            and isinstance(messages[0], dict):
        served["messages"] = [{**messages[0], "role": "user"}, *messages[1:]]  # required first
    return st.sampled_from([served, body])


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
