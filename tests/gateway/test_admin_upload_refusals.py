"""Hostile or broken adapter uploads: each is refused with a 4xx and leaves nothing behind:
no store folder, no database row, no upload leftovers, nothing registered in the engine."""

from __future__ import annotations

import http.client
import io
import stat
import tarfile
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import IA3Config, LoraConfig, get_peft_model
from sqlalchemy import func, select
from transformers import LlamaForCausalLM

from loramux.gateway.db import AdapterVersion
from loramux.gateway.server import RunningServer
from tests.adapters.peft_adapters import make_peft_adapter, tiny_model
from tests.gateway.conftest import json_of

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def snapshot(gateway: RunningServer) -> dict[str, Any]:
    """Everything an upload could leave behind."""
    state = gateway.state
    store = state.store.root
    uploads = state.settings.data_dir / "uploads"

    async def rows() -> int:
        async with state.sessions() as session:
            return int(await session.scalar(select(func.count(AdapterVersion.id))) or 0)

    return {
        "store": sorted(p.name for p in store.iterdir()),
        "incoming": sorted(p.name for p in (store / ".incoming").iterdir()),
        "uploads": sorted(p.name for p in uploads.iterdir()) if uploads.exists() else [],
        "rows": gateway.run(rows()),
        "engine": sorted(state.engine.engine.adapter_stats()),
    }


def post_files(
    admin: httpx.Client, files: dict[str, tuple[str, bytes]], **data: str
) -> httpx.Response:
    fields = {"name": f"evil-{uuid.uuid4().hex[:8]}", "owner": "shared"} | data
    return admin.post("/admin/adapters", data=fields, files=files)


def folder_files(folder: Path) -> dict[str, tuple[str, bytes]]:
    return {
        "adapter_config": (CONFIG, (folder / CONFIG).read_bytes()),
        "adapter_model": (WEIGHTS, (folder / WEIGHTS).read_bytes()),
    }


def zip_of(members: dict[str, bytes], infos: tuple[zipfile.ZipInfo, ...] = ()) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for info in infos:
            archive.writestr(info, b"/etc/passwd")
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def tar_of(members: dict[str, bytes], infos: tuple[tarfile.TarInfo, ...] = ()) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for info in infos:
            archive.addfile(info)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def lying_zip(members: dict[str, bytes], claimed_size: int) -> bytes:
    """A zip whose central directory claims `claimed_size` bytes for its weights file."""
    data = bytearray(zip_of(members))
    entry = data.find(b"PK\x01\x02", data.find(b"PK\x01\x02") + 1)  # the weights entry
    data[entry + 24 : entry + 28] = claimed_size.to_bytes(4, "little")
    return bytes(data)


def demo_model(demo_model_dir: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32)


def saved(model: Any, config: Any, folder: Path) -> Path:
    get_peft_model(model, config).save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def adapters(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], tmp_path_factory
) -> dict[str, Path]:
    """Refusable adapters: genuine PEFT output that does not fit, or a good one to wrap."""
    root = tmp_path_factory.mktemp("refused")
    lora = {"init_lora_weights": False, "target_modules": ["q_proj", "v_proj"]}
    return {
        "good": demo_adapter_dirs[9],
        # Same depth as the demo model (4 layers), narrower: every shape is wrong.
        "other model size": make_peft_adapter(root / "tiny", model=tiny_model(num_hidden_layers=4)),
        "rank 512": saved(demo_model(demo_model_dir), LoraConfig(r=512, **lora), root / "r512"),
        "rank 128": saved(demo_model(demo_model_dir), LoraConfig(r=128, **lora), root / "r128"),
        "ia3": saved(
            demo_model(demo_model_dir),
            IA3Config(target_modules=["v_proj", "down_proj"], feedforward_modules=["down_proj"]),
            root / "ia3",
        ),
        "added tokens": saved(
            with_added_tokens(demo_model(demo_model_dir)),
            LoraConfig(modules_to_save=["embed_tokens"], **lora),
            root / "tokens",
        ),
        "embedding of another model": saved(
            with_other_embedding(demo_model(demo_model_dir)),
            LoraConfig(r=8, init_lora_weights=False, target_modules=["embed_tokens"]),
            root / "other-embedding",
        ),
        "dora on lm_head": saved(
            demo_model(demo_model_dir),
            LoraConfig(r=8, init_lora_weights=False, target_modules=["lm_head"], use_dora=True),
            root / "dora-head",
        ),
    }


def with_added_tokens(model: LlamaForCausalLM) -> LlamaForCausalLM:
    model.resize_token_embeddings(model.config.vocab_size + 8)
    return model


def with_other_embedding(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The demo model's shapes with another embedding: PEFT saves it beside the pair."""
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.5)
    return model


def good_members(adapters: dict[str, Path]) -> dict[str, bytes]:
    return {name: (adapters["good"] / name).read_bytes() for name in (CONFIG, WEIGHTS)}


def symlink_zip_info() -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(WEIGHTS)
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


def symlink_tar_info() -> tarfile.TarInfo:
    info = tarfile.TarInfo("link")
    info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
    return info


ARCHIVES: dict[str, tuple[Callable[[dict[str, bytes]], bytes], int, str]] = {
    "pickled .bin": (
        lambda m: zip_of({CONFIG: m[CONFIG], "adapter_model.bin": b"\x80\x04K\x01."}),
        400,
        "unsafe_archive",
    ),
    "path leaving the folder": (
        lambda m: zip_of({"../" + CONFIG: m[CONFIG], WEIGHTS: m[WEIGHTS]}),
        400,
        "unsafe_archive",
    ),
    "absolute path": (lambda m: tar_of({"/tmp/" + CONFIG: m[CONFIG]}), 400, "unsafe_archive"),
    "zip symlink": (
        lambda m: zip_of({CONFIG: m[CONFIG]}, (symlink_zip_info(),)),
        400,
        "unsafe_archive",
    ),
    "tar symlink": (lambda m: tar_of(m, (symlink_tar_info(),)), 400, "unsafe_archive"),
    "ratio bomb": (
        lambda m: zip_of({CONFIG: m[CONFIG], WEIGHTS: bytes(100 << 20)}),
        413,
        "file_too_large",
    ),
    "size bomb": (lambda m: lying_zip(m, 0xFFFFFFF0), 413, "file_too_large"),
    "not an archive": (lambda m: m[WEIGHTS], 400, "invalid_archive"),
    "truncated zip": (lambda m: zip_of(m)[:-100], 400, "invalid_archive"),
}


@pytest.mark.parametrize("case", list(ARCHIVES))
def test_hostile_archives(
    gateway: RunningServer, admin: httpx.Client, adapters: dict[str, Path], case: str
) -> None:
    build, status, code = ARCHIVES[case]
    archive = build(good_members(adapters))
    before = snapshot(gateway)
    response = post_files(admin, {"archive": ("adapter.zip", archive)})
    assert response.status_code == status, response.text
    assert json_of(response)["error"]["code"] == code
    assert snapshot(gateway) == before


ADAPTERS = {
    "other model size": "shape_mismatch",
    "rank 512": "rank_over_limit",
    "rank 128": "rank_over_limit",  # within the store's limit, over the engine's: rolled back
    "ia3": "not_lora",
    "added tokens": "added_tokens_unsupported",
    # Only the engine holds the base weights to compare with: rolled back like rank 128.
    "embedding of another model": "base_weights_differ",
    "dora on lm_head": "dora_unsupported",
}


@pytest.mark.parametrize("case", list(ADAPTERS))
def test_adapters_that_do_not_fit(
    gateway: RunningServer, admin: httpx.Client, adapters: dict[str, Path], case: str
) -> None:
    before = snapshot(gateway)
    response = post_files(admin, folder_files(adapters[case]))
    assert response.status_code == 400, response.text
    assert json_of(response)["error"]["code"] == ADAPTERS[case]
    assert snapshot(gateway) == before


def broken(adapters: dict[str, Path], config: bytes | None, weights: bytes | None) -> dict:
    files = folder_files(adapters["good"])
    if config is not None:
        files["adapter_config"] = (CONFIG, config)
    if weights is not None:
        files["adapter_model"] = (WEIGHTS, weights)
    return files


@pytest.mark.parametrize(
    ("config", "weights", "code"),
    [
        (b"{not json", None, "invalid_config"),
        (b"[1, 2]", None, "invalid_config"),
        (b"[" * 100_000 + b"]" * 100_000, None, "invalid_config"),
        (b'{"peft_type": "LORA", "x": ' + b"[" * 950 + b"]" * 950 + b"}", None, "invalid_config"),
        (b'{"peft_type": "LORA", "\\udc80x": 1}', None, "unsupported_option"),
        (None, b"\x80\x04\x95 pickled torch weights", "invalid_weights"),
        (None, b"", "invalid_weights"),
    ],
)
def test_broken_files(
    gateway: RunningServer,
    admin: httpx.Client,
    adapters: dict[str, Path],
    config: bytes | None,
    weights: bytes | None,
    code: str,
) -> None:
    before = snapshot(gateway)
    response = post_files(admin, broken(adapters, config, weights))
    assert response.status_code == 400, response.text
    assert json_of(response)["error"]["code"] == code
    assert snapshot(gateway) == before


@pytest.mark.parametrize(
    "parts",
    [
        {"files": ["adapter_config"]},
        {"files": ["archive", "adapter_config", "adapter_model"]},
        {"files": ["adapter_config", "adapter_model"], "drop": "owner"},
        {"files": ["adapter_config", "adapter_model"], "extra": "script"},
    ],
)
def test_incomplete_or_extra_form_fields(
    gateway: RunningServer, admin: httpx.Client, adapters: dict[str, Path], parts: dict
) -> None:
    good = folder_files(adapters["good"]) | {"archive": ("a.zip", zip_of(good_members(adapters)))}
    files = {name: good[name] for name in parts["files"]}
    if "extra" in parts:
        files[parts["extra"]] = ("run.sh", b"#!/bin/sh\n")
    data = {"name": f"form-{uuid.uuid4().hex[:8]}", "owner": "shared"}
    data.pop(parts.get("drop", ""), None)
    before = snapshot(gateway)
    response = admin.post("/admin/adapters", data=data, files=files)
    assert response.status_code == 400, response.text
    assert json_of(response)["error"]["code"] == "invalid_upload"
    assert snapshot(gateway) == before


def test_not_multipart(gateway: RunningServer, admin: httpx.Client) -> None:
    response = admin.post("/admin/adapters", json={"name": "x", "owner": "shared"})
    assert response.status_code == 400
    assert json_of(response)["error"]["code"] == "invalid_upload"


def test_a_body_over_the_upload_limit_is_refused_before_it_is_read(
    gateway: RunningServer, admin_token: str
) -> None:
    before = snapshot(gateway)
    host, port = gateway.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.putrequest("POST", "/admin/adapters")
    conn.putheader("authorization", f"Bearer {admin_token}")
    conn.putheader("content-type", "multipart/form-data; boundary=b0undary")
    conn.putheader("content-length", str(1 << 40))
    conn.endheaders()
    conn.send(b"--b0undary\r\n")
    response = conn.getresponse()
    assert response.status == 413
    conn.close()
    assert snapshot(gateway) == before


def test_refusals_are_audited(gateway: RunningServer, admin: httpx.Client, adapters) -> None:
    name = f"audited-{uuid.uuid4().hex[:8]}"
    post_files(admin, folder_files(adapters["ia3"]), name=name)
    entries = json_of(admin.get("/admin/audit", params={"limit": 50}))["items"]
    entry = next(e for e in entries if e["target"] == f"shared/{name}")
    assert (entry["action"], entry["outcome"]) == ("adapter.upload", "not_lora")
    assert "LORA" in entry["detail"]["error"]
