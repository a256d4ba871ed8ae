"""Routes: adapters (`/admin/adapters`)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, delete, get, post
from litestar.di import NamedDependency
from litestar.openapi.spec import (
    OpenAPIFormat,
    OpenAPIMediaType,
    OpenAPIType,
    RequestBody,
    Schema,
)
from litestar.params import FromPath, FromQuery

from gateway.adapters.schemas import AdapterDetail, AdapterOut
from gateway.adapters.service import AdapterService
from gateway.adapters.upload import MAX_TEXT_BYTES, UploadSpace, receive_upload, workspace
from gateway.admin.wire import Deleted
from gateway.api_docs import admin_errors, documented_body
from gateway.audit.action import audited_as
from gateway.audit.service import AuditRecord
from gateway.state import GatewayState

_UPLOAD = """multipart/form-data with `name` (1-64 letters, digits, `.`, `_` or `-`, starting
with a letter or digit, no `..`), `owner` (a tenant id or `shared`) and either `archive` (.zip
or .tar.gz of a PEFT adapter folder) or `adapter_config` (adapter_config.json) and
`adapter_model` (adapter_model.safetensors). Uploading a name again makes a new version;
requests in flight finish on the old one."""

_TEXT = Schema(type=OpenAPIType.STRING, max_length=MAX_TEXT_BYTES)
_FILE = Schema(type=OpenAPIType.STRING, format=OpenAPIFormat.BINARY)
_UPLOAD_FORM = RequestBody(
    required=True,
    description="An adapter: an archive, or its two files.",
    content={
        "multipart/form-data": OpenAPIMediaType(
            schema=Schema(
                type=OpenAPIType.OBJECT,
                properties={
                    "name": _TEXT,
                    "owner": _TEXT,
                    "archive": _FILE,
                    "adapter_config": _FILE,
                    "adapter_model": _FILE,
                },
                required=["name", "owner"],
            )
        )
    },
)


class AdapterController(Controller):
    path = "/adapters"
    tags = ("admin: adapters",)

    # The body may be far larger than the app's limit; receive_upload holds it to
    # LORAMUX_MAX_UPLOAD_MB while streaming it to disk.
    @post(
        request_max_body_size=None,
        description=_UPLOAD,
        operation_class=documented_body(_UPLOAD_FORM),
        responses=admin_errors(400, 404, 413),
        opt=audited_as("adapter.upload"),
    )
    async def upload_adapter(
        self,
        request: Request[Any, Any, Any],
        adapters: NamedDependency[AdapterService],
        uploads: NamedDependency[UploadSpace],
        entry: NamedDependency[AuditRecord],
        gw: NamedDependency[GatewayState],
    ) -> AdapterOut:
        with workspace(uploads.root) as work:
            upload = await receive_upload(request, work, uploads.max_bytes)
            entry.target = f"{upload.owner}/{upload.name}"
            adapter = await adapters.publish_upload(upload, work)
        gw.metrics.admission.adapter_uploads.inc()
        entry.detail = {"version": adapter.version, "digest": adapter.digest}
        return adapter

    @get(responses=admin_errors(400))
    async def list_adapters(
        self, adapters: NamedDependency[AdapterService], owner: FromQuery[str | None] = None
    ) -> list[AdapterOut]:
        """The latest live version of every adapter, or of one owner's (`?owner=`)."""
        return await adapters.list_latest(owner)

    @get("/{owner:str}/{name:str}", responses=admin_errors(400, 404))
    async def get_adapter(
        self, owner: FromPath[str], name: FromPath[str], adapters: NamedDependency[AdapterService]
    ) -> AdapterDetail:
        """The latest live version and every live version of `owner/name`."""
        return await adapters.detail(owner, name)

    @delete(
        "/{owner:str}/{name:str}",
        status_code=200,
        responses=admin_errors(400, 404),
        opt=audited_as("adapter.delete", "{owner}/{name}"),
    )
    async def delete_adapter(
        self,
        owner: FromPath[str],
        name: FromPath[str],
        adapters: NamedDependency[AdapterService],
        entry: NamedDependency[AuditRecord],
    ) -> Deleted:
        """Delete every version of `owner/name`; requests in flight finish on them."""
        return await adapters.delete(owner, name)
