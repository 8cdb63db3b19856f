"""The OpenAPI schema describes every response the API really gives.

Schemathesis generates requests from /api/schema/ and sends them in-process to the
WSGI app as an authenticated runtime; no answer may be a 5xx or stray from the
schema (status codes, content types, bodies).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from django.core import signals
from django.db import close_old_connections
from drf_spectacular.validation import validate_schema
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from ledger import policy
from ledger.api.throttling import RuntimeTokenThrottle
from ledger.models import Capability, Runtime, RuntimeToken
from ledger.wsgi import application

# Loading needs no database: the schema view is public.
schema = schemathesis.openapi.from_wsgi("/api/schema/", application)


@pytest.fixture
def in_test_transaction() -> Iterator[None]:
    """Called as a WSGI app, Django closes the connection after each request, which
    would end the test's transaction; the test client avoids that the same way."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


@pytest.fixture
def bearer(db: None) -> dict[str, str]:
    Capability.objects.create(scope="refund.create")
    _, token = RuntimeToken.issue(runtime=Runtime.objects.create(name="fuzzer"))
    return {"Authorization": f"Bearer {token}"}


@schema.parametrize()
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_every_response_matches_the_schema(
    case: Any, bearer: dict[str, str], in_test_transaction: None
) -> None:
    RuntimeTokenThrottle.reset()  # the per-token throttle is not what this is about
    case.call_and_validate(
        headers=bearer,
        checks=[
            not_a_server_error,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )


def test_the_schema_documents_every_endpoint_and_error(client: Any) -> None:
    document = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    paths = document["paths"]
    assert set(paths) == {
        "/api/v1/intents",
        "/api/v1/evidence",
        "/api/v1/capabilities",
        "/api/v1/invocations",
        "/api/v1/invocations/{invocation_id}",
        "/api/v1/invocations/{invocation_id}/attempts",
        "/api/v1/invocations/{invocation_id}/attempts/{attempt_id}/outcome",
    }
    intent = paths["/api/v1/intents"]["post"]["responses"]
    assert {"200", "201", "400", "401", "409", "413", "415", "422", "429", "503"} <= set(intent)


def test_the_schema_is_valid_openapi(client: Any) -> None:
    document = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    validate_schema(document)  # raises on the first violation
    intent = document["paths"]["/api/v1/intents"]["post"]["requestBody"]
    assert intent["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Intent"
    }
    assert "invocation_id" in document["components"]["schemas"]["Intent"]["required"]


def test_the_schema_says_what_the_api_refuses(client: Any) -> None:
    """Found by `schemathesis run --checks all` against a live server: bodies the API
    requires were optional in the schema, and `limit` had no bounds."""
    document = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    posts = [ops["post"] for ops in document["paths"].values() if "post" in ops]
    assert len(posts) == 5 and all(post["requestBody"].get("required") for post in posts)
    listing = document["paths"]["/api/v1/invocations"]["get"]["parameters"]
    query = {p["name"]: p["schema"] for p in listing if p["in"] == "query"}
    assert (query["limit"]["minimum"], query["limit"]["maximum"]) == (1, 500)
    assert query["after"]["minimum"] == 0 and query["task_id"]["maxLength"] == 128
    declaration = document["components"]["schemas"]["DeclarationRequest"]["properties"]
    assert declaration["declaration"]["type"] == "object"  # never null


def test_the_schema_says_what_each_flag_means(client: Any) -> None:
    document = client.get("/api/schema/", HTTP_ACCEPT="application/json").json()
    schemas = document["components"]["schemas"]
    flags = schemas["State"]["properties"]["flags"]
    assert flags["items"] == {"$ref": "#/components/schemas/FlagsEnum"}
    assert schemas["FlagsEnum"]["enum"] == [flag.value for flag in policy.Flag]
    for flag in policy.Flag:
        assert f"{flag.value}:" in flags["description"], flag


def test_the_interactive_docs_are_served_without_a_cdn(client: Any) -> None:
    page = client.get("/api/docs/").content.decode()
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/" in page
    assert "cdn" not in page.lower()


def test_the_schema_generates_without_a_warning(tmp_path: Any) -> None:
    """drf-spectacular's warnings name schema parts it could not get right (two
    security schemes under one name, say); the build fails on any of them."""
    from django.core.management import call_command

    call_command("spectacular", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))
    assert "runtimeToken" in (tmp_path / "schema.yaml").read_text()
