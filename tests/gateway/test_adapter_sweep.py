"""A gateway starting sweeps the adapter files processes that died mid-way left behind
(gateway.adapters.sweep), and nothing else: a publish killed between its put and its commit,
a delete killed between its commit and its cleanup, a put's staging folder and an upload's
workspace. Before, nothing ever removed them."""

from __future__ import annotations

import os
import time
from pathlib import Path

import httpx
from sqlalchemy import update

from loramux.gateway.db import AdapterVersion
from loramux.gateway.server import RunningServer
from tests.adapters.claim_holder import claim_held_elsewhere
from tests.gateway.servers import gateway_server
from tests.gateway.tenants import new_tenant, upload_adapter

HOURS_AGO = time.time() - 2 * 3600


def age(path: Path) -> Path:
    """`path` and everything in it, last changed two hours ago."""
    for entry in [path, *path.rglob("*")]:
        os.utime(entry, (HOURS_AGO, HOURS_AGO), follow_symlinks=False)
    return path


def admin_of(server: RunningServer) -> httpx.Client:
    token = server.state.admin.mint("sweep", ttl_seconds=600)
    return httpx.Client(
        base_url=server.url, headers={"authorization": f"Bearer {token}"}, timeout=60
    )


def soft_delete_row(server: RunningServer, digest: str) -> None:
    """A delete's commit, without its cleanup (the process died in between)."""

    async def delete() -> None:
        async with server.state.sessions() as session:
            deleted = update(AdapterVersion).where(AdapterVersion.digest == digest)
            await session.execute(deleted.values(deleted_at=AdapterVersion.created_at))
            await session.commit()

    server.run(delete())


def sweep_of(server: RunningServer) -> list[str]:
    async def swept() -> list[str]:
        assert server.state.sweeping is not None
        return await server.state.sweeping

    return server.run(swept())


def test_a_starting_gateway_sweeps_what_dead_processes_left_and_nothing_else(
    demo_model_dir: Path, demo_adapter_dirs: list[Path], tmp_path: Path, redis_url: str
) -> None:
    data = tmp_path / "data"
    with gateway_server(demo_model_dir, data, redis_url) as server, admin_of(server) as admin:
        store = server.state.store
        tenant = new_tenant(admin, "sweep")
        live = upload_adapter(admin, tenant.tenant_id, "live", demo_adapter_dirs[13])["digest"]
        deleted = upload_adapter(admin, tenant.tenant_id, "gone", demo_adapter_dirs[14])
        soft_delete_row(server, deleted["digest"])
        unnamed, claimed, fresh = (store.put(d).digest for d in demo_adapter_dirs[15:18])
        staging = store.root / ".incoming" / "tmp-dead"
        staging.mkdir()
        (staging / "adapter_model.safetensors").write_bytes(b"half")
        uploads = data / "uploads"
        for name in ("upload-dead", "upload-under-way"):
            (uploads / name).mkdir(parents=True)
            (uploads / name / "upload.archive").write_bytes(b"part")
    for digest in (live, deleted["digest"], unnamed, claimed):
        age(store.root / digest)
    age(staging)
    age(uploads / "upload-dead")

    with (
        claim_held_elsewhere(store.root, claimed),
        gateway_server(demo_model_dir, data, redis_url) as server,
    ):
        swept = sweep_of(server)
        store = server.state.store
        answer = httpx.post(
            f"{server.url}/v1/chat/completions",
            headers={"authorization": f"Bearer {tenant.key}"},
            json={"model": "live", "messages": [{"role": "user", "content": "hi"}]},
            timeout=60,
        )
    assert answer.status_code == 200, answer.text
    assert sorted(swept) == sorted([unnamed, deleted["digest"]])
    assert unnamed not in store and deleted["digest"] not in store
    assert live in store, "a live version's files stay"
    assert claimed in store, "a digest a publish claims is left to it"
    assert fresh in store, "a put under way in another worker is left to it"
    assert not staging.exists() and not (uploads / "upload-dead").exists()
    assert (uploads / "upload-under-way").exists()
