"""Exact and semantic response caches on Redis."""
