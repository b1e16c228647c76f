"""Fixtures of the HDFS integration tests (the session cluster itself is in tests/_support)."""

from __future__ import annotations

from _support.hdfs_cluster import hdfs_url  # noqa: F401  (a fixture)
