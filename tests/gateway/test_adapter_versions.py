"""Adapter versions through the openai client's `model` field: `name@version` pins one live
version, making an older version current rolls back to it, and versions are deleted one at a
time (the one before serves again when the current one goes)."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from loramux.gateway.catalog import MAX_MODEL_ID
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import admin_client, json_of
from tests.gateway.tenants import TenantKey, new_key, new_tenant, upload_adapter

PROMPT = [{"role": "user", "content": "Say something about adapters"}]


def reply(client: openai.OpenAI, model: str) -> str:
    out = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=8, seed=1)  # type: ignore[arg-type]
    assert out.model == model
    return out.choices[0].message.content or ""


@pytest.fixture
def tenant(admin: httpx.Client) -> TenantKey:
    return new_tenant(admin, "versions")


@pytest.fixture
def client(gateway: RunningServer, tenant: TenantKey) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{gateway.url}/v1", api_key=tenant.key, max_retries=0, timeout=60
    )


def no_cache(client: openai.OpenAI) -> openai.OpenAI:
    return client.with_options(default_headers={"cache-control": "no-store"})


def test_pin_roll_back_and_delete_one_version_at_a_time(
    admin: httpx.Client, client: openai.OpenAI, tenant: TenantKey, demo_adapter_dirs: list[Path]
) -> None:
    client = no_cache(client)
    owner = tenant.tenant_name
    v1 = upload_adapter(admin, owner, "support-bot", demo_adapter_dirs[24])
    v2 = upload_adapter(admin, owner, "support-bot", demo_adapter_dirs[25])
    assert (v1["version"], v2["version"]) == (1, 2)
    one, two = reply(client, "support-bot@1"), reply(client, "support-bot@2")
    assert one != two, "the demo adapters must differ for this test to say anything"
    assert reply(client, "support-bot") == two
    assert reply(client, f"{owner}/support-bot") == two
    assert reply(client, f"{tenant.tenant_id}/support-bot@1") == one

    base = f"/admin/adapters/{owner}/support-bot"
    rolled = admin.put(f"{base}/current", json={"version": 1})
    assert rolled.status_code == 201, rolled.text
    v3 = json_of(rolled)
    assert (v3["version"], v3["digest"]) == (3, v1["digest"])
    assert reply(client, "support-bot") == one
    assert reply(client, "support-bot@2") == two
    again = admin.put(f"{base}/current", json={"version": 3})
    assert again.status_code == 200 and json_of(again) == v3

    deleted = admin.delete(f"{base}/versions/3")
    assert deleted.status_code == 200, deleted.text
    assert reply(client, "support-bot") == two
    with pytest.raises(openai.NotFoundError):
        reply(client, "support-bot@3")
    assert admin.delete(f"{base}/versions/3").status_code == 404
    assert [v["version"] for v in json_of(admin.get(base))["versions"]] == [1, 2]

    assert admin.delete(f"{base}/versions/2").status_code == 200
    assert reply(client, "support-bot") == one
    assert admin.delete(f"{base}/versions/1").status_code == 200
    with pytest.raises(openai.NotFoundError):
        reply(client, "support-bot")
    assert admin.get(base).status_code == 404


@pytest.mark.parametrize(
    "model",
    [
        "support-bot@0",
        "support-bot@9",
        "support-bot@",
        "support-bot@x",
        "support-bot@1@1",
        "support-bot@99999999999999999999",
        "support-bot@\u0661",
    ],
)
def test_a_pin_that_names_no_live_version_is_not_found(
    admin: httpx.Client,
    client: openai.OpenAI,
    tenant: TenantKey,
    demo_adapter_dirs: list[Path],
    model: str,
) -> None:
    upload_adapter(admin, tenant.tenant_id, "support-bot", demo_adapter_dirs[26])
    with pytest.raises(openai.NotFoundError):
        reply(client, model)


def test_another_tenants_name_in_the_model_is_not_found(
    admin: httpx.Client, client: openai.OpenAI, demo_adapter_dirs: list[Path]
) -> None:
    other = new_tenant(admin, "other")
    upload_adapter(admin, other.tenant_name, "private-bot", demo_adapter_dirs[27])
    for model in (f"{other.tenant_name}/private-bot", f"{other.tenant_name}/private-bot@1"):
        with pytest.raises(openai.NotFoundError):
            reply(client, model)


def test_rolling_back_to_a_deleted_or_missing_version_is_not_found(
    admin: httpx.Client, tenant: TenantKey, demo_adapter_dirs: list[Path]
) -> None:
    upload_adapter(admin, tenant.tenant_id, "bot", demo_adapter_dirs[28])
    upload_adapter(admin, tenant.tenant_id, "bot", demo_adapter_dirs[29])
    assert admin.delete(f"/admin/adapters/{tenant.tenant_id}/bot/versions/1").status_code == 200
    current = f"/admin/adapters/{tenant.tenant_id}/bot/current"
    for version in (1, 7):
        assert admin.put(current, json={"version": version}).status_code == 404
    for bad in ({"version": 0}, {"version": "1"}, {"version": 2**64}, {}, {"version": 1, "x": 1}):
        assert admin.put(current, json=bad).status_code == 400


@pytest.mark.parametrize("version", [0, -1, 2**31, 306636901839103624786694424563286016])
def test_a_version_number_no_version_can_have_is_a_404(
    admin: httpx.Client, tenant: TenantKey, demo_adapter_dirs: list[Path], version: int
) -> None:
    upload_adapter(admin, tenant.tenant_id, "numbered-bot", demo_adapter_dirs[36])
    path = f"/admin/adapters/{tenant.tenant_id}/numbered-bot"
    for response in (
        admin.delete(f"{path}/versions/{version}"),
        admin.put(f"{path}/current", json={"version": version}),
    ):
        assert response.status_code in (400, 404), response.text


def test_the_longest_model_id_resolves_and_longer_ones_are_not_kept(
    gateway: RunningServer, admin: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    """`owner/name@version` at its longest (a tenant name of 200 characters, an adapter name
    of 64, a pin of 9 digits) serves; a made-up model longer than any that resolves is the
    unknown model's 404, in a body or in GET /v1/models/{id}, and the catalog keeps nothing
    of it (each was cached whole: 512 KiB a request, up to 100,000 of them)."""
    name = f"{'o' * 190}-{uuid.uuid4().hex[:9]}"
    r = admin.post("/admin/tenants", json={"name": name})
    assert r.status_code == 201, r.text
    tenant = TenantKey(r.json()["id"], name, *new_key(admin, r.json()["id"]))
    upload_adapter(admin, tenant.tenant_id, "b" * 64, demo_adapter_dirs[38])
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=tenant.key, max_retries=0)
    reply(no_cache(client), f"{name}/{'b' * 64}@000000001")

    catalog = gateway.state.catalog
    headers = {"authorization": f"Bearer {tenant.key}"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as c:
        for i in range(4):
            body = {"model": f"{i}" + "m" * (64 << 10), "messages": PROMPT}
            r = c.post("/v1/chat/completions", json=body)
            assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
            r = c.get(f"/v1/models/{i}" + "g" * 6000)
            assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
    assert max(len(model) for _, model in catalog._cache) <= MAX_MODEL_ID


def _upload_files(folder: Path) -> dict[str, tuple[str, bytes]]:
    return {
        part: (file, (folder / file).read_bytes())
        for part, file in (
            ("adapter_config", "adapter_config.json"),
            ("adapter_model", "adapter_model.safetensors"),
        )
    }


def _upload_twice_at_once(
    admin: httpx.Client, owner: str, name: str, folder: Path
) -> list[httpx.Response]:
    start = threading.Barrier(2)

    def upload(_: int) -> httpx.Response:
        start.wait()
        data = {"name": name, "owner": owner}
        return admin.post("/admin/adapters", data=data, files=_upload_files(folder))

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(upload, range(2)))


@pytest.mark.parametrize("owned_by", ["tenant", "shared"])
def test_two_uploads_of_the_same_bytes_at_once_publish_one_version(
    each_gateway: RunningServer, demo_adapter_dirs: list[Path], owned_by: str
) -> None:
    """A client retrying a timed-out upload: both uploads passed the "same bytes as the current
    version?" check before either committed, then took turns on the owner's lock, and both
    published (versions 1 and 2 of one digest; a shared owner, which has no row to lock, got
    a 409). One version, and both answers name it (found by attacking the adapter publish)."""
    admin = admin_client(each_gateway)
    owner = new_tenant(admin, "twice").tenant_id if owned_by == "tenant" else "shared"
    for attempt in range(3):
        name = f"same-{uuid.uuid4().hex[:8]}-{attempt}"
        answers = _upload_twice_at_once(admin, owner, name, demo_adapter_dirs[5])
        assert sorted(a.status_code for a in answers) == [200, 201], [a.text for a in answers]
        assert {json_of(a)["version"] for a in answers} == {1}
        detail = json_of(admin.get(f"/admin/adapters/{owner}/{name}"))
        assert [v["version"] for v in detail["versions"]] == [1]
