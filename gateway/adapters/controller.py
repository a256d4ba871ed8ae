"""Routes: adapters (`/admin/adapters`)."""

from __future__ import annotations

from typing import Annotated, Any

from litestar import Controller, Request, Response, delete, get, post, put
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.openapi.spec import (
    Example,
    OpenAPIFormat,
    OpenAPIMediaType,
    OpenAPIType,
    RequestBody,
    Schema,
)
from litestar.params import Body, FromPath, FromQuery
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED

from loramux.gateway.adapters.schemas import (
    AdapterDetail,
    AdapterOut,
    AdapterPage,
    CurrentVersion,
    Published,
)
from loramux.gateway.adapters.service import AdapterService
from loramux.gateway.adapters.upload import MAX_TEXT_BYTES, UploadSpace, receive_upload, workspace
from loramux.gateway.admin.paging import Paging
from loramux.gateway.admin.wire import Deleted
from loramux.gateway.api_docs import admin_errors, documented_body
from loramux.gateway.audit.action import audited_as
from loramux.gateway.audit.service import AuditRecord
from loramux.gateway.state import GatewayState

_UPLOAD = """multipart/form-data with `name` (1-64 letters, digits, `.`, `_` or `-`, starting
with a letter or digit, no `..`), `owner` (a tenant's id or name, or `shared`) and either
`archive` (.zip or .tar.gz of a PEFT adapter folder) or `adapter_config` (adapter_config.json)
and `adapter_model` (adapter_model.safetensors). Uploading a name again makes a new version
(201); requests in flight finish on the old one. Uploading the current version's bytes again
answers that version with 200 and publishes nothing."""

_SAME_BYTES = "The bytes are those of the current version, which is answered; nothing changed."
_ALREADY = "That version's content already serves; nothing changed."
_ROLLBACK_EXAMPLE = Example(summary="Serve version 3 again", value={"version": 3})
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
        opt=audited_as("adapter.upload"),
        responses={
            200: ResponseSpec(AdapterOut, description=_SAME_BYTES),
            **admin_errors(400, 404, 413),
        },
    )
    async def upload_adapter(
        self,
        request: Request[Any, Any, Any],
        adapters: NamedDependency[AdapterService],
        uploads: NamedDependency[UploadSpace],
        entry: NamedDependency[AuditRecord],
        gw: NamedDependency[GatewayState],
    ) -> Response[AdapterOut]:
        with workspace(uploads.root) as work:
            upload = await receive_upload(request, work, uploads.max_bytes)
            entry.target = f"{upload.owner}/{upload.name}"
            published = await adapters.publish_upload(upload, work)
        adapter = published.adapter
        entry.target = f"{adapter.owner}/{adapter.name}"
        if published.created:
            gw.metrics.admission.adapter_uploads.inc()
        entry.detail = {"version": adapter.version, "digest": adapter.digest}
        return _answer(published)

    @get(responses=admin_errors(400, 404))
    async def list_adapters(
        self,
        adapters: NamedDependency[AdapterService],
        paging: NamedDependency[Paging],
        owner: FromQuery[str | None] = None,
    ) -> AdapterPage:
        """The latest live version of every adapter, or of one owner's (`?owner=`, a tenant's
        id or name, or `shared`), by owner and name, a page at a time; `name` keeps adapters
        whose name holds it."""
        return await adapters.list_latest(owner, paging)

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

    @put(
        "/{owner:str}/{name:str}/current",
        status_code=201,
        responses={
            200: ResponseSpec(AdapterOut, description=_ALREADY),
            **admin_errors(400, 404, 409),
        },
        opt=audited_as("adapter.rollback", "{owner}/{name}"),
    )
    async def make_current(
        self,
        owner: FromPath[str],
        name: FromPath[str],
        data: Annotated[CurrentVersion, Body(examples=[_ROLLBACK_EXAMPLE])],
        adapters: NamedDependency[AdapterService],
        entry: NamedDependency[AuditRecord],
    ) -> Response[AdapterOut]:
        """Roll back (or forward) to a live version: its digest is published again as the newest
        version, which serves from now on (201); 200 when it already serves."""
        published = await adapters.make_current(owner, name, data.version)
        entry.detail = {"version": published.adapter.version, "digest": published.adapter.digest}
        return _answer(published)

    @delete(
        "/{owner:str}/{name:str}/versions/{version:int}",
        status_code=200,
        responses=admin_errors(400, 404),
        opt=audited_as("adapter.version.delete", "{owner}/{name}@{version}"),
    )
    async def delete_version(
        self,
        owner: FromPath[str],
        name: FromPath[str],
        version: FromPath[int],
        adapters: NamedDependency[AdapterService],
        entry: NamedDependency[AuditRecord],
    ) -> Deleted:
        """Delete one version; when it was the current one, the newest live version before it
        serves again. Requests in flight finish on it."""
        return await adapters.delete_version(owner, name, version)


def _answer(published: Published) -> Response[AdapterOut]:
    status = HTTP_201_CREATED if published.created else HTTP_200_OK
    return Response(published.adapter, status_code=status)
