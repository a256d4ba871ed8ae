"""Where an adapter's files live through publishes, failures and deletes (gateway.adapters.service):
the shared store keeps every live version's files and drops a version's once no live version
names it; a failed publish never removes files another publish of the same bytes is using.
Found by attacking the admin API (2026-11-27)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from loramux.adapters.base_spec import BaseModelSpec
from loramux.adapters.store import AdapterStore
from loramux.gateway.adapters import service as service_module
from loramux.gateway.adapters.claiming import claim
from loramux.gateway.adapters.service import AdapterService
from loramux.gateway.errors import ServiceUnavailable
from loramux.gateway.server import RunningServer
from tests.adapters.claim_holder import claim_held_elsewhere
from tests.gateway.servers import gateway_server
from tests.gateway.tenants import new_tenant, upload_adapter


@pytest.fixture
def shared_gateway(
    demo_model_dir: Path, tmp_path: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[RunningServer]:
    """A gateway whose shared adapter store is its own database."""
    monkeypatch.setenv("LORAMUX_ADAPTER_STORE_URL", "db")
    with gateway_server(demo_model_dir, tmp_path / "data", redis_url) as server:
        yield server


def admin_of(server: RunningServer) -> httpx.Client:
    token = server.state.admin.mint("files", ttl_seconds=600)
    return httpx.Client(
        base_url=server.url, headers={"authorization": f"Bearer {token}"}, timeout=60
    )


def post_upload(admin: httpx.Client, owner: str, name: str, folder: Path) -> httpx.Response:
    """The admin upload of the adapter in `folder`, whatever its answer."""
    files = {
        part: (file, (folder / file).read_bytes())
        for part, file in (
            ("adapter_config", "adapter_config.json"),
            ("adapter_model", "adapter_model.safetensors"),
        )
    }
    return admin.post("/admin/adapters", data={"name": name, "owner": owner}, files=files)


def test_the_stores_keep_live_versions_files_and_drop_deleted_ones(
    shared_gateway: RunningServer, demo_adapter_dirs: list[Path]
) -> None:
    """A version's files leave the local and the shared store once no live version names its
    digest, and not before: an older live version is pinnable (`name@1`). The shared store's
    delete was rolled back with the request's session, and the local store's never happened:
    deleted adapters' weights stayed on disk and in the database for good."""
    server, shared = shared_gateway, shared_gateway.state.shared_store
    assert shared is not None

    def stored(digest: str) -> bool:
        in_shared = bool(server.run(shared.has(digest)))
        assert in_shared == (digest in server.state.store), "the two stores agree"
        return in_shared

    with admin_of(server) as admin:
        tenant = new_tenant(admin)
        v1 = upload_adapter(admin, tenant.tenant_id, "bot", demo_adapter_dirs[2])
        v2 = upload_adapter(admin, tenant.tenant_id, "bot", demo_adapter_dirs[3])
        v3 = upload_adapter(admin, tenant.tenant_id, "bot", demo_adapter_dirs[4])
        same = upload_adapter(admin, tenant.tenant_id, "twin", demo_adapter_dirs[3])
        assert stored(v1["digest"]) and stored(v2["digest"]) and stored(v3["digest"])
        deleted = admin.delete(f"/admin/adapters/{tenant.tenant_id}/bot/versions/2")
        assert deleted.status_code == 200, deleted.text
        assert stored(v2["digest"]), "another adapter names the same bytes"
        assert admin.delete(f"/admin/adapters/{tenant.tenant_id}/twin").status_code == 200
        assert same["digest"] == v2["digest"] and not stored(v2["digest"])
        assert stored(v1["digest"]) and stored(v3["digest"])
        assert admin.delete(f"/admin/adapters/{tenant.tenant_id}/bot").status_code == 200
        assert not stored(v1["digest"]) and not stored(v3["digest"])


def test_a_failed_publish_leaves_the_files_of_the_same_bytes_being_published_by_another(
    shared_gateway: RunningServer, demo_adapter_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tenants A and B upload identical bytes (one content digest). A's publish has loaded the
    digest in the engine and not yet committed its row when B's publish fails (the engine
    restarting: injected). B's failure used to delete the digest's folder, so A's adapter was
    published without files and every request on it failed. Now A's adapter serves."""
    server = shared_gateway
    engine = server.state.engine
    real = engine.ensure_adapter
    calls: list[str] = []
    a_loaded, a_may_commit = threading.Event(), threading.Event()

    async def ensure_adapter(digest: str, folder: Path) -> None:
        calls.append(digest)
        if len(calls) == 1:  # A's publish: loads, then waits before committing its row
            await real(digest, folder)
            a_loaded.set()
            await asyncio.to_thread(a_may_commit.wait, 30)
        elif len(calls) == 2:  # B's publish of the same bytes
            raise ServiceUnavailable("the engine is restarting")
        else:
            await real(digest, folder)

    monkeypatch.setattr(engine, "ensure_adapter", ensure_adapter)
    folder = demo_adapter_dirs[10]
    with admin_of(server) as admin:
        a, b = new_tenant(admin, "same-a"), new_tenant(admin, "same-b")
        published: dict[str, Any] = {}
        publishing = threading.Thread(
            target=lambda: published.update(upload_adapter(admin, a.tenant_id, "x", folder))
        )
        publishing.start()
        assert a_loaded.wait(30)
        refused = post_upload(admin, b.tenant_id, "y", folder)
        assert refused.status_code == 503, refused.text
        a_may_commit.set()
        publishing.join(30)
    assert published["digest"] in server.state.store
    answer = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"authorization": f"Bearer {a.key}"},
        json={"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text


def test_a_digest_another_worker_is_publishing_keeps_its_files_through_deletes_and_failures(
    shared_gateway: RunningServer, demo_adapter_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another gateway worker (another process) is publishing tenant A's upload of the same
    bytes as tenant B's adapter, between its store and its commit (it holds the digest's
    claim). B deletes its adapter, then B's next publish of those bytes fails (the engine
    restarting: injected): the digest's files stay in the local and the shared store, and the
    engine keeps it, for A's publish to commit. Across processes the in-process count of
    publishes under way saw none, and both cleanups removed them."""
    server, shared = shared_gateway, shared_gateway.state.shared_store
    assert shared is not None
    folder = demo_adapter_dirs[11]
    with admin_of(server) as admin:
        b = new_tenant(admin, "claimed-b")
        digest = upload_adapter(admin, b.tenant_id, "y", folder)["digest"]
        engine = server.state.engine
        retired: list[str] = []
        retire = engine.retire_adapter

        async def retire_adapter(digest: str) -> None:  # the real one, watched
            retired.append(digest)
            await retire(digest)

        monkeypatch.setattr(engine, "retire_adapter", retire_adapter)
        with claim_held_elsewhere(server.state.store.root, digest):
            assert admin.delete(f"/admin/adapters/{b.tenant_id}/y").status_code == 200
            assert server.run(shared.has(digest)), "the shared store kept the claimed files"

            async def restarting(digest: str, folder: Path) -> None:
                raise ServiceUnavailable("the engine is restarting")

            monkeypatch.setattr(engine, "ensure_adapter", restarting)
            refused = post_upload(admin, b.tenant_id, "z", folder)
            assert refused.status_code == 503, refused.text
            assert digest in server.state.store, "the local store kept the claimed files"
            assert server.run(shared.has(digest))
            assert digest not in retired, "the engine kept the claimed digest"
        monkeypatch.undo()
        # Unclaimed, and named by no live version: the next cleanup of the digest removes them.
        again = upload_adapter(admin, b.tenant_id, "w", folder)
        assert again["digest"] == digest
        assert admin.delete(f"/admin/adapters/{b.tenant_id}/w").status_code == 200
        assert not server.run(shared.has(digest))


async def test_a_publish_cancelled_while_waiting_for_its_claim_holds_nothing(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """A publish waits for its claim while a cleanup of the digest decides, and its client
    leaves (the request is cancelled). Nothing holds the claim afterwards (a thread that waited
    on the lock took it anyway, and the digest stayed claimed by nobody for the life of the
    process, so no cleanup ever removed its files)."""
    store = AdapterStore(tmp_path, BaseModelSpec.from_model_dir(demo_model_dir))
    digest = "ab" * 32
    with store.claims.unclaimed(digest) as free:
        assert free
        waiting = asyncio.ensure_future(claim(store.claims, digest))
        await asyncio.sleep(0.1)  # the publish is waiting: it has tried and will try again
        assert not waiting.done()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    with store.claims.unclaimed(digest) as free:
        assert free, "the claim is held"


async def test_publishes_waiting_for_a_claim_hold_no_thread_a_cleanup_needs(
    tmp_path: Path, demo_model_dir: Path
) -> None:
    """Many uploads of the same bytes wait for their claim while a cleanup of the digest
    decides; the cleanup's own work off the loop (deleting the folder) still runs, and then
    every publish gets its claim. With each wait on a thread of the loop's pool, the pool was
    full of waiters, the cleanup never finished, and the worker was deadlocked for good."""
    store = AdapterStore(tmp_path, BaseModelSpec.from_model_dir(demo_model_dir))
    digest = "cd" * 32
    with store.claims.unclaimed(digest) as free:
        assert free
        waiting = [asyncio.ensure_future(claim(store.claims, digest)) for _ in range(64)]
        await asyncio.sleep(0.1)
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), 30) == "ran"
        assert not any(w.done() for w in waiting)
    claims = await asyncio.wait_for(asyncio.gather(*waiting), 30)
    with store.claims.unclaimed(digest) as free:
        assert not free
    for held in claims:
        held.release()


def test_a_publish_cancelled_after_storing_its_files_removes_them(
    shared_gateway: RunningServer, demo_adapter_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publish is cancelled (its worker shutting down) once its files are stored and the
    engine has loaded them, before its row is committed. Its files leave the local and the
    shared store, and the digest is unclaimed: the undoing used to run for failures only, so
    the files stayed for good, named by no version."""
    server, shared = shared_gateway, shared_gateway.state.shared_store
    assert shared is not None
    state, real = server.state, server.state.engine.ensure_adapter
    loaded: list[str] = []

    async def scenario() -> None:
        engine_has_it = asyncio.Event()

        async def ensure_adapter(digest: str, folder: Path) -> None:
            await real(digest, folder)
            loaded.append(digest)
            engine_has_it.set()
            await asyncio.Event().wait()  # until cancelled

        monkeypatch.setattr(state.engine, "ensure_adapter", ensure_adapter)

        async def publish() -> None:
            async with state.sessions() as session:
                service = AdapterService(
                    session, state.store, state.engine, state.catalog, state.model_name, shared
                )
                await service.publish("shared", "cancelled", demo_adapter_dirs[12])

        publishing = asyncio.ensure_future(publish())
        await asyncio.wait_for(engine_has_it.wait(), 60)
        publishing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await publishing

    server.run(scenario())
    [digest] = loaded
    assert digest not in state.store
    assert not server.run(shared.has(digest))
    with state.store.claims.unclaimed(digest) as free:
        assert free, "the claim is held"


def test_a_request_resolved_by_a_stale_catalog_gets_a_404_and_does_not_revive_the_adapter(
    shared_gateway: RunningServer, demo_adapter_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another gateway worker's catalog resolves a just-deleted adapter for up to its ttl
    (here: this worker's, whose invalidation is held back). Its request found the digest
    retired in the engine, and registered it again from the store: the deleted adapter stayed
    registered for the life of the engine (found by attacking the admin API). Its files are now
    gone with the delete, and the request gets the 404 a fresh catalog gives."""
    server = shared_gateway
    lora = server.state.engine.engine.engine.lora  # type: ignore[attr-defined]
    with admin_of(server) as admin:
        tenant = new_tenant(admin, "stale")
        digest = upload_adapter(admin, tenant.tenant_id, "gone", demo_adapter_dirs[16])["digest"]

        def chat() -> httpx.Response:
            body = {"model": "gone", "messages": [{"role": "user", "content": "hi"}]}
            headers = {"authorization": f"Bearer {tenant.key}"}
            return httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers)

        assert chat().status_code == 200  # the catalog holds `gone` now
        monkeypatch.setattr(server.state.catalog, "invalidate", lambda: None)
        assert admin.delete(f"/admin/adapters/{tenant.tenant_id}/gone").status_code == 200
        stale = chat()
        assert stale.status_code == 404, stale.text
        assert digest not in stale.text
        assert not lora.is_servable(digest)
        monkeypatch.undo()
        server.state.catalog.invalidate()
        assert chat().status_code == 404


def test_a_publish_whose_owner_is_deleted_meanwhile_is_refused_and_undone(
    shared_gateway: RunningServer, demo_adapter_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tenant is deleted while its upload loads the adapter in the engine (held there).
    The upload committed a live version of the deleted tenant: listed, but no admin route
    could delete it (they look the owner up: 404), and its digest stayed in the engine (found
    by attacking the admin API). Now the upload answers 404 and is undone. (On PostgreSQL:
    tests/gateway/test_postgres_gateway.py.)"""
    with admin_of(shared_gateway) as admin:
        publish_racing_owner_deletion(shared_gateway, admin, demo_adapter_dirs[17], monkeypatch)


def publish_racing_owner_deletion(
    server: RunningServer, admin: httpx.Client, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, real = server.state.engine, server.state.engine.ensure_adapter
    loaded, may_commit = threading.Event(), threading.Event()
    digests: list[str] = []

    async def ensure_adapter(digest: str, folder: Path) -> None:
        await real(digest, folder)
        digests.append(digest)
        loaded.set()
        await asyncio.to_thread(may_commit.wait, 30)

    monkeypatch.setattr(engine, "ensure_adapter", ensure_adapter)
    tenant = new_tenant(admin, "doomed")
    answer: list[httpx.Response] = []
    uploading = threading.Thread(
        target=lambda: answer.append(post_upload(admin, tenant.tenant_id, "orphan", folder))
    )
    uploading.start()
    assert loaded.wait(30)
    assert admin.delete(f"/admin/tenants/{tenant.tenant_id}").status_code == 200
    may_commit.set()
    uploading.join(60)
    monkeypatch.undo()
    [refused] = answer
    assert refused.status_code == 404, refused.text
    assert refused.json()["error"]["code"] == "tenant_not_found"
    listed = admin.get("/admin/adapters", params={"name": "orphan", "limit": 500}).json()
    assert not [a for a in listed["items"] if a["owner"] == tenant.tenant_id]
    [digest] = digests
    assert digest not in server.state.store
    assert not engine.engine.engine.lora.is_servable(digest)  # type: ignore[attr-defined]


def test_a_tenant_deleted_while_its_publish_holds_the_owner_lock_takes_the_new_version_along(
    shared_gateway: RunningServer, demo_adapter_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publish has checked and locked its owner, and not yet committed, when the tenant's
    delete arrives: the delete waits for the publish's commit and then deletes its version
    too. On SQLite a SELECT ... FOR UPDATE locked nothing, so the delete committed in between
    and the publish left a live version of a deleted tenant (found by attacking the fixes)."""
    server, real = shared_gateway, service_module.lock_owner
    locked, may_commit = threading.Event(), threading.Event()

    async def lock_owner(session: Any, owner: str) -> None:  # the real lock, then a pause
        await real(session, owner)
        locked.set()
        await asyncio.to_thread(may_commit.wait, 30)

    monkeypatch.setattr(service_module, "lock_owner", lock_owner)
    with admin_of(server) as admin:
        tenant = new_tenant(admin, "locked")
        published: list[httpx.Response] = []
        deleted: list[httpx.Response] = []
        folder = demo_adapter_dirs[19]
        publishing = threading.Thread(
            target=lambda: published.append(post_upload(admin, tenant.tenant_id, "o", folder))
        )
        publishing.start()
        assert locked.wait(30)
        deleting = threading.Thread(
            target=lambda: deleted.append(admin.delete(f"/admin/tenants/{tenant.tenant_id}"))
        )
        deleting.start()
        time.sleep(0.5)  # the delete reaches the owner's lock, held by the publish
        may_commit.set()
        publishing.join(60)
        deleting.join(60)
        monkeypatch.undo()
        assert deleted[0].status_code == 200, deleted[0].text
        assert published[0].status_code in (201, 404), published[0].text
        listed = admin.get("/admin/adapters", params={"name": "o", "limit": 500}).json()
        assert not [a for a in listed["items"] if a["owner"] == tenant.tenant_id]


def test_two_deletes_of_identical_adapters_at_once_leave_no_files(
    shared_gateway: RunningServer, demo_adapter_dirs: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tenants A and B hold identical adapters (one digest) and delete them at once. A's
    cleanup has read that B's still serves the digest (and leaves it) when B's cleanup comes:
    it used to find the digest locked, take A's cleanup for a publish, and leave it too, so the
    files stayed in both stores and the engine for good (found by attacking the fixes). Now
    B's cleanup waits for A's and decides on what it reads then."""
    server, shared = shared_gateway, shared_gateway.state.shared_store
    assert shared is not None
    real, first = service_module._serves, threading.Event()
    read, may_go_on = threading.Event(), threading.Event()

    async def serves(session: Any, digest: str) -> bool:  # the real read; the first one pauses
        answer = await real(session, digest)
        if not first.is_set():
            first.set()
            read.set()
            await asyncio.to_thread(may_go_on.wait, 30)
        return answer

    folder = demo_adapter_dirs[20]
    with admin_of(server) as admin:
        a, b = new_tenant(admin, "twin-a"), new_tenant(admin, "twin-b")
        digest = upload_adapter(admin, a.tenant_id, "x", folder)["digest"]
        upload_adapter(admin, b.tenant_id, "y", folder)
        monkeypatch.setattr(service_module, "_serves", serves)
        answers: list[httpx.Response] = []
        deletes = [
            threading.Thread(target=lambda p=path: answers.append(admin.delete(p)))
            for path in (f"/admin/adapters/{a.tenant_id}/x", f"/admin/adapters/{b.tenant_id}/y")
        ]
        deletes[0].start()
        assert read.wait(30)  # A's cleanup read "B's adapter serves it"
        deletes[1].start()
        time.sleep(0.5)  # B's delete commits and reaches its cleanup
        may_go_on.set()
        for delete in deletes:
            delete.join(60)
        monkeypatch.undo()
    assert [r.status_code for r in answers] == [200, 200]
    assert digest not in server.state.store
    assert not server.run(shared.has(digest))
    assert not server.state.engine.engine.engine.lora.is_servable(digest)  # type: ignore[attr-defined]
