"""Every admin change leaves an audit entry: who, what, on what, and how it ended."""

from __future__ import annotations

import logging
import sqlite3
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from loramux.gateway.audit.service import AuditLog
from loramux.gateway.dashboard.session import LOGIN
from loramux.gateway.db.session import create_engine, session_factory
from loramux.gateway.server import RunningServer
from tests.gateway.conftest import admin_client, json_of
from tests.gateway.servers import gateway_server


def test_changes_and_failures_are_audited(
    admin: httpx.Client, demo_adapter_dirs: list[Path]
) -> None:
    name = f"audit-{uuid.uuid4().hex[:8]}"
    tenant = json_of(admin.post("/admin/tenants", json={"name": name}))
    tid = tenant["id"]
    assert admin.post("/admin/tenants", json={"name": name}).status_code == 409
    admin.patch(f"/admin/tenants/{tid}", json={"disabled": True})
    key = json_of(admin.post(f"/admin/tenants/{tid}/keys", json={"name": "k"}))
    admin.put(f"/admin/tenants/{tid}/quotas", json={"rpm": 5, "tpm": None})
    admin.put(f"/admin/keys/{key['id']}/quotas", json={"rpm": -1})
    admin.delete(f"/admin/keys/{key['id']}")
    folder = demo_adapter_dirs[10]
    admin.post(
        "/admin/adapters",
        data={"name": "a1", "owner": tid},
        files={
            "adapter_config": ("c", (folder / "adapter_config.json").read_bytes()),
            "adapter_model": ("m", (folder / "adapter_model.safetensors").read_bytes()),
        },
    )
    admin.delete(f"/admin/adapters/{tid}/a1")
    admin.delete(f"/admin/tenants/{tid}")

    entries = json_of(admin.get("/admin/audit", params={"limit": 12}))["items"]
    seen = [(e["action"], e["target"], e["outcome"]) for e in reversed(entries)]
    assert seen[-10:] == [
        ("tenant.create", tid, "ok"),
        ("tenant.create", None, "name_taken"),
        ("tenant.update", tid, "ok"),
        ("key.create", key["id"], "ok"),
        ("quota.tenant.set", tid, "ok"),
        ("quota.key.set", key["id"], "invalid_request"),
        ("key.revoke", key["id"], "ok"),
        ("adapter.upload", f"{tid}/a1", "ok"),
        ("adapter.delete", f"{tid}/a1", "ok"),
        ("tenant.delete", tid, "ok"),
    ]
    by_action = {e["action"]: e for e in entries if e["target"] in (tid, f"{tid}/a1", None)}
    assert by_action["tenant.update"]["detail"] == {"disabled": True}
    assert by_action["quota.tenant.set"]["detail"] == {"rpm": 5, "tpm": None}
    assert set(by_action["adapter.upload"]["detail"]) == {"version", "digest"}
    assert by_action["tenant.delete"]["detail"] == {
        "keys": 1,
        "adapter_versions": 0,
        "cache_entries": 0,
    }
    assert {e["actor"] for e in entries[:10]} == {"test-admin"}
    assert all(e["created_at"].endswith("Z") for e in entries)


def test_a_refused_key_create_is_audited_with_the_tenant_it_was_for(admin: httpx.Client) -> None:
    tenant = json_of(admin.post("/admin/tenants", json={"name": f"audit-{uuid.uuid4().hex[:8]}"}))
    for ref in (tenant["id"], tenant["name"]):
        past = {"expires_at": "2001-01-01T00:00:00Z"}
        assert admin.post(f"/admin/tenants/{ref}/keys", json=past).status_code == 400
        [entry] = json_of(admin.get("/admin/audit", params={"limit": 1}))["items"]
        assert (entry["action"], entry["outcome"]) == ("key.create", "invalid_request")
        assert entry["detail"]["tenant"] == ref, entry


def test_limit(admin: httpx.Client) -> None:
    assert len(json_of(admin.get("/admin/audit", params={"limit": 1}))["items"]) == 1
    assert admin.get("/admin/audit", params={"limit": 0}).status_code == 400
    assert admin.get("/admin/audit", params={"limit": 5000}).status_code == 400


def test_an_action_on_a_reference_holding_nul_is_audited(each_gateway: RunningServer) -> None:
    """An admin's action on a tenant reference holding NUL fails (404) and leaves its entry, its
    target written with `\\x00`, on both databases. PostgreSQL cannot store NUL: the action
    answered 500 and its entry was lost (the failed write only logged)."""
    marker = f"nul-{uuid.uuid4().hex[:8]}"
    with admin_client(each_gateway) as admin:
        response = admin.patch(f"/admin/tenants/{marker}%00", json={"disabled": True})
        assert response.status_code == 404, response.text
        entries = json_of(admin.get("/admin/audit", params={"name": marker}))["items"]
    assert [(e["action"], e["target"], e["outcome"]) for e in entries] == [
        ("tenant.update", f"{marker}\\x00", "not_found")
    ]


def test_an_admin_token_refused_at_the_dashboards_sign_in_is_audited(
    gateway: RunningServer, admin: httpx.Client
) -> None:
    """The dashboard's sign-in takes admin tokens too: a refused one is audited there as the
    admin API's guard audits it, so guessing tokens through the form shows in the audit log
    (found by attacking the dashboard: 20 refused tokens left no entry)."""
    marker = f"not-a-token-{uuid.uuid4().hex}"
    with httpx.Client(base_url=gateway.url, timeout=30) as anonymous:
        for _ in range(3):
            refused = anonymous.post("/dashboard/login", data={"credential": marker})
            assert refused.status_code == 401
    entries = json_of(admin.get("/admin/audit", params={"limit": 500}))["items"]
    ours = [e for e in entries if e["action"] == "admin.auth" and e["target"] == LOGIN]
    assert len(ours) >= 3
    assert {(e["actor"], e["outcome"]) for e in ours} == {("anonymous", "invalid_token")}


@contextmanager
def errors_logged() -> Iterator[list[logging.LogRecord]]:
    """The records of ERROR and above that loramux's loggers write meanwhile."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("loramux").addHandler(handler)
    try:
        yield records
    finally:
        logging.getLogger("loramux").removeHandler(handler)


def test_a_path_a_stranger_chose_cannot_forge_log_lines(
    demo_model_dir: Path, tmp_path: Path, redis_url: str
) -> None:
    """A refused token's entry that cannot be written (the database busy) is logged with its
    target, the decoded path: its `%0D%0A` ended the line and began one the stranger wrote."""
    forged = "INFO - 2026-11-27 00:00:00,000 - loramux.gateway.admin - admin token of root ok"
    path = "/admin/tenants/x%0D%0A" + forged.replace(" ", "%20")
    with gateway_server(demo_model_dir, tmp_path / "gw", redis_url) as gw, errors_logged() as log:
        holder = sqlite3.connect(gw.state.settings.database_url.removeprefix("sqlite:///"))
        holder.execute("BEGIN EXCLUSIVE")  # another writer holds the database
        try:
            r = httpx.get(gw.url + path, headers={"authorization": "Bearer x"}, timeout=60)
        finally:
            holder.execute("ROLLBACK")
            holder.close()
    assert r.status_code == 401
    [line] = [m for rec in log if "audit entry" in (m := rec.getMessage())]
    assert "\n" not in line and "\r" not in line
    assert "x\\r\\nINFO" in line  # the path is in it, escaped


async def test_entries_that_cannot_be_written_are_logged_once_per_interval(tmp_path: Path) -> None:
    """While the database refuses writes, each request with a bad admin token fails one: the
    first is logged with its error, the next ones only counted."""
    audit = AuditLog(session_factory(create_engine(f"sqlite:///{tmp_path / 'no-tables.db'}")))
    with errors_logged() as log:
        for _ in range(3):
            await audit.write("anonymous", "admin.auth", "GET /admin/x", "invalid_token", {})
    assert [r.getMessage() for r in log] == [
        "could not write the audit entry for admin.auth on 'GET /admin/x' "
        "(and 0 more not logged since the last such line)"
    ]
    assert log[0].exc_info is not None
