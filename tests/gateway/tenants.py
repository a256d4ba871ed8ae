"""Test helpers that set things up through the admin API, as an operator would."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class TenantKey:
    tenant_id: str
    tenant_name: str
    key_id: str
    key: str


def new_tenant(admin: httpx.Client, prefix: str = "t", **key_options: Any) -> TenantKey:
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    r = admin.post("/admin/tenants", json={"name": name})
    assert r.status_code == 201, r.text
    tenant = r.json()
    return TenantKey(tenant["id"], name, *new_key(admin, tenant["id"], **key_options))


def new_key(admin: httpx.Client, tenant_id: str, **options: Any) -> tuple[str, str]:
    r = admin.post(f"/admin/tenants/{tenant_id}/keys", json=options)
    assert r.status_code == 201, r.text
    return r.json()["id"], r.json()["key"]


def upload_adapter(admin: httpx.Client, owner: str, name: str, folder: Path) -> dict[str, Any]:
    files = {
        "adapter_config": (
            "adapter_config.json",
            (folder / "adapter_config.json").read_bytes(),
            "application/json",
        ),
        "adapter_model": (
            "adapter_model.safetensors",
            (folder / "adapter_model.safetensors").read_bytes(),
            "application/octet-stream",
        ),
    }
    r = admin.post("/admin/adapters", data={"name": name, "owner": owner}, files=files)
    assert r.status_code == 201, r.text
    return r.json()
