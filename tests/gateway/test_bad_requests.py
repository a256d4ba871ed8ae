"""Malformed bodies, wrong types, hostile numbers, deep nesting, invalid UTF-8, non-JSON
bodies, oversize prompts and unsupported parameters get an OpenAI-shaped 4xx with a request id
(naming the field where there is one) — never a 500."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from litestar.serialization import encode_json

from loramux.engine.demo_model import VOCAB_SIZE
from loramux.gateway.errors import BadRequest
from loramux.gateway.openai.body import nests_deeper_than
from loramux.gateway.openai.prompt import MAX_MESSAGES
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import admin_client
from tests.gateway.tenants import TenantKey, new_tenant
from tests.raw_http import Connection, head

OK = {"model": "demo-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def tenant(gateway: RunningServer, admin_token: str) -> TenantKey:
    with httpx.Client(
        base_url=gateway.url, headers={"authorization": f"Bearer {admin_token}"}
    ) as admin:
        return new_tenant(admin, "badreq")


def _raw(field: str, literal: str) -> bytes:
    """OK with `field` set to a JSON literal json.dumps cannot write (1e400, NaN, 2**70, …)."""
    base = _with(**{field: ...}) if field in OK else _with()
    return base[:-1] + f', "{field}": {literal}}}'.encode()


def _nested(depth: int, closed: bool = True) -> bytes:
    return _raw("tool_choice", "[" * depth + ("]" * depth if closed else ""))


def _with(**changes: Any) -> bytes:
    body = dict(OK)
    for k, v in changes.items():
        if v is ...:
            body.pop(k)
        else:
            body[k] = v
    return json.dumps(body).encode()


CASES = {
    "not json": (b"{nope", 400),
    "empty body": (b"", 400),
    "json array": (b"[1, 2]", 400),
    "missing model": (_with(model=...), 400),
    "missing messages": (_with(messages=...), 400),
    "messages not a list": (_with(messages="hi"), 400),
    "empty messages": (_with(messages=[]), 400),
    "2,049 messages": (_with(messages=[{"role": "user", "content": "x"}] * 2049), 400),
    "unknown role": (_with(messages=[{"role": "robot", "content": "x"}]), 400),
    "tool message without its call id": (_with(messages=[{"role": "tool", "content": "x"}]), 400),
    "image content": (
        _with(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
    ),
    "temperature as string": (_with(temperature="hot"), 400),
    "temperature too high": (_with(temperature=3), 400),
    "max_tokens zero": (_with(max_tokens=0), 400),
    "max_tokens float": (_with(max_tokens=1.5), 400),
    "top_p out of range": (_with(top_p=2), 400),
    "n above the limit": (_with(n=17), 400),
    "tool name with a space": (
        _with(tools=[{"type": "function", "function": {"name": "f g"}}]),
        400,
    ),
    "top_logprobs above 20": (_with(logprobs=True, top_logprobs=21), 400),
    "json_schema without a name": (
        _with(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
        400,
    ),
    "five stops": (_with(stop=["a", "b", "c", "d", "e"]), 400),
    "a stop of 1,001 characters": (_with(stop=["ab" * 500 + "c"]), 400),
    "stream not bool": (_with(stream="yes"), 400),
    "messages over the context": (
        _with(messages=[{"role": "user", "content": "word " * 2000}]),
        400,
    ),
    "body too large": (_with(messages=[{"role": "user", "content": "x" * (2 << 20)}]), 413),
    "invalid utf-8 in a string": (_with(model="demo")[:-1] + b', "user": "\xff\xfe"}', 400),
    "invalid utf-8 outside strings": (b"\xef\xbb\xbf" + _with() + b"\xff", 400),
    "nested 50k deep": (_nested(50_000), 400),
    "nested 50k deep, never closed": (_nested(50_000, closed=False), 400),
    "nested 33 deep": (_nested(33), 400),
    # Scanned in linear time: each escaped quote was tried as a string's start (1 MiB: 30 min).
    "40 openers, then 800 KB of escaped quotes": (b"[" * 40 + b'\\"' * 400_000, 400),
    "NaN literal": (_raw("temperature", "NaN"), 400),
    "Infinity literal": (_raw("top_p", "Infinity"), 400),
    "prompt token id past 64 bits": (
        json.dumps({"model": "demo-model", "prompt": [1, 2**70], "max_tokens": 2}).encode(),
        400,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_chat_request(gateway: RunningServer, tenant: TenantKey, case: str) -> None:
    body, status = CASES[case]
    path = "/v1/completions" if case.startswith("prompt") else "/v1/chat/completions"
    r = httpx.post(
        f"{gateway.url}{path}",
        content=body,
        headers={"authorization": f"Bearer {tenant.key}", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert r.headers["x-request-id"]


@pytest.mark.parametrize(
    ("path", "prompt", "says"),
    [
        ("/v1/chat/completions", "word " * 2000, "2011 prompt tokens and asks for 2 completion"),
        ("/v1/completions", "word " * 2000, "2001 prompt tokens and asks for 2 completion"),
        ("/v1/chat/completions", "word " * 501, "512 tokens, which leave no room"),  # no max_tokens
        ("/v1/chat/completions", "x" * 33_281, "33281 characters"),  # never tokenized
        ("/v1/completions", "x" * 33_281, "33281 characters"),
    ],
    ids=["chat", "text", "no max_tokens", "chat, characters", "text, characters"],
)
def test_a_prompt_over_the_context_is_refused_by_name(
    gateway: RunningServer, tenant: TenantKey, path: str, prompt: str, says: str
) -> None:
    """The context holds 512 tokens. A request without max_tokens is not told it asked for
    some. Past 512 of the demo vocabulary's longest token (64 characters, plus one) the prompt
    is refused before it is tokenized: tokenizing costs time in proportion to its length."""
    assert gateway.state.prompts.max_prompt_chars == 512 * 65
    r = _complete(gateway, tenant, path, prompt, None if "no room" in says else 2)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    field = "prompt" if path == "/v1/completions" else "messages"
    assert (error["code"], error["param"]) == ("context_length_exceeded", field)
    assert says in error["message"]


def test_a_prompt_of_the_longest_tokens_that_fits_is_served(
    gateway: RunningServer, tenant: TenantKey
) -> None:
    """64 characters a token: "#" * 64 is one token of the demo vocabulary."""
    r = _complete(gateway, tenant, "/v1/completions", "#" * (64 * 257), 1)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 257


def _complete(
    gateway: RunningServer, tenant: TenantKey, path: str, prompt: str, max_tokens: int | None
) -> httpx.Response:
    body: dict[str, Any] = {"model": "demo-model", "max_tokens": max_tokens}
    if path == "/v1/completions":
        body["prompt"] = prompt
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
    headers = {"authorization": f"Bearer {tenant.key}"}
    return httpx.post(f"{gateway.url}{path}", json=body, headers=headers)


@pytest.mark.parametrize(
    "prompt",
    [[], [[1, 2], [3]], [1.5], [True], {"a": 1}, ["a", "b"]],
    ids=["empty", "two", "float", "bool", "obj", "2str"],
)
def test_bad_completion_prompt(gateway: RunningServer, tenant: TenantKey, prompt: Any) -> None:
    r = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": "demo-model", "prompt": prompt, "max_tokens": 2},
        headers={"authorization": f"Bearer {tenant.key}"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "prompt",
    [[-1], [VOCAB_SIZE], [10**6], [[5, VOCAB_SIZE]], [2**31], "", [""]],
    ids=["negative", "vocab-size", "million", "nested", "int32", "empty", "nested-empty"],
)
def test_a_prompt_the_model_cannot_take_is_refused_naming_prompt(
    gateway: RunningServer, tenant: TenantKey, prompt: Any
) -> None:
    """Token ids past the vocabulary and an empty prompt are the `prompt`'s fault. The bug: the
    engine's refusal of them came back with `param: null`, while a negative id named it."""
    r = httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": "demo-model", "prompt": prompt, "max_tokens": 2},
        headers={"authorization": f"Bearer {tenant.key}"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt", r.text


NUMERIC_FIELDS = [
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "top_k",
    "temperature",
    "top_p",
    "n",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_p",
]
NEGATIVE_ONE_ALLOWED = {"seed", "presence_penalty", "frequency_penalty"}
HOSTILE_NUMBERS = {
    "1e400": "1e400",
    "-1e400": "-1e400",
    "2**64+5": str(2**64 + 5),
    "-(2**64+5)": str(-(2**64 + 5)),
    "2**128": str(2**128),
    "-1": "-1",
}


@pytest.mark.parametrize("field", NUMERIC_FIELDS)
@pytest.mark.parametrize("number", HOSTILE_NUMBERS)
def test_numbers_out_of_range_are_refused_naming_the_field(
    gateway: RunningServer, tenant: TenantKey, field: str, number: str
) -> None:
    if field in NEGATIVE_ONE_ALLOWED and number == "-1":
        pytest.skip(f"-1 is a valid {field}")
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=_raw(field, HOSTILE_NUMBERS[number]),
        headers={"authorization": f"Bearer {tenant.key}", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


@pytest.mark.parametrize("number", ["1e400", str(2**64 + 5), "0", "17", str(10**9)])
def test_n_outside_1_to_16_is_refused_naming_the_field(
    gateway: RunningServer, tenant: TenantKey, number: str
) -> None:
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=_raw("n", number),
        headers={"authorization": f"Bearer {tenant.key}", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "n"


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        ("application/json; charset=latin-1", 415),
        ("application/json; charset=UTF-8", 200),
        ("Application/JSON", 200),
        (None, 200),
    ],
)
def test_only_json_bodies_are_read(
    gateway: RunningServer, tenant: TenantKey, content_type: str | None, status: int
) -> None:
    headers = {"authorization": f"Bearer {tenant.key}"}
    if content_type is not None:
        headers["content-type"] = content_type
    for path in ("/v1/chat/completions", "/v1/completions"):
        body = (
            _with()
            if path == "/v1/chat/completions"
            else b'{"model": "demo-model", "prompt": "x", "max_tokens": 1}'
        )
        r = httpx.post(f"{gateway.url}{path}", content=body, headers=headers, timeout=30)
        assert r.status_code == status, r.text
        if status != 200:
            assert r.json()["error"]["code"] == "unsupported_media_type"


@pytest.mark.parametrize("count", [2048, 2049])
def test_messages_beyond_the_bound_are_refused_before_they_are_rendered(
    gateway: RunningServer, tenant: TenantKey, count: int
) -> None:
    """Empty messages carry no text for the prompt's length check, only the template's markup:
    their number is bounded instead (2,048); up to it, the context refuses them once tokenized."""
    body = _with(messages=[{"role": "user"}] * count)
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        content=body,
        headers={"authorization": f"Bearer {tenant.key}", "content-type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "messages"
    if count > MAX_MESSAGES:
        assert error["message"] == f"messages must contain at most 2048 messages, got {count}"
    else:
        assert error["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("body", "deeper"),
    [
        (b'{"a": "x\\"[[[[", "b": [[[]]]}', False),
        (b"[" * 10 + b'"' + b"[" * 40, False),  # inside a string never closed
        (b'["\\\\"' + b"[" * 40, True),  # the escaped backslash closes the string
        (b"[" * 33 + b'"\\', True),
    ],
)
def test_brackets_count_outside_strings_only(body: bytes, deeper: bool) -> None:
    """As a parser reads the text: after a string that is never closed, the rest is that
    string. The scan took those brackets as nesting, and was quadratic in escaped quotes."""
    assert nests_deeper_than(body, 32) is deeper


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/chat/completions",
            {"model": "a\u0000b", "messages": [{"role": "user", "content": "x"}]},
        ),
        ("/v1/completions", {"model": "a\u0000b@1", "prompt": "x"}),
    ],
)
def test_a_model_holding_nul_is_not_found_on_either_database(
    each_gateway: RunningServer, path: str, body: dict
) -> None:
    """No adapter's name holds NUL, so a model holding one is a 404 like any unknown model, on
    SQLite and PostgreSQL alike. The catalog looked it up, and PostgreSQL, which cannot compare
    text holding NUL (22021), failed the query: a 500."""
    with admin_client(each_gateway) as admin:
        tenant = new_tenant(admin, "nul-model")
    headers = {"authorization": f"Bearer {tenant.key}"}
    response = httpx.post(f"{each_gateway.url}{path}", json=body, headers=headers, timeout=60)
    assert response.status_code == 404, response.text
    assert response.json()["error"]["code"] == "model_not_found"


def test_an_error_quoting_a_lone_surrogate_is_still_written() -> None:
    """JSON may hold a lone surrogate (`"\\udc80"`), which UTF-8 cannot: an error quoting one
    from a client's input (its message or param) is written with it escaped, never left
    unwritable (a 500 in place of the refusal)."""
    error = BadRequest("the option '\udc80x' is not supported", param="\udc80")
    body = json.loads(encode_json(error.body()))
    assert body["error"]["message"] == "the option '\\udc80x' is not supported"
    assert body["error"]["param"] == "\\udc80"


@pytest.mark.parametrize("path", ["/admin/tenants", "/v1/models"])
def test_a_request_head_over_the_bound_is_refused_431_and_its_connection_closed(
    gateway: RunningServer, path: str
) -> None:
    """Bodies were bounded, heads not: uvicorn's httptools read a stranger's 32 MiB
    `Authorization` whole, and only then was it answered 401. A head (request line and
    headers) of LORAMUX_MAX_HEADER_KB is served; one byte more is 431."""
    bound = gateway.state.settings.server.max_header_kb << 10
    with Connection(gateway.url) as http:
        http.send(head(path, bound, authorization=True))
        assert http.answer().status == 401
        http.send(head(path, bound + 1, authorization=True))
        refused = http.answer()
        assert refused.status == 431
        assert refused.json()["error"]["code"] == "headers_too_large"
        assert http.closed()
