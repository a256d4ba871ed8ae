"""Adapter uploads: stored by digest, loaded by the engine, versioned per name, listed,
deleted; a new version retires the old digest unless another adapter still serves it."""

from __future__ import annotations

import io
import random
import shutil
import tarfile
import uuid
import zipfile
from pathlib import Path

import httpx
import pytest

from loramux.gateway.server import RunningServer
from tests.adapters.peft_adapters import edit_weights
from tests.gateway.conftest import json_of

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def upload(admin: httpx.Client, name: str, owner: str, folder: Path) -> httpx.Response:
    """Upload the two adapter files as separate multipart fields."""
    config, model = ((folder / f).read_bytes() for f in ADAPTER_FILES)
    return admin.post(
        "/admin/adapters",
        data={"name": name, "owner": owner},
        files={
            "adapter_config": ("adapter_config.json", config),
            "adapter_model": ("adapter_model.safetensors", model),
        },
    )


def upload_archive(
    admin: httpx.Client, name: str, owner: str, archive: bytes, filename: str
) -> httpx.Response:
    return admin.post(
        "/admin/adapters",
        data={"name": name, "owner": owner},
        files={"archive": (filename, archive)},
    )


def zipped(folder: Path, prefix: str = "") -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name in (*ADAPTER_FILES, "README.md"):
            archive.write(folder / name, prefix + name)
    return buffer.getvalue()


def tarred(folder: Path, prefix: str = "") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name in ADAPTER_FILES:
            archive.add(folder / name, prefix + name)
    return buffer.getvalue()


def created(response: httpx.Response) -> dict:
    assert response.status_code == 201, response.text
    return json_of(response)


def servable(gateway: RunningServer, digest: str) -> bool:
    """Whether the in-process engine accepts new requests for `digest`."""
    return gateway.state.engine.engine.engine.lora.is_servable(digest)


@pytest.fixture
def tenant(admin: httpx.Client) -> dict:
    return json_of(admin.post("/admin/tenants", json={"name": unique("adapters")}))


def own_copy(folder: Path, tmp_path: Path) -> Path:
    """`folder`'s adapter with weights of its own (lora_A scaled by a random factor): a digest no
    other test's adapter shares, so that retiring it is this test's business alone."""
    copy = tmp_path / f"own-{uuid.uuid4().hex[:8]}"
    shutil.copytree(folder, copy)
    factor = 1 + random.random()
    edit_weights(copy, lambda ws: {n: w * factor if "lora_A" in n else w for n, w in ws.items()})
    return copy


def test_upload_list_new_version_delete(
    gateway: RunningServer,
    admin: httpx.Client,
    demo_adapter_dirs: list[Path],
    tenant: dict,
    tmp_path: Path,
) -> None:
    adapters = [own_copy(folder, tmp_path) for folder in demo_adapter_dirs[:2]]
    name = unique("support")
    first = created(upload(admin, name, tenant["id"], adapters[0]))
    assert (first["owner"], first["name"], first["version"]) == (tenant["id"], name, 1)
    assert (first["rank"], len(first["targets"])) == (8, 7)
    assert first["size_bytes"] > 0 and len(first["digest"]) == 64
    assert first["digest"] in gateway.state.store
    assert servable(gateway, first["digest"])

    listed = json_of(admin.get("/admin/adapters", params={"owner": tenant["id"]}))["items"]
    assert listed == [first]
    assert first in json_of(admin.get("/admin/adapters", params={"name": name}))["items"]

    second = created(upload(admin, name, tenant["id"], adapters[1]))
    assert second["version"] == 2 and second["digest"] != first["digest"]
    assert servable(gateway, second["digest"]) and not servable(gateway, first["digest"])
    detail = json_of(admin.get(f"/admin/adapters/{tenant['id']}/{name}"))
    assert detail["latest"] == second and detail["versions"] == [first, second]
    assert json_of(admin.get("/admin/adapters", params={"owner": tenant["id"]}))["items"] == [
        second
    ]

    deleted = admin.delete(f"/admin/adapters/{tenant['id']}/{name}")
    assert deleted.status_code == 200 and json_of(deleted)["detail"] == {"versions": 2}
    assert not servable(gateway, second["digest"])
    assert admin.get(f"/admin/adapters/{tenant['id']}/{name}").status_code == 404
    assert admin.delete(f"/admin/adapters/{tenant['id']}/{name}").status_code == 404
    assert json_of(admin.get("/admin/adapters", params={"owner": tenant["id"]}))["items"] == []

    again = created(upload(admin, name, tenant["id"], adapters[0]))
    assert again["version"] == 3 and again["digest"] == first["digest"]
    assert servable(gateway, again["digest"])


def test_uploading_the_current_bytes_again_answers_the_current_version(
    gateway: RunningServer, admin: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    name = unique("same")
    first = created(upload(admin, name, "shared", demo_adapter_dirs[2]))
    again = upload(admin, name, "shared", demo_adapter_dirs[2])
    assert again.status_code == 200, again.text
    assert json_of(again) == first
    assert json_of(admin.get(f"/admin/adapters/shared/{name}"))["versions"] == [first]
    assert servable(gateway, first["digest"])


@pytest.mark.parametrize(
    ("pack", "filename", "prefix"),
    [
        (zipped, "adapter.zip", ""),
        (zipped, "adapter.zip", "my-adapter/"),
        (tarred, "adapter.tar.gz", ""),
        (tarred, "adapter.tar.gz", "./my-adapter/"),
    ],
)
def test_archives(
    admin: httpx.Client, demo_adapter_dirs: list[Path], pack, filename: str, prefix: str
) -> None:
    folder = demo_adapter_dirs[3]
    by_files = created(upload(admin, unique("files"), "shared", folder))
    by_archive = created(
        upload_archive(admin, unique("archive"), "shared", pack(folder, prefix), filename)
    )
    assert by_archive["digest"] == by_files["digest"]


def test_a_digest_shared_by_two_adapters_stays_while_either_serves(
    gateway: RunningServer, admin: httpx.Client, demo_adapter_dirs: list[Path], tenant: dict
) -> None:
    # Folders no other test uploads: a digest that another test published stays servable.
    a, b = unique("twin-a"), unique("twin-b")
    shared_digest = created(upload(admin, a, tenant["id"], demo_adapter_dirs[34]))["digest"]
    created(upload(admin, b, tenant["id"], demo_adapter_dirs[34]))
    created(upload(admin, a, tenant["id"], demo_adapter_dirs[35]))  # a moves on
    assert servable(gateway, shared_digest)  # b still serves it
    admin.delete(f"/admin/adapters/{tenant['id']}/{b}")
    assert not servable(gateway, shared_digest)


def test_deleting_a_tenant_retires_its_private_adapters(
    gateway: RunningServer, admin: httpx.Client, demo_adapter_dirs: list[Path], tenant: dict
) -> None:
    private = created(upload(admin, unique("private"), tenant["id"], demo_adapter_dirs[33]))
    deleted = json_of(admin.delete(f"/admin/tenants/{tenant['id']}"))
    assert deleted["detail"]["adapter_versions"] == 1
    assert not servable(gateway, private["digest"])
    assert admin.get("/admin/adapters", params={"owner": tenant["id"]}).status_code == 404


@pytest.mark.parametrize(
    ("name", "owner", "status", "code"),
    [
        ("has space", "shared", 400, "invalid_adapter_name"),
        ("slash/name", "shared", 400, "invalid_adapter_name"),
        ("x" * 65, "shared", 400, "invalid_adapter_name"),
        ("..", "shared", 400, "invalid_adapter_name"),
        (".", "shared", 400, "invalid_adapter_name"),
        ("-", "shared", 400, "invalid_adapter_name"),
        ("-rf", "shared", 400, "invalid_adapter_name"),
        (".hidden", "shared", 400, "invalid_adapter_name"),
        ("a..b", "shared", 400, "invalid_adapter_name"),
        ("_x", "shared", 400, "invalid_adapter_name"),
        ("caf\u00e9", "shared", 400, "invalid_adapter_name"),
        ("x\u202ey", "shared", 400, "invalid_adapter_name"),
        ("<the base model>", "shared", 400, "invalid_adapter_name"),
        ("fine", "tnt_doesnotexist", 404, "tenant_not_found"),
    ],
)
def test_bad_names_and_owners(
    gateway: RunningServer,
    admin: httpx.Client,
    demo_adapter_dirs: list[Path],
    name: str,
    owner: str,
    status: int,
    code: str,
) -> None:
    before = gateway.state.store.digests()
    name = gateway.state.model_name if name == "<the base model>" else name
    response = upload(admin, name, owner, demo_adapter_dirs[7])
    assert response.status_code == status, response.text
    assert json_of(response)["error"]["code"] == code
    assert gateway.state.store.digests() == before


def test_names_within_the_rule_are_accepted(
    admin: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    suffix = uuid.uuid4().hex[:8]
    for name in (f"A{suffix}", f"9.v1_2-x.{suffix}", f"{suffix}x" + "y" * 55):
        assert created(upload(admin, name, "shared", demo_adapter_dirs[7]))["name"] == name
        assert admin.delete(f"/admin/adapters/shared/{name}").status_code == 200
