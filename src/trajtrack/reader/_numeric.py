"""Element-wise comparison of two same-shape, same-dtype CPU tensors (for ``diff``).

:func:`mismatch` answers "equal within tolerance?" and, when not, the statistics ``diff``
reports: elements outside tolerance, the largest ``|a - b|`` (NaN pairs excluded), the largest
``|a - b| / |b|`` (over ``b != 0``) and the row-major index of the first element outside
tolerance. The semantics are those of ``torch.isclose(a, b, rtol, atol, equal_nan)``.

Two paths compute the same numbers:

* the fast path, for real tensors (float32/float64, and others widened to float64) whose
  differences are all finite, the common case: numpy over zero-copy views (its comparisons
  and reductions cost several times less than torch's on one core, and release the GIL),
  chunk by chunk into per-thread scratch buffers (no fresh pages per comparison). Per chunk:
  ``a != b`` and its count, which settles equal chunks in one pass and is the mask outside
  tolerance when the tolerances are zero; otherwise ``|a - b|`` once, its maximum, the mask
  ``|a - b| > atol + |rtol * b|`` (isclose's own arithmetic, in the tensors' dtype), the first
  index (``argmax`` stops at the first hit), and ``|a - b| / |b|`` in place. It hands over to
  the general path when a NaN or an infinity is involved, when a zero ``b`` sits next to a
  difference, or for tolerances that are not finite;
* the general path, torch's ``isclose`` and explicit masks, handles everything else (NaN
  policy, infinities, complex numbers).

Equal tensors of other dtypes, and floats the fast path hands over, are first compared
bitwise (one pass; NaN == NaN there when ``equal_nan``).
"""

from __future__ import annotations

import math
import threading
from typing import Any, Final, NamedTuple

import numpy as np
import torch

__all__ = ["Mismatch", "bitwise_equal", "fast_flat", "mismatch"]

_FAST_DTYPES = (torch.float32, torch.float64)
_NATIVE_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)


class Mismatch(NamedTuple):
    """Two tensors that are not equal within tolerance (a named tuple).

    Attributes:
        mismatched: Elements outside tolerance (at least 1).
        max_abs: Largest ``|a - b|`` over pairs without NaN; ``None`` when every pair has one.
        max_rel: Largest ``|a - b| / |b|`` over those pairs with ``b != 0``, else ``None``.
        first: Row-major (flat) index of the first element outside tolerance.
        values: The two elements at *first* as Python numbers, when the comparison read them
            from the tensors given (``None``: read them there with ``.item()``).
    """

    mismatched: int
    max_abs: float | None
    max_rel: float | None
    first: int
    values: tuple[Any, Any] | None = None


def mismatch(
    a: torch.Tensor, b: torch.Tensor, *, rtol: float, atol: float, equal_nan: bool
) -> Mismatch | None:
    """Compare two strided CPU tensors of one shape and dtype; ``None`` when equal.

    An element is equal when ``|a - b| <= atol + rtol * |b|`` (``torch.isclose``); NaN equals
    NaN at the same position when *equal_nan*; a NaN against a number is always a difference.
    """
    if a.dtype in _FAST_DTYPES:
        decided, found = _fast(a, b, rtol, atol, own=True)
        if decided:
            return found
    # Equal tensors: one bitwise pass. Bitwise equality implies equality except for NaN,
    # which only matters when NaN == NaN is off.
    nan_possible = a.is_floating_point() or a.is_complex()
    if (equal_nan or not nan_possible) and bitwise_equal(a, b):
        return None
    if not nan_possible and rtol == 0 and atol == 0:
        return _exact(a, b)  # integers exactly: float64 would merge values beyond 2**53
    if a.dtype in _NATIVE_DTYPES:
        x, y = a, b  # no widening copies of the common float tensors
    else:  # ints, bools, half precision: exact in float64 up to 2**53
        wide = torch.complex128 if a.is_complex() else torch.float64
        x, y = a.to(wide), b.to(wide)
        decided, found = _fast(x, y, rtol, atol)
        if decided:
            return found
    return _general(x, y, rtol, atol, equal_nan)


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors of one shape and dtype hold the same bytes."""
    # numpy's comparison of the raw memory (as 8-byte words where the size allows) is far
    # cheaper than torch.equal here (which, for equal tensors, makes a full per-dtype pass
    # and may contend for its thread pool on a busy machine).
    try:
        if a.is_contiguous() and b.is_contiguous() and a.dim() > 0:
            raw_a = a.reshape(-1).view(torch.uint8).numpy()
            raw_b = b.reshape(-1).view(torch.uint8).numpy()
            if raw_a.size % 8 == 0 and a.data_ptr() % 8 == 0 and b.data_ptr() % 8 == 0:
                raw_a, raw_b = raw_a.view(np.uint64), raw_b.view(np.uint64)
            return bool(np.array_equal(raw_a, raw_b))
    except (RuntimeError, TypeError):  # exotic dtypes or layouts: the generic path
        pass
    return bool(torch.equal(a, b))


def _exact(a: torch.Tensor, b: torch.Tensor) -> Mismatch | None:
    """Integer or boolean tensors compared element by element, exactly (the magnitudes, over
    the differing elements only, in float64)."""
    try:
        x = np.ascontiguousarray(a.numpy()).reshape(-1)
        y = np.ascontiguousarray(b.numpy()).reshape(-1)
    except (RuntimeError, TypeError):  # no numpy view (a lazy negation): the general path
        return _general(a.to(torch.float64), b.to(torch.float64), 0.0, 0.0, True)
    outside = x != y
    count = int(np.count_nonzero(outside))
    if not count:
        return None
    first = int(outside.argmax())  # the method stops at the first True
    wide_x, wide_y = x[outside].astype(np.float64), y[outside].astype(np.float64)
    diff = np.abs(wide_x - wide_y)
    nonzero = wide_y != 0
    if nonzero.any():
        max_rel: float | None = float((diff[nonzero] / np.abs(wide_y[nonzero])).max())
    else:  # equal elements count too, with a relative difference of 0 where b != 0
        max_rel = 0.0 if np.count_nonzero(y) else None
    return Mismatch(count, float(diff.max()), max_rel, first, (x[first].item(), y[first].item()))


_UNDECIDED: tuple[bool, Mismatch | None] = (False, None)

# The fast path works through the tensors in chunks of this many elements, with scratch
# buffers kept per thread: no new memory per comparison (fresh pages cost more than the
# arithmetic), bounded scratch whatever the tensor size (at most two float64 chunks and a
# mask, 1.1 MiB, per thread that compared; freed with the thread), and passes run in cache.
_CHUNK = 1 << 16
_scratch = threading.local()


def _fast(
    x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float, *, own: bool = False
) -> tuple[bool, Mismatch | None]:
    """``(True, result)``, or ``(False, None)`` when the general path must decide; *own*:
    *x* and *y* are the tensors compared, not widened copies (the result then holds the
    elements at its first index, read from numpy's views: cheaper than torch indexing)."""
    if not (math.isfinite(rtol) and math.isfinite(atol)):
        return _UNDECIDED
    try:
        xn, yn = x.numpy(), y.numpy()  # views; fails for tensors with a lazy negation bit
    except (RuntimeError, TypeError):
        return _UNDECIDED
    # Flat and row-major (the first index is a row-major one), copies only if strided.
    xn, yn = np.ascontiguousarray(xn).reshape(-1), np.ascontiguousarray(yn).reshape(-1)
    return fast_flat(xn, yn, rtol, atol, own=own)


def fast_flat(
    xn: np.ndarray[Any, Any], yn: np.ndarray[Any, Any], rtol: float, atol: float, *, own: bool
) -> tuple[bool, Mismatch | None]:
    """:func:`mismatch`'s fast path over two flat, row-major arrays of one float dtype
    (float32 or float64) and length: ``(True, result)``, or ``(False, None)`` when the
    general path must decide (NaN, infinities, a zero ``b`` next to a difference)."""
    if not (math.isfinite(rtol) and math.isfinite(atol)):
        return _UNDECIDED
    exact = rtol == 0 and atol == 0
    if xn.size <= _SMALL and exact:
        return _small_exact(xn, yn, own)
    diff, allowed, mask = _buffers(xn.dtype, min(xn.size, _CHUNK), exact)
    mismatched, first, max_abs, max_rel = 0, -1, 0.0, 0.0
    with np.errstate(all="ignore"):  # inf - inf, 0 / 0 and x / 0 are expected here
        for start in range(0, xn.size, _CHUNK):
            xc, yc = xn[start : start + _CHUNK], yn[start : start + _CHUNK]
            n = xc.size
            # a != b first: it settles equal chunks in one pass (NaN is != everything, so
            # NaNs go on below), and it is the mask outside tolerance for zero tolerances.
            outside = np.not_equal(xc, yc, out=mask[:n])
            count = int(np.count_nonzero(outside))
            if not count:
                continue
            d = np.subtract(xc, yc, out=diff[:n])
            np.abs(d, out=d)
            largest = float(d.max())
            if not math.isfinite(largest):
                # A NaN or an infinity: the NaN policy and inf == inf need the general path.
                return _UNDECIDED
            max_abs = max(max_abs, largest)
            if not exact:
                # Every value is finite here, so isclose's (a == b) | (|a-b| <= allowed) is
                # |a-b| <= allowed (a == b gives 0, allowed >= 0), with allowed computed as
                # torch computes it: atol + |rtol * b|, in the tensors' dtype.
                limit = np.multiply(yc, rtol, out=allowed[:n])
                np.abs(limit, out=limit)
                np.add(limit, atol, out=limit)
                outside = np.greater(d, limit, out=mask[:n])
                count = int(np.count_nonzero(outside))
            if count:
                mismatched += count
                if first < 0:  # the method stops at the first True (np.argmax scans it all)
                    first = start + int(outside.argmax())
            # |a-b| / |b| as | |a-b| / b |, in place. b == 0 gives NaN (a == b: no relative
            # difference, and fmax skips NaN) or inf (a difference against a zero b, which
            # must be left out, not reported): the general path handles that case.
            np.divide(d, yc, out=d)
            np.abs(d, out=d)
            ratio = float(np.fmax.reduce(d))
            if math.isinf(ratio):
                return _UNDECIDED
            if ratio > max_rel:
                max_rel = ratio
    if not mismatched:
        return True, None
    values = (xn[first].item(), yn[first].item()) if own else None
    return True, Mismatch(mismatched, max_abs, max_rel, first, values)


_SMALL: Final = 4096  # elements: a tensor this small is compared without scratch buffers


def _small_exact(
    xn: np.ndarray[Any, Any], yn: np.ndarray[Any, Any], own: bool
) -> tuple[bool, Mismatch | None]:
    """:func:`fast_flat` for a small array and zero tolerances (the default): the same steps
    on fresh arrays, in one go (no scratch buffers, no chunks: a small array's comparison is
    its calls' overhead, which this saves; ``benchmarks/bench_diff.py``)."""
    with np.errstate(all="ignore"):  # inf - inf, 0 / 0 and x / 0 are expected here
        outside = xn != yn
        count = int(np.count_nonzero(outside))
        if not count:
            return True, None
        d = np.abs(xn - yn)
        largest = float(np.maximum.reduce(d))
        if not math.isfinite(largest):
            return _UNDECIDED  # a NaN or an infinity: the general path
        first = int(outside.argmax())  # the method stops at the first True
        ratio = float(np.fmax.reduce(np.abs(d / yn)))
    if math.isinf(ratio):
        return _UNDECIDED  # a difference against a zero b: the general path
    values = (xn[first].item(), yn[first].item()) if own else None
    return True, Mismatch(count, largest, ratio if ratio > 0.0 else 0.0, first, values)


def _buffers(
    dtype: np.dtype[Any], size: int, exact: bool
) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """This thread's scratch, at least *size* elements: two of *dtype* (one if *exact*), a mask."""
    buffers: dict[np.dtype[Any], list[np.ndarray[Any, Any]]] | None
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    found = buffers.get(dtype)
    if found is None or found[0].size < size or (not exact and found[1].size < size):
        have = found[0].size if found is not None else 0
        grown = max(size, min(2 * have, _CHUNK))  # grow geometrically, up to a chunk
        found = buffers[dtype] = [
            np.empty(grown, dtype),
            np.empty(grown if not exact else 0, dtype),
            np.empty(grown, np.bool_),
        ]
    return found[0], found[1], found[2]


def _general(
    x: torch.Tensor, y: torch.Tensor, rtol: float, atol: float, equal_nan: bool
) -> Mismatch | None:
    close = torch.isclose(x, y, rtol=rtol, atol=atol, equal_nan=equal_nan)
    if bool(close.all()):
        return None
    outside = ~close
    mismatched = int(outside.sum())
    # Masks instead of boolean indexing: no copies of the selected elements, one pass each.
    diff = (x - y).abs()
    nan_diff = torch.isnan(diff)  # NaN in x or y (or inf - inf)
    has_finite = not bool(nan_diff.all())
    max_abs = float(diff.masked_fill(nan_diff, -1.0).max()) if has_finite else None
    denominator = y.abs()
    rel = diff / denominator
    unusable = nan_diff | (denominator == 0)
    max_rel = None if bool(unusable.all()) else float(rel.masked_fill(unusable, -1.0).max())
    first = int(torch.argmax(outside.reshape(-1).to(torch.uint8)))
    return Mismatch(mismatched, max_abs, max_rel, first)
