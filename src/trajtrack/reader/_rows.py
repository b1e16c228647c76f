"""Which rows of two batch tensors differ, and those rows' ids (for ``diff``).

A tensor's first dimension is taken as its batch dimension: :func:`differing_rows` gives every
row index holding an element outside tolerance (``torch.isclose``'s rule, as the comparison
itself), :func:`row_ids` the id of each such row from the batch's id column -- ``uid``, else
``sample_id``, else ``index`` -- found in the enclosing containers (a ``non_tensor_batch`` or
``batch`` of a ``DataProto``-like object, or a key next to the tensor), when it has one entry
per row. Both run only for tensors that differ, never on the path of equal ones.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from trajtrack.reader._kinds import abbreviate, batch_like, is_mapping

__all__ = ["ID_COLUMNS", "as_numpy", "differing_rows", "row_ids"]

ID_COLUMNS = ("uid", "sample_id", "index")
_ID_WIDTH = 40


def differing_rows(
    x: np.ndarray[Any, Any],
    y: np.ndarray[Any, Any],
    shape: tuple[int, ...],
    *,
    rtol: float,
    atol: float,
    equal_nan: bool,
    first: int,
    mismatched: int,
) -> tuple[int, ...] | None:
    """The indices along the first dimension of *shape* where flat arrays *x* and *y* (of
    that shape, row-major) hold an element outside tolerance; ``None`` for a 0-d shape.

    *first* and *mismatched* are the comparison's own answer (the flat index of the first
    element outside tolerance, and their count): rows before *first*'s are not looked at, and
    a single element outside tolerance is its row, without a pass over the arrays.
    """
    if not shape or not shape[0]:
        return None
    width = max(1, math.prod(shape[1:]))
    start = first // width
    if mismatched == 1:
        return (start,)
    x2, y2 = x[start * width :].reshape(-1, width), y[start * width :].reshape(-1, width)
    with np.errstate(all="ignore"):
        if rtol or atol:
            outside = ~np.isclose(x2, y2, rtol=rtol, atol=atol, equal_nan=equal_nan)
        else:  # a != b: one pass, integers never through floats
            outside = x2 != y2
        rows = np.flatnonzero(outside if width == 1 else outside.any(axis=1))
        if equal_nan and not (rtol or atol) and x.dtype.kind in "fc" and rows.size:
            # NaN != NaN: a row whose only differences are NaN pairs is equal.
            both_nan = np.isnan(x2[rows]) & np.isnan(y2[rows])
            rows = rows[(outside[rows] & ~both_nan).reshape(rows.size, -1).any(axis=1)]
    return tuple(int(i) + start for i in rows)


def as_numpy(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A strided CPU tensor as a numpy array (a view where numpy has its dtype, else widened:
    bfloat16 and other dtypes numpy lacks to float64, or complex128)."""
    try:
        array: np.ndarray[Any, Any] = tensor.numpy()
    except (RuntimeError, TypeError):
        wide = torch.complex128 if tensor.is_complex() else torch.float64
        array = tensor.to(wide).numpy()
    return array


def row_ids(
    parents: Sequence[Any], rows: tuple[int, ...], count: int
) -> tuple[str | None, tuple[str, ...] | None]:
    """``(column, ids of rows)`` from the innermost of *parents* (outermost first) with an id
    column of *count* entries, or ``(None, None)``."""
    for parent in reversed(parents):
        for column, values in _candidates(parent):
            if _length(values) == count:
                return column, tuple(_text(values[r]) for r in rows)
    return None, None


def _candidates(parent: Any) -> list[tuple[str, Any]]:
    sources: list[Any]
    if type(parent) is dict:  # the common case, without the duck-typing checks
        sources = [parent]
    elif batch_like(parent):
        sources = [getattr(parent, "non_tensor_batch", None), getattr(parent, "batch", None)]
    elif is_mapping(parent):
        sources = [parent]
    else:
        return []
    found = []
    for source in sources:
        if type(source) is not dict and not is_mapping(source):
            continue
        for column in ID_COLUMNS:
            try:
                if column in source.keys():  # noqa: SIM118  # mapping-likes without __contains__
                    found.append((column, source[column]))
            except Exception:  # a mapping-like whose look-up fails: no ids from it
                continue
    return found


def _length(values: Any) -> int | None:
    if isinstance(values, (torch.Tensor, np.ndarray)):
        return int(values.shape[0]) if values.ndim == 1 else None
    if isinstance(values, (list, tuple)):
        return len(values)
    return None


def _text(value: Any) -> str:
    if isinstance(value, torch.Tensor | np.generic):
        value = value.item()
    text = value if isinstance(value, str) else abbreviate(value)
    return text if len(text) <= _ID_WIDTH else text[: _ID_WIDTH - 3] + "..."
