"""Response-cache administration: a tenant's cache settings and purges (`/admin/tenants/{id}/cache`,
`/admin/cache`). The caches themselves are the top-level `cache` package's; the per-request
policy is `gateway.cache_policy`."""
