"""Tenants: `/admin/tenants` (controller), the rules (service), the wire shapes (schemas)."""
