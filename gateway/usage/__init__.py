"""Usage: metering each request (`recorder`), totals over any range from the rollups (`query`),
the `/admin/usage` report (`controller`, `service`, `schemas`). The dashboard reads `query` too.
The tables are `gateway.db.usage` and `gateway.db.usage_rollup`."""

from loramux.gateway.usage.recorder import UsageRecord, UsageRecorder

__all__ = ["UsageRecord", "UsageRecorder"]
