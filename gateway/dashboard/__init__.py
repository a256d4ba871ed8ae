"""The quota dashboard (`/dashboard`): tenants sign in with an API key, admins with an admin
token, and see usage against quota, per adapter and over time, read from the usage rollups.

`session` (the cookie), `view` (the numbers), `charts` and `pages` (HTML and SVG built by
`html`, which escapes by construction), `routes` (the controller).
"""

from litestar.types import ControllerRouterHandler

from gateway.dashboard.routes import DashboardController

dashboard_routes: list[ControllerRouterHandler] = [DashboardController]
"""Handlers mounted at /dashboard."""
