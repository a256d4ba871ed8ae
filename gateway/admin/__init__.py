"""The admin REST API (admin JWT) under /admin: `router` mounts each domain's controller
(`gateway.tenants`, `keys`, `quotas`, `adapters`, `usage`, `cache`, `audit`) behind the admin
`guard` and provides their services; `wire` holds what their wire shapes share."""
