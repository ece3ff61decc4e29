"""Schemathesis against the OpenAPI document the running proxy (Litestar) generates, with the
chat-completions request body described by our own msgspec protocol types: every operation, every
generated request, no 5xx from the proxy."""

from __future__ import annotations

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.support import start_proxy
from toolquake.proxy.server.protocol import ChatCompletionRequest

CHAT_PATHS = ("/v1/chat/completions", "/p/{profile}/v1/chat/completions")


def openapi_document(url: str) -> dict:
    doc = httpx.get(f"{url}/schema/openapi.json").json()
    (body,), components = msgspec.json.schema_components([ChatCompletionRequest],
                                                        ref_template="#/components/schemas/{name}")
    doc.setdefault("components", {}).setdefault("schemas", {}).update(components)
    for path in CHAT_PATHS:
        doc["paths"][path]["post"]["requestBody"] = {"required": True,
                                                     "content": {"application/json": {"schema": body}}}
    doc["servers"] = [{"url": url}]
    return doc


@pytest.fixture(scope="module")
def proxy_for_schemathesis(fake_upstream):
    proc = start_proxy(fake_upstream.url, None, {"TOOLQUAKE_ADMIN_TOKEN": "schemathesis-admin"}, "--no-scoring")
    yield proc
    proc.stop()


def test_no_operation_answers_with_a_proxy_server_error(proxy_for_schemathesis):
    """Schemathesis' pytest plugin does not load under this pytest; its strategies are driven here."""
    schema = schemathesis.openapi.from_dict(openapi_document(proxy_for_schemathesis.url))
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= set(CHAT_PATHS) | {"/admin/profiles/{name}", "/healthz"}
    calls = {"n": 0}
    for operation in operations:
        @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def run(case) -> None:
            response = case.call(base_url=proxy_for_schemathesis.url, timeout=30)
            calls["n"] += 1
            case.validate_response(response, checks=[not_a_server_error])

        run()
    assert proxy_for_schemathesis.popen.poll() is None, "the proxy died under schemathesis"
    assert calls["n"] >= 10 * len(operations)
