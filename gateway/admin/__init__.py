"""The admin REST API (admin JWT): tenants, keys, quotas, adapters, usage, audit.

Every route takes the `admin_identity` dependency; on this router it also writes an audit entry
for each refused token. Each domain has thin routes (`tenants`, `keys`, …) over a service
module holding its rules (`tenants_service`, `keys_service`, …).
"""

from litestar import Router
from litestar.di import Provide
from litestar.types import ControllerRouterHandler

from gateway.admin.adapters import AdapterController
from gateway.admin.cache import CacheController
from gateway.admin.identity import provide_admin_identity
from gateway.admin.keys import KeyController
from gateway.admin.quotas import QuotaController
from gateway.admin.reports import ReportController
from gateway.admin.tenants import TenantController

admin_routes: list[ControllerRouterHandler] = [
    Router(
        "/admin",
        route_handlers=[
            TenantController,
            KeyController,
            QuotaController,
            AdapterController,
            ReportController,
            CacheController,
        ],
        dependencies={"admin_identity": Provide(provide_admin_identity)},
    )
]
"""Controllers mounted under /admin."""
