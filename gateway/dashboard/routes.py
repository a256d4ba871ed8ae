"""Routes: `/dashboard` (the page, or sign-in), `/dashboard/login`, `/dashboard/logout`,
`/dashboard/data` (the page's numbers as JSON) and `/dashboard/style.css`.

Without a session the page is the sign-in form; with a tampered or expired one it is the form
again (401) and the cookie is cleared. The data endpoint answers 401 instead. Every response,
errors included, forbids scripts, framing, caching (it holds one tenant's numbers) and content
sniffing; sign-in and sign-out refuse requests sent from another origin.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any
from urllib.parse import urlsplit

from litestar import Controller, MediaType, Request, Response, Router, get, post
from litestar.datastructures import MutableScopeHeaders
from litestar.di import NamedDependency, Provide
from litestar.params import FromQuery, QueryParameter
from litestar.response import Redirect
from litestar.types import Message, Scope

from loramux.gateway.dashboard.html import Html
from loramux.gateway.dashboard.pages import dashboard_page, sign_in_page
from loramux.gateway.dashboard.session import (
    COOKIE,
    SESSION_SECONDS,
    Viewer,
    current_viewer,
    mint,
    sign_in,
    sign_out,
)
from loramux.gateway.dashboard.sources import DashboardSources
from loramux.gateway.dashboard.style import STYLESHEET
from loramux.gateway.dashboard.view import chosen_tenant, load_view, view_json, window_of
from loramux.gateway.errors import PermissionDenied, Unauthorized, refuse_nul
from loramux.gateway.state import GatewayState

AnyRequest = Request[Any, Any, Any]
Days = Annotated[int, QueryParameter(ge=1, le=366)]
FirstDay = Annotated[str | None, QueryParameter(name="from", max_length=10)]
LastDay = Annotated[str | None, QueryParameter(name="to", max_length=10)]
NOT_SIGNED_OUT = (
    "This browser is signed out, but the session could not be ended on the server (a service it "
    "needs did not answer): a copy of its cookie stays valid until the session expires, at most "
    f"{SESSION_SECONDS // 60} minutes."
)
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; style-src 'self'; img-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "cache-control": "no-store",
    "referrer-policy": "same-origin",
    "x-content-type-options": "nosniff",
}


async def security_headers(message: Message, scope: Scope) -> None:
    """Set SECURITY_HEADERS on every response under /dashboard: a hook on the app's `send`
    (`before_send`), so that it also reaches what no dashboard route answers (404, 405), which
    route middleware never sees."""
    path = scope.get("path", "")
    if message["type"] == "http.response.start" and (
        path == "/dashboard" or path.startswith("/dashboard/")
    ):
        headers = MutableScopeHeaders.from_message(message)
        for name, value in SECURITY_HEADERS.items():
            headers[name] = value


def _own_key(viewer: Viewer) -> str | None:
    """The key whose limits a tenant viewer may see; None for an admin (every key's)."""
    return None if viewer.is_admin else viewer.subject


def _page(markup: Html, status: int = 200) -> Response[str]:
    return Response(markup, status_code=status, media_type=MediaType.HTML)


def _refuse_other_origins(request: AnyRequest) -> None:
    """Refuse a form posted from another site's page: browsers send that page's Origin with
    every cross-site POST. (A client that sends no Origin is no browser and holds no cookie of
    a signed-in user.)"""
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
        raise PermissionDenied("cross-origin dashboard request refused", code="bad_origin")


class DashboardController(Controller):
    """Mounted by `dashboard_router`, which provides `dashboard` (its `DashboardSources`).
    `refuse_nul` answers a `?tenant=` holding NUL before any query, alike on every database."""

    path = "/dashboard"
    include_in_schema = False
    guards = (refuse_nul,)

    @get("/")
    async def page(
        self,
        request: AnyRequest,
        dashboard: NamedDependency[DashboardSources],
        tenant: FromQuery[str | None] = None,
        days: Days = 30,
        start: FirstDay = None,
        end: LastDay = None,
        paused: FromQuery[bool] = False,
    ) -> Response[str]:
        """The usage page of the signed-in tenant (or of `tenant`, for an admin), over the last
        `days` days or `from` to `to`; it refreshes itself every few seconds unless `paused`."""
        token = request.cookies.get(COOKIE)
        if token is None:
            return _page(sign_in_page())
        try:
            viewer = await current_viewer(dashboard, token)
        except Unauthorized as exc:
            response = _page(sign_in_page(exc.message), status=401)
            response.delete_cookie(COOKIE, path=self.path)
            return response
        shown = await chosen_tenant(dashboard, viewer.tenant_id, tenant)
        now = datetime.now(UTC)
        window = window_of(days, start, end, now)
        view = await load_view(dashboard, shown, window, now, _own_key(viewer), live=not paused)
        return _page(dashboard_page(view, viewer))

    @get("/data")
    async def data(
        self,
        request: AnyRequest,
        dashboard: NamedDependency[DashboardSources],
        tenant: FromQuery[str | None] = None,
        days: Days = 30,
        start: FirstDay = None,
        end: LastDay = None,
    ) -> dict[str, Any]:
        """The page's numbers as JSON; 401 without a valid session."""
        viewer = await current_viewer(dashboard, request.cookies.get(COOKIE))
        shown = await chosen_tenant(dashboard, viewer.tenant_id, tenant)
        now = datetime.now(UTC)
        window = window_of(days, start, end, now)
        return view_json(await load_view(dashboard, shown, window, now, _own_key(viewer)))

    @post("/login", status_code=303)
    async def login(
        self, request: AnyRequest, dashboard: NamedDependency[DashboardSources]
    ) -> Response[Any]:
        """Form field `credential`: an API key or an admin token. On success the session cookie
        is set and the browser is sent to the page; otherwise the form comes back (401)."""
        _refuse_other_origins(request)
        credential = (await request.form()).get("credential")
        try:
            viewer = await sign_in(dashboard, credential if isinstance(credential, str) else "")
        except Unauthorized as exc:
            return _page(sign_in_page(exc.message), status=401)
        response = Redirect(self.path, status_code=303)
        response.set_cookie(
            COOKIE,
            mint(dashboard, viewer),
            max_age=max(viewer.expires_at - int(datetime.now(UTC).timestamp()), 0),
            path=self.path,
            secure=request.url.scheme == "https",
            httponly=True,
            samesite="strict",
        )
        return response

    @post("/logout", status_code=303)
    async def logout(
        self, request: AnyRequest, dashboard: NamedDependency[DashboardSources]
    ) -> Response[Any]:
        """End the session (`session.sign_out`) and delete the cookie. If the session could not
        be ended on the server, the sign-in form says so (503); the cookie is deleted still."""
        _refuse_other_origins(request)
        response: Response[Any] = Redirect(self.path, status_code=303)
        if not await sign_out(dashboard, request.cookies.get(COOKIE)):
            response = _page(sign_in_page(NOT_SIGNED_OUT), status=503)
        response.delete_cookie(COOKIE, path=self.path)
        return response

    @get("/style.css", media_type="text/css")
    async def stylesheet(self) -> str:
        return STYLESHEET


def dashboard_router(gw: GatewayState) -> Router:
    """/dashboard, with what its routes read composed from the process's state."""
    sources = DashboardSources.of(gw)
    provide = Provide(lambda: sources, sync_to_thread=False, use_cache=True)
    return Router("/", route_handlers=[DashboardController], dependencies={"dashboard": provide})
