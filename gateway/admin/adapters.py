"""Routes: adapters (`/admin/adapters`)."""

from __future__ import annotations

from litestar import Controller, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, FromQuery

from gateway.admin import adapters_service
from gateway.admin.schemas import AdapterDetail, AdapterOut, AnyRequest, Deleted
from gateway.admin.upload import receive_upload, workspace
from gateway.audit import audited
from gateway.auth.admin_jwt import AdminIdentity
from gateway.state import GatewayState

_UPLOAD = """multipart/form-data with `name` (1-64 letters, digits, `.`, `_` or `-`, starting
with a letter or digit, no `..`), `owner` (a tenant id or `shared`) and either `archive` (.zip
or .tar.gz of a PEFT adapter folder) or `adapter_config` (adapter_config.json) and
`adapter_model` (adapter_model.safetensors). Uploading a name again makes a new version;
requests in flight finish on the old one."""


class AdapterController(Controller):
    path = "/adapters"
    tags = ("admin: adapters",)

    # The body may be far larger than the app's limit; receive_upload holds it to
    # LORAMUX_MAX_UPLOAD_MB while streaming it to disk.
    @post(request_max_body_size=None, description=_UPLOAD)
    async def upload_adapter(
        self,
        request: AnyRequest,
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> AdapterOut:
        max_bytes = gw.settings.server.max_upload_mb << 20
        async with audited(gw, admin_identity.subject, "adapter.upload") as entry:
            with workspace(gw.settings.data_dir / "uploads") as work:
                upload = await receive_upload(request, work, max_bytes)
                entry.target = f"{upload.owner}/{upload.name}"
                adapter = await adapters_service.publish_upload(gw, upload, work)
            entry.detail = {"version": adapter.version, "digest": adapter.digest}
        return adapter

    @get()
    async def list_adapters(
        self,
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
        owner: FromQuery[str | None] = None,
    ) -> list[AdapterOut]:
        """The latest live version of every adapter, or of one owner's (`?owner=`)."""
        return await adapters_service.list_latest(gw, owner)

    @get("/{owner:str}/{name:str}")
    async def get_adapter(
        self,
        owner: FromPath[str],
        name: FromPath[str],
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> AdapterDetail:
        """The latest live version and every live version of `owner/name`."""
        return await adapters_service.detail(gw, owner, name)

    @delete("/{owner:str}/{name:str}", status_code=200)
    async def delete_adapter(
        self,
        owner: FromPath[str],
        name: FromPath[str],
        gw: NamedDependency[GatewayState],
        admin_identity: NamedDependency[AdminIdentity],
    ) -> Deleted:
        """Delete every version of `owner/name`; requests in flight finish on them."""
        async with audited(gw, admin_identity.subject, "adapter.delete", f"{owner}/{name}"):
            return await adapters_service.delete(gw, owner, name)
