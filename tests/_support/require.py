"""Optional components: skip without them, unless the environment says they are required."""

from __future__ import annotations

import importlib.util
import os

import pytest


def require_module(module: str, *, required_by: str, hint: str) -> None:
    """At a test module's top: skip it when *module* is missing, fail when *required_by* is 1.

    ``pytest.importorskip`` would skip even in CI, where ``TRAJTRACK_REQUIRE_RAY=1`` (and the
    like) promise that the component is there: a missing install must fail the run there.
    """
    if importlib.util.find_spec(module) is not None:
        return
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{module} is not installed and {required_by}=1 ({hint})", pytrace=False)
    pytest.skip(f"{module} is not installed ({hint})", allow_module_level=True)
