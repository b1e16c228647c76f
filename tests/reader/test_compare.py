"""Structural comparison, unit level."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from trajtrack.reader import Tolerance, compare


@dataclasses.dataclass
class Point:
    x: float
    tags: list[str]


def kinds(a: object, b: object, **tol: float | bool) -> list[tuple[str, str]]:
    return [(d.path, d.kind) for d in compare(a, b, Tolerance(**tol))]  # type: ignore[arg-type]


def test_equal_nested_structures() -> None:
    value = {"t": torch.arange(4), "a": np.arange(3.0), "l": [1, "x", None], "p": Point(1.0, [])}
    assert compare(value, {**value, "p": Point(1.0, [])}) == []


def test_paths_name_the_place() -> None:
    a = {"p": Point(1.0, ["a", "b"]), "l": (1, 2)}
    b = {"p": Point(2.0, ["a", "c"]), "l": (1, 2, 3)}
    assert kinds(a, b) == [("['p'].x", "value"), ("['p'].tags[1]", "value"), ("['l']", "length")]


def test_type_mismatch_and_numbers() -> None:
    # Another container holding the same items is a note, not a difference (issue 33).
    assert kinds([1], (1,)) == []
    assert compare([1], (1,)).notes == ("list vs tuple at <root>: compared by content",)
    assert kinds([1], "1") == [("", "type")]
    assert kinds(1, 1.0) == []
    assert kinds(1.0, 1.05, atol=0.1) == []
    assert kinds(1.0, 1.05) == [("", "value")]
    assert kinds(float("nan"), float("nan")) == []
    assert kinds(float("nan"), float("nan"), equal_nan=False) == [("", "value")]


def test_numpy_arrays() -> None:
    assert kinds(np.zeros(3), np.zeros(3, dtype=np.float32)) == [("", "dtype")]
    assert kinds(np.zeros((2, 2)), np.zeros(4)) == [("", "shape")]
    a = np.array(["x", {"k": 1}], dtype=object)
    b = np.array(["x", {"k": 2}], dtype=object)
    assert kinds(a, b) == [("[1]['k']", "value")]
    (d,) = compare(np.arange(6).reshape(2, 3), np.array([[0, 1, 2], [3, 9, 5]]))
    # Integers are compared as integers: count and first position, no magnitude (issue 35).
    assert d.index == (1, 1) and d.max_abs is None and d.max_rel is None and d.mismatched == 1
    assert d.detail == "1 of 6 elements differ" and d.rows == (1,)


def test_tensor_statistics_and_first_index() -> None:
    a = torch.zeros(3, 4)
    b = a.clone()
    b[1, 2], b[2, 0] = 0.5, -2.0
    (d,) = compare(a, b)
    assert d.index == (1, 2) and d.mismatched == 2 and d.total == 12
    assert d.max_abs == pytest.approx(2.0)
    assert compare(a, b, Tolerance(atol=2.0)) == []


def test_limit_stops_the_walk() -> None:
    a = {str(i): i for i in range(100)}
    b = {str(i): i + 1 for i in range(100)}
    assert len(compare(a, b, limit=7)) == 7


def test_infinities_do_not_poison_the_statistics() -> None:
    # inf - inf is NaN: equal infinities must not turn max abs / max rel into NaN.
    a = torch.tensor([float("inf"), 1.0, 4.0])
    b = torch.tensor([float("inf"), 2.0, 4.0])
    (found,) = compare(a, b, Tolerance())
    assert found.max_abs == 1.0
    assert found.max_rel == 0.5
    assert found.index == (1,)
    assert found.mismatched == 1


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 5), (1, 1, 4), (4, 1, 2, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.float16])
def test_the_first_difference_is_placed_and_read_as_numpy_would(
    shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    # The index and the two values at it, whichever path computed them (numpy views for
    # float32/float64, widened copies for the others): row-major, the tensors' own values.
    gen = torch.Generator().manual_seed(len(shape))
    a = torch.randint(0, 50, shape, generator=gen).to(dtype)
    b = a.clone()
    flat = int(torch.randint(0, a.numel(), (1,), generator=gen))
    b.view(-1)[flat] += 3
    b.view(-1)[-1] += 1  # a second difference, later in row-major order
    (d,) = compare({"t": a}, {"t": b})
    expected = tuple(int(i) for i in np.unravel_index(flat, shape))
    assert d.index == expected
    assert (d.a, d.b) == (repr(a[expected].item()), repr(b[expected].item()))
    assert d.mismatched == (1 if flat == a.numel() - 1 else 2)


def test_a_transposed_tensor_is_compared_in_its_own_row_major_order() -> None:
    a = torch.zeros(3, 4).t()  # not contiguous
    b = a.clone()
    b[2, 1] = 5.0
    (d,) = compare(a, b)
    assert d.index == (2, 1) and (d.a, d.b) == ("0.0", "5.0")


def test_mappings_with_the_same_keys_in_another_order_walk_in_a_order() -> None:
    a = {"x": 1, "y": 2, "z": 3}
    b = {"z": 4, "y": 5, "x": 6}
    assert [d.path for d in compare(a, b)] == ["['x']", "['y']", "['z']"]
    assert kinds({"x": 1, "y": 2}, {"y": 2, "w": 1}) == [("['x']", "missing"), ("['w']", "extra")]
