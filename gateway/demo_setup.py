"""First start on embedded defaults: a demo tenant with a key (printed once) and shared demo adapters."""

from __future__ import annotations

import logging
from pathlib import Path

from sqlalchemy import func, select

from loramux.gateway.auth.api_keys import mint_key
from loramux.gateway.db import ApiKey, Tenant
from loramux.gateway.state import GatewayState

log = logging.getLogger(__name__)


async def first_start(gw: GatewayState, model_dir: Path, url: str) -> None:
    """On an empty database, create tenant `demo` and its key; with the demo model, also upload
    shared demo adapters. Prints the key once, with an example request to `url`, where serve
    listens (its --port, not only LORAMUX_PORT)."""
    async with gw.sessions() as session:
        if await session.scalar(select(func.count()).select_from(Tenant)):
            return
    key = mint_key()
    async with gw.sessions() as session, session.begin():
        tenant = Tenant(name="demo")
        session.add(tenant)
        await session.flush()
        session.add(
            ApiKey(id=key.id, tenant_id=tenant.id, name="demo", secret_hash=key.secret_hash)
        )
    names: list[str] = []
    if gw.settings.model is None and gw.settings.server.demo_adapters > 0:
        names = await _upload_demo_adapters(gw, model_dir, gw.settings.server.demo_adapters)
    model = names[0] if names else gw.model_name
    print(
        f"\nloramux: created tenant 'demo' with API key (shown once):\n\n    {key.key}\n\n"
        f"models: {', '.join([gw.model_name, *names])}\ntry:\n"
        f"    curl {url}/v1/chat/completions -H 'Authorization: Bearer {key.key}' "
        f"-H 'Content-Type: application/json' "
        f'-d \'{{"model": "{model}", "messages": [{{"role": "user", "content": "hello"}}]}}\'\n',
        flush=True,
    )


async def _upload_demo_adapters(gw: GatewayState, model_dir: Path, count: int) -> list[str]:
    from loramux.adapters.demo import build_demo_adapters
    from loramux.gateway.adapters.service import AdapterService
    from loramux.gateway.audit.service import AuditLog

    folders = build_demo_adapters(model_dir, gw.settings.data_dir / "demo-adapters", count)
    audit_log = AuditLog(gw.sessions)
    names = []
    for i, folder in enumerate(folders):
        name = f"demo-{i}"
        async with gw.sessions() as session:
            adapters = AdapterService(
                session, gw.store, gw.engine, gw.catalog, gw.model_name, gw.shared_store
            )
            target = f"shared/{name}"
            async with audit_log.audited("first-start", "adapter.upload", target) as entry:
                await adapters.check_name_and_owner(name, "shared")
                adapter = (await adapters.publish("shared", name, folder)).adapter
                entry.detail = {"version": adapter.version, "digest": adapter.digest}
        names.append(name)
    return names
