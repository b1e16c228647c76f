"""Two archives of the same pickle compared without loading give exactly what loading and
comparing them gives; everything this path does not take is declined (``None``)."""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

import pytest
import torch

from reader.test_fast_load import archived, saved
from trajtrack.reader._archive_diff import compare_archives
from trajtrack.reader._compare import Tolerance, compare
from trajtrack.reader._safe_load import load_dump_bytes

TOLERANCES = [Tolerance(), Tolerance(atol=0.5), Tolerance(rtol=1e-3), Tolerance(1e-2, 1e-6)]


def _tensor(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice([torch.float32, torch.float64])
    shape = rng.choice([(), (1,), (7,), (3, 4), (2, 3, 5)])
    return (torch.randn(shape, dtype=dtype) * 100).round()


def _structure(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if depth >= 3 or roll < 0.35:
        return rng.choice([_tensor(rng), _tensor(rng), 3, "text", None, 2.5, True])
    items = [_structure(rng, depth + 1) for _ in range(rng.randint(1, 4))]
    if roll < 0.55:
        return {f"k{i}": item for i, item in enumerate(items)}
    if roll < 0.7:
        return OrderedDict((i, item) for i, item in enumerate(items))
    if roll < 0.85:
        return items
    return tuple(items)


def _perturbed(obj: Any, rng: random.Random) -> Any:
    """The same structure, some tensors' elements changed (specials included)."""
    if isinstance(obj, torch.Tensor):
        copy = obj.clone()
        if copy.numel() and rng.random() < 0.7:
            flat = copy.view(-1)
            for _ in range(rng.randint(1, 3)):
                flat[rng.randrange(flat.numel())] = rng.choice(
                    [1.0, -7.0, 0.0, 1e-4, 123456.0, float("nan"), float("inf")]
                    + [flat[0].item() + 0.25] * 3
                )
        return copy
    if isinstance(obj, dict):
        return type(obj)((key, _perturbed(value, rng)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_perturbed(item, rng) for item in obj)
    return obj


def _loaded(data_a: bytes, data_b: bytes, tol: Tolerance, limit: int) -> Any:
    return compare(load_dump_bytes(data_a), load_dump_bytes(data_b), tol, limit=limit)


@pytest.mark.parametrize("writer", [saved, archived], ids=["torch.save", "archive writer"])
@pytest.mark.parametrize("seed", range(25))
def test_what_it_decides_is_what_loading_and_comparing_gives(writer: Any, seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    obj = _structure(rng)
    data_a, data_b = writer(obj), writer(_perturbed(obj, rng))
    decided = 0
    for tol in TOLERANCES:
        for limit in (1, 2, 20):
            got = compare_archives(data_a, data_b, tol, limit)
            if got is not None:
                decided += 1
                assert got == _loaded(data_a, data_b, tol, limit), (tol, limit)
    assert decided or writer is saved or not _tensors_in(obj) or _has_special(data_b)


def _tensors_in(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_tensors_in(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_tensors_in(v) for v in obj)
    return False


def _has_special(data: bytes) -> bool:
    found: list[bool] = []

    def walk(obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            found.append(bool((~torch.isfinite(obj)).any()) or bool((obj == 0).any()))
        elif isinstance(obj, dict):
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)

    walk(load_dump_bytes(data))
    return any(found)


def _pair(**changes: Any) -> tuple[bytes, bytes]:
    a = {"index": 3, "values": torch.arange(1000, dtype=torch.float32), "name": "x"}
    b = {**a, "values": a["values"].clone(), **changes}
    b["values"][614] += 1
    return saved(a), saved(b)


def test_the_common_case_is_decided_as_loading_decides() -> None:
    data_a, data_b = _pair()
    got = compare_archives(data_a, data_b, Tolerance(), 20)
    assert got is not None and len(got) == 1
    assert got == _loaded(data_a, data_b, Tolerance(), 20)
    assert got[0].path == "['values']" and got[0].index == (614,)


@pytest.mark.parametrize(
    ("changes", "tol"),
    [
        ({"index": 4}, Tolerance()),  # another pickle: load and compare
        ({"name": "y"}, Tolerance()),
        ({}, Tolerance(equal_nan=False)),  # equal pickles may hold unequal NaN floats
    ],
)
def test_what_it_does_not_take_is_declined(changes: dict[str, Any], tol: Tolerance) -> None:
    assert compare_archives(*_pair(**changes), tol, 20) is None


@pytest.mark.parametrize(
    "make",
    [
        lambda t: {"x": t.to(torch.int64)},  # not float32/float64
        lambda t: {"x": t[2:]},  # not its whole storage
        lambda t: {"x": t.view(10, 100).t()},  # not row-major
        lambda t: {"x": t, "same": t},  # shared: fine, both compared
        lambda t: {"s": {1, 2}, "x": t},  # a set of atoms: fine
    ],
)
def test_tensors_it_cannot_view_decline_and_others_agree(make: Any) -> None:
    base = torch.arange(1000, dtype=torch.float32)
    other = base.clone()
    other[700] = -1
    data_a, data_b = saved(make(base)), saved(make(other))
    got = compare_archives(data_a, data_b, Tolerance(), 20)
    assert got is None or got == _loaded(data_a, data_b, Tolerance(), 20)


def test_a_nan_in_the_data_is_left_to_loading() -> None:
    a = torch.arange(10, dtype=torch.float32)
    b = a.clone()
    b[3] = float("nan")
    assert compare_archives(saved({"x": a}), saved({"x": b}), Tolerance(), 20) is None


class _Outside:
    """A class no allow-list has (module level: picklable)."""


def test_a_pickle_outside_the_table_is_declined_unread() -> None:
    data = saved({"x": torch.ones(3), "o": _Outside()})
    assert compare_archives(data, data, Tolerance(), 20) is None


def test_the_other_archive_is_checked_as_the_fast_loader_checks_it() -> None:
    # The same pickle over a storage record longer than it names: the fast loader declines
    # it (torch decides), and so does this path, though its pickle was read once only.
    import io
    import zipfile

    data_a = saved({"x": torch.arange(1000, dtype=torch.float32)})
    source = zipfile.ZipFile(io.BytesIO(data_a))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as rewritten:
        for name in source.namelist():
            data = source.read(name)
            rewritten.writestr(zipfile.ZipInfo(name), data + bytes(4 * name.endswith("/0")))
    data_b = out.getvalue()
    assert compare_archives(data_a, data_a, Tolerance(), 20) == []
    assert compare_archives(data_a, data_b, Tolerance(), 20) is None
