"""The audit log of admin actions: `AuditLog` writes and reads it, `controller` serves
`/admin/audit`, and `action` wires an admin route to its entry."""
