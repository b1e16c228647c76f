"""The public names of each public package are exactly its ``__all__`` (as anyio and trio test).

Each name in ``__all__`` is importable from the package, nothing public-looking is there
without being listed (submodules aside), and ``__all__`` is sorted in the isort style (ruff's
RUF022: CONSTANTS, then Classes, then functions, each in order).
"""

from __future__ import annotations

import importlib
import inspect

import pytest

PUBLIC = ["trajtrack", "trajtrack.backends", "trajtrack.rollout", "trajtrack.ray"]


def _isort_key(name: str) -> tuple[int, str]:
    kind = 0 if name.isupper() else 1 if name[0].isupper() else 2
    return kind, name


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names_are_exactly_all(name: str) -> None:
    if name == "trajtrack.ray":
        pytest.importorskip("ray")  # the adapter's own extra (tests/ray require it in CI)
    module = importlib.import_module(name)
    declared = list(module.__all__)
    assert declared == sorted(declared, key=_isort_key), f"{name}.__all__ is not sorted"
    assert len(set(declared)) == len(declared), f"{name}.__all__ repeats a name"
    for attr in declared:  # names a package imports on first use (PEP 562) are then there
        getattr(module, attr, None)
    public = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_") and not inspect.ismodule(value) and attr != "annotations"
    }
    assert public == set(declared) - {"__version__"}, (
        f"{name}: public but not in __all__: {sorted(public - set(declared))}; "
        f"in __all__ but missing: {sorted(set(declared) - public - {'__version__'})}"
    )
    for attr in declared:
        assert getattr(module, attr) is not None, f"{name}.{attr}"
