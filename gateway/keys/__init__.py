"""Tenant API keys: `/admin/tenants/{id}/keys` and `/admin/keys/{id}` (controller), the rules
(service), the wire shapes (schemas)."""
