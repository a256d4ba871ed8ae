"""The gateway's OpenAPI document (`/schema/openapi.json`) describes every operation of the API
(`/v1/*`) and the admin API (`/admin/*`) with types: a request body where the operation takes
one, a 2xx response, and the error responses it can give, each in OpenAI's error shape
`{"error": {"message", "type", "param", "code"}}` (one component, referenced)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loramux.gateway.server import RunningServer

ERROR_REF = "#/components/schemas/ErrorResponse"
TAKES_A_BODY = {"post", "put", "patch"}
METHODS = TAKES_A_BODY | {"get", "delete"}
API_POST_ERRORS = {"400", "401", "403", "404", "413", "415", "429", "503"}
"""What a completion can be answered with: a bad body, a bad or missing key, a model the key may
not use, an unknown model, a body too large, not JSON, a quota, an engine not serving."""


@pytest.fixture(scope="module")
def document(gateway: RunningServer) -> dict[str, Any]:
    r = httpx.get(f"{gateway.url}/schema/openapi.json", timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def operations(document: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in document["paths"].items():
        if path.startswith(("/v1/", "/admin/")):
            for method in METHODS & set(item):
                yield path, method, item[method]


def resolve(document: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def typed(document: dict[str, Any], schema: dict[str, Any] | None) -> bool:
    """Whether a schema says what is there: an object with properties, a list of such, or a
    choice of them (not `{}`, not a bare `object`)."""
    if not schema:
        return False
    schema = resolve(document, schema)
    if "properties" in schema:
        return True
    if schema.get("type") == "array":
        return typed(document, schema.get("items"))
    if "allOf" in schema:
        return all(typed(document, part) for part in schema["allOf"])
    choices = schema.get("oneOf") or schema.get("anyOf")
    return bool(choices) and all(typed(document, c) or c.get("type") == "null" for c in choices)


def media_schemas(part: dict[str, Any]) -> dict[str, dict[str, Any] | None]:
    return {media: m.get("schema") for media, m in (part.get("content") or {}).items()}


def expected_errors(path: str, method: str, operation: dict[str, Any]) -> set[str]:
    """The error statuses an operation can give, from what it takes: every one needs a key or
    token (401); one that reads a body, query or path parameters can be refused (400); one
    that names something by path can find nothing (404)."""
    statuses = {"401"}
    parameters = operation.get("parameters") or []
    if method in TAKES_A_BODY or parameters:
        statuses.add("400")
    if any(p["in"] == "path" for p in parameters):
        statuses.add("404")
    if path.startswith("/v1/") and method == "post":
        statuses |= API_POST_ERRORS
    return statuses


def gaps(document: dict[str, Any]) -> Iterator[str]:
    error = document.get("components", {}).get("schemas", {}).get("ErrorResponse")
    if not (error and "error" in error.get("properties", {})):
        yield "no ErrorResponse component with an `error` property"
    else:
        fields = resolve(document, error["properties"]["error"]).get("properties", {})
        if set(fields) != {"message", "type", "param", "code"}:
            yield f"ErrorResponse.error has fields {sorted(fields)}"
    for path, method, operation in operations(document):
        where = f"{method.upper()} {path}"
        if method in TAKES_A_BODY:
            bodies = media_schemas(operation.get("requestBody") or {})
            if not bodies:
                yield f"{where}: no request body"
            for media, schema in bodies.items():
                if not typed(document, schema):
                    yield f"{where}: request body {media} is not typed: {schema}"
        responses = operation.get("responses", {})
        success = [s for s in responses if s.startswith("2")]
        if not success:
            yield f"{where}: no 2xx response"
        for status in success:
            for media, schema in media_schemas(responses[status]).items():
                if not typed(document, schema):
                    yield f"{where}: {status} {media} is not typed: {schema}"
            if not media_schemas(responses[status]):
                yield f"{where}: {status} has no content"
        for status in sorted(expected_errors(path, method, operation) - set(responses)):
            yield f"{where}: {status} is not documented"
        for status, response in responses.items():
            if status[0] in "45":
                refs = {s.get("$ref") if s else None for s in media_schemas(response).values()}
                if refs != {ERROR_REF}:
                    yield f"{where}: {status} is not an ErrorResponse: {refs}"


def test_every_operation_is_typed_with_its_body_response_and_errors(
    document: dict[str, Any],
) -> None:
    assert any(p.startswith("/v1/") for p in document["paths"])
    assert any(p.startswith("/admin/") for p in document["paths"])
    missing = list(gaps(document))
    assert not missing, f"{len(missing)} gaps:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "path, method",
    [
        ("/v1/chat/completions", "post"),
        ("/v1/completions", "post"),
        ("/admin/tenants", "post"),
        ("/admin/tenants/{tenant}/quotas", "put"),
    ],
)
def test_the_main_bodies_come_with_an_example(
    document: dict[str, Any], path: str, method: str
) -> None:
    body = document["paths"][path][method]["requestBody"]["content"]["application/json"]
    assert body["schema"]["examples"], body


def test_completions_document_their_stream_as_server_sent_events(
    document: dict[str, Any],
) -> None:
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert chat["application/json"]["schema"]["$ref"].endswith("/ChatCompletion")
    assert chat["text/event-stream"]["schema"]["$ref"].endswith("/ChatCompletionChunk")
    text = document["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert text["text/event-stream"]["schema"]["$ref"].endswith("/TextCompletion")


@pytest.mark.parametrize("path", ["/schema/", "/schema/swagger"])
def test_operators_get_an_api_explorer(gateway: RunningServer, path: str) -> None:
    r = httpx.get(f"{gateway.url}{path}", timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.text
    assert "SwaggerUIBundle" in r.text
