"""Tensor comparison: the fast path gives exactly what torch.isclose and masks give."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trajtrack.reader import Tolerance, compare
from trajtrack.reader._numeric import _CHUNK, Mismatch, mismatch


def reference(a: torch.Tensor, b: torch.Tensor, tol: Tolerance) -> Mismatch | None:
    """The documented semantics, computed the plain way (torch.isclose and masks)."""
    if a.dtype in (torch.float32, torch.float64, torch.complex64, torch.complex128):
        x, y = a, b
    else:
        x, y = a.to(torch.float64), b.to(torch.float64)
    close = torch.isclose(x, y, rtol=tol.rtol, atol=tol.atol, equal_nan=tol.equal_nan)
    if bool(close.all()):
        return None
    outside = ~close
    diff = (x - y).abs()
    nan = torch.isnan(diff)
    max_abs = None if bool(nan.all()) else float(diff[~nan].max())
    usable = ~nan & (y != 0)
    max_rel = float((diff[usable] / y.abs()[usable]).max()) if bool(usable.any()) else None
    first = int(torch.nonzero(outside.reshape(-1))[0])
    return Mismatch(int(outside.sum()), max_abs, max_rel, first)


def check(a: torch.Tensor, b: torch.Tensor, **tol: float | bool) -> Mismatch | None:
    tolerance = Tolerance(**tol)  # type: ignore[arg-type]
    found = mismatch(a, b, rtol=tolerance.rtol, atol=tolerance.atol, equal_nan=tolerance.equal_nan)
    expected = reference(a, b, tolerance)
    assert same(found, expected), (found, expected)
    return found


def same(x: Mismatch | None, y: Mismatch | None) -> bool:
    if x is None or y is None:
        return x is y
    return (x.mismatched, x.first) == (y.mismatched, y.first) and all(
        u == v or (u is not None and v is not None and math.isnan(u) and math.isnan(v))
        for u, v in ((x.max_abs, y.max_abs), (x.max_rel, y.max_rel))
    )


TOLERANCES = [{}, {"atol": 1e-3}, {"rtol": 1e-2}, {"rtol": 1e-3, "atol": 1e-6}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tol", TOLERANCES)
def test_random_perturbations_match_the_reference(
    dtype: torch.dtype, tol: dict[str, float]
) -> None:
    gen = torch.Generator().manual_seed(7)
    for trial in range(20):
        n = [1, 7, 1000, _CHUNK + 5, 3 * _CHUNK][trial % 5]
        a = torch.randn(n, generator=gen, dtype=dtype) * 10 ** (trial % 7 - 3)
        b = a.clone()
        picks = torch.randint(0, n, (1 + trial % 4,), generator=gen)
        b[picks] += torch.randn(len(picks), generator=gen, dtype=dtype) * 10 ** (trial % 5 - 4)
        if trial % 3 == 0:
            b[torch.randint(0, n, (3,), generator=gen)] = 0.0  # zeros in b
        check(a, b, **tol)


def test_differences_in_later_chunks_give_the_global_first_index() -> None:
    a = torch.zeros(3 * _CHUNK + 11)
    b = a.clone()
    b[2 * _CHUNK + 3] = 1.0
    b[3 * _CHUNK + 10] = -4.0
    found = check(a, b)
    assert found is not None
    assert (found.first, found.mismatched, found.max_abs) == (2 * _CHUNK + 3, 2, 4.0)


def test_tolerance_boundaries_are_those_of_isclose() -> None:
    # Exactly at atol: equal; the next float above: different (as torch.isclose says).
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    b = torch.tensor([1.5, 2.0, 3.0], dtype=torch.float64)
    assert check(a, b, atol=0.5) is None
    assert check(a, b, atol=math.nextafter(0.5, 0.0)) is not None
    # rtol is relative to b: |1 - 1.5| = 0.5 <= rtol * 1.5 for rtol = 1/3.
    assert check(a, b, rtol=1 / 3 + 1e-12) is None
    assert check(a, b, rtol=0.3) is not None
    for dtype in (torch.float32, torch.float64):  # rounding of atol + rtol * |b| in dtype
        x = torch.linspace(-3, 3, 10001, dtype=dtype)
        for step in (1e-4, 3e-4, 1e-3):
            check(x, x + step, atol=2e-4, rtol=1e-4)
            check(x, x * (1 + step), rtol=5e-4)


def test_infinities() -> None:
    inf = float("inf")
    a = torch.tensor([inf, -inf, 1.0, inf, 5.0])
    b = torch.tensor([inf, -inf, 2.0, 1.0, -inf])
    found = check(a, b)
    assert found is not None and found.mismatched == 3 and found.first == 2
    assert found.max_abs == inf
    assert check(a[:2], b[:2]) is None  # same infinities are equal
    assert check(torch.tensor([inf, 1.0]), torch.tensor([-inf, 1.0]), atol=inf) is not None


@pytest.mark.parametrize("equal_nan", [True, False])
def test_nan_in_one_side_or_both(equal_nan: bool) -> None:
    nan = float("nan")
    a = torch.tensor([1.0, nan, 3.0, nan])
    b = torch.tensor([1.0, 2.0, 3.5, nan])
    found = check(a, b, equal_nan=equal_nan, atol=1.0)
    assert found is not None and found.first == 1
    assert found.mismatched == (1 if equal_nan else 2)
    assert found.max_abs == 0.5  # NaN pairs are left out of the statistics
    only_nan = check(torch.tensor([nan, 1.0]), torch.tensor([nan, 1.0]), equal_nan=equal_nan)
    assert (only_nan is None) == equal_nan
    all_nan = check(torch.tensor([nan]), torch.tensor([0.0]))
    assert all_nan is not None and all_nan.max_abs is None and all_nan.max_rel is None


def test_zero_in_b_next_to_a_difference_is_left_out_of_max_rel() -> None:
    a = torch.tensor([1.0, 2.0, 4.0])
    b = torch.tensor([0.0, 2.0, 5.0])
    found = check(a, b)
    assert found is not None and found.max_rel == pytest.approx(0.2)
    assert found.max_abs == 1.0 and found.first == 0
    only_zero = check(torch.tensor([1.0]), torch.tensor([0.0]))
    assert only_zero is not None and only_zero.max_rel is None


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float16, torch.bfloat16]
)
def test_other_dtypes_are_compared_exactly_in_float64(dtype: torch.dtype) -> None:
    a = torch.tensor([0, 1, 1, 0, 1]).to(dtype)
    b = torch.tensor([0, 1, 0, 0, 0]).to(dtype)
    found = check(a, b)
    assert found is not None and (found.mismatched, found.first) == (2, 2)
    assert check(a, a.clone()) is None
    if dtype is torch.int64:
        big = torch.tensor([2**52, 7])  # float64 is exact up to 2**53
        assert check(big, big + torch.tensor([1, 0])) is not None


def test_non_contiguous_and_scalar_tensors() -> None:
    a = torch.arange(12.0).reshape(3, 4)
    b = a.clone()
    b[2, 1] = 100.0
    (difference,) = compare(a.t(), b.t())  # first index in row-major order of the view
    assert difference.index == (1, 2)
    assert check(a.t(), b.t()) is not None
    (scalar,) = compare(torch.tensor(1.0), torch.tensor(2.0))
    assert scalar.index == () and scalar.max_abs == 1.0 and scalar.max_rel == 0.5


def test_negative_zero_and_complex() -> None:
    assert check(torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0])) is None
    a = torch.tensor([1 + 1j, 2 + 0j])
    found = check(a, torch.tensor([1 + 1j, 2 + 1j]))
    assert found is not None and found.first == 1 and found.max_abs == 1.0


def test_numpy_arrays_take_the_same_path() -> None:
    a = np.linspace(0, 1, 50, dtype=np.float32)
    b = a.copy()
    b[7] += 0.25
    (difference,) = compare(a, b)
    assert difference.index == (7,) and difference.mismatched == 1
    assert difference.max_abs == pytest.approx(0.25, rel=1e-6)


def test_finite_float_tensors_never_need_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    import trajtrack.reader._numeric as numeric

    def unexpected(*args: object) -> None:
        raise AssertionError("the general path was taken")

    monkeypatch.setattr(numeric, "_general", unexpected)
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.float64, torch.int64):
        a = (torch.randn(2 * _CHUNK + 3, generator=gen) * 100).to(dtype)
        b = a.clone()
        b[[5, _CHUNK + 9]] += 1
        for tol in TOLERANCES:
            assert mismatch(a, b, rtol=0.0, atol=0.0, equal_nan=True) is not None
            assert mismatch(a, a.clone(), equal_nan=True, **_tol(tol)) is None
            mismatch(a, b, equal_nan=True, **_tol(tol))


def _tol(tol: dict[str, float]) -> dict[str, float]:
    return {"rtol": tol.get("rtol", 0.0), "atol": tol.get("atol", 0.0)}


def test_small_arrays_get_what_the_chunked_path_gives(monkeypatch: pytest.MonkeyPatch) -> None:
    # Zero tolerances on a small array take a shorter way (no scratch buffers): its answers,
    # hand-overs included, are the chunked path's.
    from trajtrack.reader import _numeric

    rng = np.random.default_rng(3)
    specials = [0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 1e-30, 3e38]
    cases = []
    for trial in range(400):
        dtype = np.float32 if trial % 2 else np.float64
        n = int(rng.integers(1, 60))
        x = (rng.standard_normal(n) * 10 ** int(rng.integers(-3, 4))).astype(dtype)
        y = x.copy()
        for _ in range(int(rng.integers(0, 4))):
            where = int(rng.integers(0, n))
            choice = rng.random()
            if choice < 0.4:
                y[where] += dtype(rng.standard_normal())
            else:
                target = x if choice < 0.6 else y
                target[where] = dtype(specials[int(rng.integers(0, len(specials)))])
        cases.append((x, y))
    small = [_numeric.fast_flat(x, y, 0.0, 0.0, own=True) for x, y in cases]
    monkeypatch.setattr(_numeric, "_SMALL", 0)
    chunked = [_numeric.fast_flat(x, y, 0.0, 0.0, own=True) for x, y in cases]
    assert any(found is not None for decided, found in small if decided)
    assert any(not decided for decided, _ in small)
    for (x, y), got, want in zip(cases, small, chunked, strict=True):
        assert repr(got) == repr(want), (x, y)
