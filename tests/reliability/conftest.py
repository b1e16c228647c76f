"""Fixtures of the reliability suite."""

from __future__ import annotations

import uuid
from typing import Any

import pytest


@pytest.fixture
def hdfs_url(hdfs_cluster: Any, request: pytest.FixtureRequest) -> str:
    """A fresh directory URL on the real HDFS test cluster (skips or fails like the cluster)."""
    base = None
    for attribute in ("url", "webhdfs_url", "base_url"):
        base = getattr(hdfs_cluster, attribute, None)
        if isinstance(base, str):
            break
    if not isinstance(base, str):
        pytest.fail(f"the hdfs_cluster fixture ({hdfs_cluster!r}) exposes no base URL")
    return f"{base.rstrip('/')}/reliability/{request.node.name[:60]}-{uuid.uuid4().hex[:8]}"
