"""Benchmarks: each prints a table and writes bench/results/<name>.json."""
