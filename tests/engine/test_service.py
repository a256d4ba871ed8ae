"""The engine's internal HTTP service: NDJSON streams, typed errors before the stream, adapter
upload and retirement, the shared secret, and aborts on client disconnect."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from adapters.base_spec import BaseModelSpec
from adapters.peft_format import CONFIG_FILE, WEIGHTS_FILE, load_peft_adapter
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import EngineRequest
from engine.service import serve_engine_in_thread
from engine.service.runner import RunningEngineService
from engine.service.wire import TOKEN_HEADER, decode_request, encode

TOKEN = "engine-secret"


@pytest.fixture(scope="module")
def service(
    demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningEngineService]:
    config = EngineConfig(model=demo_model_dir, max_model_len=512, kv_cache_bytes=16 << 20)
    engine = AsyncEngine(LLMEngine(config))
    adapter_dir = tmp_path_factory.mktemp("engine-adapters")
    with serve_engine_in_thread(engine, "demo", adapter_dir=adapter_dir, token=TOKEN) as running:
        yield running


@pytest.fixture
def http(service: RunningEngineService) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=service.url, headers={TOKEN_HEADER: TOKEN}, timeout=60) as c:
        yield c


def _body(request_id: str, **fields: Any) -> dict[str, Any]:
    params = {"max_tokens": 12, "ignore_eos": True, **fields.pop("params", {})}
    return {"request_id": request_id, "params": params, **fields}


def _stream_lines(http: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in response.iter_lines()]


def _digest(folder: Path, model_dir: Path) -> str:
    return load_peft_adapter(folder, BaseModelSpec.from_model_dir(model_dir)).digest


def _upload(http: httpx.Client, digest: str, folder: Path) -> httpx.Response:
    files = {
        "adapter_config": (CONFIG_FILE, (folder / CONFIG_FILE).read_bytes()),
        "adapter_model": (WEIGHTS_FILE, (folder / WEIGHTS_FILE).read_bytes()),
    }
    return http.post("/adapters", data={"digest": digest}, files=files)


def _wait_idle(http: httpx.Client) -> dict[str, Any]:
    for _ in range(1000):
        stats = http.get("/stats").json()
        if stats["running"] == 0 and stats["waiting"] == 0:
            return dict(stats)
        time.sleep(0.01)
    raise AssertionError(f"the engine never went idle: {stats}")


def test_generate_streams_one_ndjson_line_per_delta(http: httpx.Client) -> None:
    lines = _stream_lines(http, _body("nd-1", prompt="def parse(line):"))
    assert [line["request_id"] for line in lines] == ["nd-1"] * len(lines)
    assert all(line["finish_reason"] is None and line["usage"] is None for line in lines[:-1])
    last = lines[-1]
    assert last["finish_reason"] == "length"
    assert last["usage"]["completion_tokens"] == 12 == sum(len(x["token_ids"]) for x in lines)
    text = "".join(line["text"] for line in lines)
    assert text and isinstance(text, str)


def test_count_tokens_counts_the_rendered_chat(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hello there"}]
    counted = http.post("/count_tokens", json=_body("ct-1", messages=messages)).json()
    lines = _stream_lines(http, _body("ct-2", messages=messages, params={"max_tokens": 1}))
    assert counted["prompt_tokens"] == lines[-1]["usage"]["prompt_tokens"] > 0


@pytest.mark.parametrize(
    ("fields", "status", "code"),
    [
        ({"prompt": "x " * 600}, 400, "prompt_too_long"),
        ({"prompt": "x", "adapter": "0" * 64}, 404, "unknown_adapter"),
        ({"prompt": "x", "prompt_token_ids": [1, 2]}, 400, "invalid_request"),
        ({"prompt": "x", "params": {"max_tokens": 0}}, 400, "invalid_request"),
        ({"prompt": "x", "params": {"seed": "not a number"}}, 400, "invalid_request"),
        ({"prompt_token_ids": [10**9]}, 400, "invalid_request"),
    ],
)
def test_typed_errors_are_one_json_body_before_any_stream(
    http: httpx.Client, fields: dict[str, Any], status: int, code: str
) -> None:
    response = http.post("/generate", json=_body("err-1", **fields))
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["code"] == code
    assert response.json()["error"]["kind"] == "engine"


def test_a_body_that_is_not_json_is_an_invalid_request(http: httpx.Client) -> None:
    response = http.post("/generate", content=b"{not json", headers={"content-type": "text/plain"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_request"


def test_every_route_but_health_needs_the_token(service: RunningEngineService) -> None:
    with httpx.Client(base_url=service.url, timeout=60) as anonymous:
        assert anonymous.get("/health").status_code == 200
        for wrong in ({}, {TOKEN_HEADER: "guess"}):
            response = anonymous.get("/info", headers=wrong)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "unauthorized"
        assert anonymous.post("/generate", json=_body("anon", prompt="x")).status_code == 401


def test_info_and_stats(http: httpx.Client) -> None:
    assert http.get("/info").json() == {
        "model_name": "demo",
        "max_model_len": 512,
        "vocab_size": 4096,
    }
    stats = _wait_idle(http)
    assert stats["kv_blocks_total"] == stats["kv_blocks_free"] + stats["kv_blocks_used"] > 0


def test_uploaded_adapter_is_served_listed_then_retired(
    http: httpx.Client, demo_adapter_dirs: list[Path], demo_model_dir: Path
) -> None:
    folder = demo_adapter_dirs[0]
    digest = _digest(folder, demo_model_dir)
    assert _upload(http, digest, folder).json() == {"digest": digest}
    assert _upload(http, digest, folder).status_code == 200  # idempotent
    assert digest in http.get("/adapters").json()["digests"]
    lines = _stream_lines(http, _body("ad-1", prompt="def f(x):", adapter=digest))
    assert lines[-1]["finish_reason"] == "length"

    assert http.delete(f"/adapters/{digest}").json() == {"retired": True}
    assert digest not in http.get("/adapters").json()["digests"]
    refused = http.post("/generate", json=_body("ad-2", prompt="def f(x):", adapter=digest))
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "unknown_adapter"


def test_upload_with_a_digest_that_is_not_its_content_is_refused(
    http: httpx.Client, demo_adapter_dirs: list[Path], demo_model_dir: Path
) -> None:
    claimed = _digest(demo_adapter_dirs[1], demo_model_dir)
    actual = _digest(demo_adapter_dirs[2], demo_model_dir)
    response = _upload(http, claimed, demo_adapter_dirs[2])
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_request"
    served = http.get("/adapters").json()["digests"]
    assert claimed not in served and actual not in served
    assert _upload(http, "../../etc", demo_adapter_dirs[2]).status_code == 400


def test_a_broken_adapter_is_refused_with_its_adapter_code(
    http: httpx.Client, demo_adapter_dirs: list[Path], tmp_path: Path
) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / CONFIG_FILE).write_text('{"peft_type": "IA3"}')
    (folder / WEIGHTS_FILE).write_bytes((demo_adapter_dirs[0] / WEIGHTS_FILE).read_bytes())
    response = _upload(http, "1" * 64, folder)
    assert response.status_code == 400
    assert response.json()["error"]["kind"] == "adapter"


def test_a_client_that_disconnects_mid_stream_aborts_and_frees_its_blocks(
    http: httpx.Client,
) -> None:
    generated_before = _wait_idle(http)["generated_tokens"]
    body = _body("gone-1", prompt="class Tree:", params={"max_tokens": 490})
    with http.stream("POST", "/generate", json=body) as response:
        lines = response.iter_lines()
        for _ in range(3):
            assert json.loads(next(lines))["finish_reason"] is None
    stats = _wait_idle(http)
    assert stats["kv_blocks_used"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["generated_tokens"] - generated_before < 490  # aborted, not run to its end


def test_a_request_the_engine_cannot_compute_fails_alone_with_request_failed(
    http: httpx.Client, overflowing_adapter: Path, demo_model_dir: Path
) -> None:
    digest = _digest(overflowing_adapter, demo_model_dir)
    assert _upload(http, digest, overflowing_adapter).status_code == 200
    response = http.post("/generate", json=_body("nan-1", prompt="def f(x):", adapter=digest))
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "request_failed"
    assert http.get("/health").status_code == 200
    lines = _stream_lines(http, _body("after-nan", prompt="def f(x):"))
    assert lines[-1]["finish_reason"] == "length"
    stats = _wait_idle(http)
    assert stats["kv_blocks_used"] == 0


def test_extreme_sampling_numbers_cross_the_wire_and_get_an_answer(http: httpx.Client) -> None:
    params = {"temperature": 1e-38, "seed": 2**64 + 5, "top_k": 10**30}
    lines = _stream_lines(http, _body("extreme", prompt="x = ", params=params))
    assert lines[-1]["finish_reason"] == "length"
    refused = http.post(
        "/generate", content=b'{"request_id": "inf", "prompt": "x", "params": {"top_p": 1e999}}'
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "invalid_request"


def test_cache_salt_crosses_the_wire_and_scopes_prefix_reuse(http: httpx.Client) -> None:
    prompt = list(range(1000, 1040))  # 2 full blocks of 16 are reusable

    def cached(request_id: str, salt: str | None) -> int:
        body = _body(request_id, prompt_token_ids=prompt, cache_salt=salt, params={"max_tokens": 2})
        return int(_stream_lines(http, body)[-1]["usage"]["cached_tokens"])

    assert cached("salt-a1", "tenant-a") == 0
    assert cached("salt-b1", "tenant-b") == 0
    assert cached("salt-a2", "tenant-a") == 32
    assert cached("salt-none", None) == 0
    request = EngineRequest("r", prompt="x", cache_salt="tenant-a")
    assert decode_request(encode(request)) == request
