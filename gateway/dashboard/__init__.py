"""The quota dashboard (`/dashboard`): tenants sign in with an API key, admins with an admin
token, and see usage against quota, per adapter and over time, read from the usage rollups.

`sources` (what it reads, provided to the routes), `session` (the cookie), `view` and `live`
(the numbers), `charts`, `pages` and `panels` (HTML and SVG built by `html`, which escapes by
construction), `routes` (the controller and its router).
"""

from loramux.gateway.dashboard.routes import dashboard_router

__all__ = ["dashboard_router"]
