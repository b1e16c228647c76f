"""Two dumps that differ only in their tensors' data, compared without building them.

Reruns of a training step usually dump the same structure with other numbers: the two
archives then hold the same pickle (the same keys, shapes, dtypes, strings and ints) and
differ in their storages' bytes. :func:`compare_archives` reads both pickles with the fast
loader's restricted unpickler (:func:`~trajtrack.reader._fast_load.unpickled`: nothing outside
its table is ever imported, and each tensor stays an inert record), and, when the pickles are
the same bytes, compares each pair of tensors as numpy views of the two archives' storages,
in the order and with the paths :func:`~trajtrack.reader._compare.compare` walks them, by the
same numeric fast path (:func:`~trajtrack.reader._numeric.fast_flat`) and into the same
:class:`~trajtrack.reader._compare.Difference`. No tensor, no copy of the data, and no second
walk of the objects: a 4 KB differing pair costs about half of loading and comparing it.

Everything else declines (``None``), and the caller loads and compares as before: pickles that
differ, ``equal_nan=False`` (equal pickles may then hold unequal NaNs), tensors other than
float32/float64, tensors that are not their whole storage in row-major order, tensors inside
sets, nesting or sequences beyond what the walk takes, and whatever the numeric fast path
hands over (NaN, infinities, a zero next to a difference).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any, Final

import numpy as np
import torch

from trajtrack.reader._compare import Difference, Tolerance, numeric_difference
from trajtrack.reader._fast_load import (
    ATOMS,
    DECLINES,
    TensorRef,
    Unpickled,
    archive_data_pickle,
    storage_start,
    unpickled,
)
from trajtrack.reader._numeric import fast_flat

__all__ = ["compare_archives"]

_NUMPY: Final[dict[torch.dtype, np.dtype[Any]]] = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
}
_MAX_DEPTH: Final = 48  # below the walk's own bound (64), where it compares as a whole
_MAX_ITEMS: Final = 10_000  # the walk compares a longer sequence's tail as a whole


class _Declined(Exception):
    """Not for this path: load and compare."""


def compare_archives(
    data_a: bytes, data_b: bytes, tol: Tolerance, limit: int
) -> list[Difference] | None:
    """What ``compare(load(data_a), load(data_b), tol, limit=limit)`` gives, or ``None`` when
    this path declines (see the module) and the caller must load and compare (blocking)."""
    if not tol.equal_nan or not (math.isfinite(tol.rtol) and math.isfinite(tol.atol)):
        return None
    try:
        a = unpickled(data_a)
        if not a.tensors:
            return None  # nothing that differs in data only
        starts_b = _same_pickle_storages(a, data_b)
        if starts_b is None:
            return None
        found: list[Difference] = []
        for path, ref, parents in _tensors(a.obj, "", 0, ()):
            x = _array(ref, data_a, ref[4].start)
            y = _array(ref, data_b, starts_b[ref[4].key])
            difference = _difference(path, ref[3], x, y, tol, parents)
            if difference is not None:
                found.append(difference)
                if len(found) >= limit:
                    break
        return found
    except (_Declined, *DECLINES):
        return None


def _same_pickle_storages(a: Unpickled, data_b: bytes) -> dict[str, int] | None:
    """Where each of *a*'s storages starts in archive *data_b*, if *data_b* holds the same
    pickle (else ``None``): what the fast loader would find unpickling it, checked as it
    checks (its records, each storage's record and length: declined where one does not fit),
    without unpickling it again."""
    pickled, records = archive_data_pickle(data_b)
    if pickled != a.pickle:
        return None
    return {key: storage_start(data_b, records, key, r.length) for key, r in a.storages.items()}


def _tensors(
    obj: Any, path: str, depth: int, parents: tuple[Any, ...]
) -> Iterator[tuple[str, TensorRef, tuple[Any, ...]]]:
    """Each tensor record of *obj* with its path and the dicts around it, in the order
    :func:`~trajtrack.reader._compare.compare` walks two objects of this structure."""
    kind = type(obj)
    if kind is TensorRef:
        yield path, obj, parents
    elif kind in ATOMS:
        return
    elif depth > _MAX_DEPTH:
        raise _Declined
    elif kind is dict or kind is OrderedDict:
        for key, value in obj.items():
            if type(key) not in ATOMS:
                raise _Declined  # a tensor (or a tuple) as a key
            yield from _tensors(value, f"{path}[{key!r}]", depth + 1, (*parents, obj))
    elif kind is list or kind is tuple:
        if len(obj) > _MAX_ITEMS:
            raise _Declined
        for i, item in enumerate(obj):
            yield from _tensors(item, f"{path}[{i}]", depth + 1, parents)
    elif kind is set or kind is frozenset:
        if not ATOMS.issuperset(map(type, obj)):
            raise _Declined  # compared as a whole by the walk
    else:
        raise _Declined


def _difference(
    path: str,
    size: tuple[int, ...],
    x: np.ndarray[Any, Any],
    y: np.ndarray[Any, Any],
    tol: Tolerance,
    parents: tuple[Any, ...],
) -> Difference | None:
    decided, found = fast_flat(x, y, tol.rtol, tol.atol, own=True)
    if not decided:
        raise _Declined  # the general path's NaN and infinity rules: load and compare
    if found is None:
        return None
    assert found.values is not None  # own=True: read from the arrays
    return numeric_difference(
        path, found, size, x.size, *found.values, rows_of=(x, y, tol, parents)
    )


def _array(ref: TensorRef, data: bytes, start: int) -> np.ndarray[Any, Any]:
    """A tensor record's elements, flat, as a read-only view of archive *data* (its storage
    at *start*); only a tensor that is its whole storage in row-major order."""
    dtype, offset, _, size, record, stride = ref
    numpy_dtype = _NUMPY.get(dtype)
    if numpy_dtype is None or offset:
        raise _Declined
    count = math.prod(size)
    if not count or record.length != count * numpy_dtype.itemsize:
        raise _Declined
    if stride != _row_major(size):
        raise _Declined
    array: np.ndarray[Any, Any] = np.frombuffer(data, numpy_dtype, count, start)
    return array


def _row_major(size: tuple[int, ...]) -> tuple[int, ...]:
    strides = []
    step = 1
    for extent in reversed(size):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))
