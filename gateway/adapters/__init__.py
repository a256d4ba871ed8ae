"""Adapters as tenants see them: `/admin/adapters` (controller), versions of `owner/name` and
their publishing rules (service), multipart uploads (upload), the wire shapes (schemas).

The PEFT format, the store and archives are the top-level `adapters` package's."""
