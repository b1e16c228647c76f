"""Helpers for the tests of remembered verdicts (``trajtrack.reader._remembered``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import pytest

from trajtrack.reader._remembered import Remembered


@contextmanager
def emptied(memo: Remembered[Any]) -> Iterator[None]:
    """*memo* empty for the test, and emptied again after it."""
    memo.clear()
    try:
        yield
    finally:
        memo.clear()


def inputs_checked(monkeypatch: pytest.MonkeyPatch, module: ModuleType, name: str) -> list[bytes]:
    """The first argument of each call of ``module.name`` from now on (the inputs a check
    really ran on, not answered from its memo)."""
    seen: list[bytes] = []
    check = getattr(module, name)

    def counting(data: bytes, *rest: Any) -> Any:
        seen.append(data)
        return check(data, *rest)

    monkeypatch.setattr(module, name, counting)
    return seen
