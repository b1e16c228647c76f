"""Finding an object again from a :attr:`Difference.path`, and the differences of two tensors.

:func:`find_at_path` walks a loaded dump the way :func:`~trajtrack.reader.compare` does, naming
each child exactly as ``compare`` names it (``.field``, ``['key']``, ``[3]``, ``[1, 2]``), so a
path that ``compare`` reported leads back to the same object: nothing is parsed or evaluated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from trajtrack.reader._kinds import (
    batch_like as _batch_like,
    is_mapping as _is_mapping,
    is_number as _is_number,
    within_budget,
)

__all__ = [
    "MISSING",
    "difference_values",
    "dtype_name",
    "find_at_path",
    "finite_values",
    "numeric_leaves",
]

MISSING: Any = object()
_MAX_DEPTH = 64
_MAX_SAMPLES = 2_000_000  # differences drawn at most; larger tensors are sampled with a stride


def find_at_path(obj: Any, path: str) -> Any:
    """The object at *path* in *obj* (``""`` is *obj*), or :data:`MISSING`."""
    return _find(obj, "", path, 0)


def _find(obj: Any, here: str, path: str, depth: int) -> Any:
    if here == path:
        return obj
    if depth > _MAX_DEPTH:
        return MISSING
    for name, child in _children(obj, here, path):
        if path == name or (path.startswith(name) and path[len(name)] in ".["):
            found = _find(child, name, path, depth + 1)
            if found is not MISSING:
                return found
    return MISSING


def numeric_leaves(obj: Any, *, limit: int = 10_000) -> Iterator[tuple[str, Any]]:
    """``(path, tensor)`` for each tensor and numeric array in *obj*, in ``compare``'s order.

    Paths are named as :func:`~trajtrack.reader.compare` names them; at most *limit* objects
    are visited (a dump with huge lists of scalars is not walked to the end), a container
    reached again through a shared reference is not walked again, and nothing deeper than 64
    levels is.
    """
    stack: list[tuple[str, Any, int]] = [("", obj, 0)]
    visited = 0
    seen: dict[int, Any] = {}  # shared nodes once (kept alive: their ids stay theirs)
    while stack and visited < limit:
        here, value, depth = stack.pop()
        visited += 1
        if id(value) in seen:
            continue
        if isinstance(value, torch.Tensor) or (
            isinstance(value, np.ndarray) and value.dtype.kind in "biufc"
        ):
            yield here, value
        elif depth < _MAX_DEPTH:
            seen[id(value)] = value
            children = list(_children(value, here, None))
            stack.extend((name, child, depth + 1) for name, child in reversed(children))


def _children(obj: Any, here: str, path: str | None) -> Iterator[tuple[str, Any]]:
    """(path, child) pairs, in the order and with the names of ``compare``'s walk.

    With a *path*, a list or tuple yields only the item on that path (a long list is not
    walked); with ``None``, every item.
    """
    if isinstance(obj, torch.Tensor) or _is_number(obj):
        return
    if isinstance(obj, np.ndarray):
        if obj.dtype.kind == "O":
            for index in np.ndindex(obj.shape):
                yield f"{here}[{', '.join(str(i) for i in index)}]", obj[index]
    elif isinstance(obj, (str, bytes, type(None), bool)):
        return
    elif _is_mapping(obj):
        for key in list(obj.keys()):
            yield f"{here}[{key!r}]", obj[key]
    elif isinstance(obj, (list, tuple)):
        if path is None:
            yield from ((f"{here}[{i}]", item) for i, item in enumerate(obj))
        elif path[len(here) :].startswith("["):  # straight to the item
            token = path[len(here) + 1 :].split("]", 1)[0]
            if token.isdigit() and int(token) < len(obj):
                yield f"{here}[{token}]", obj[int(token)]
    elif _batch_like(obj):
        for name in ("batch", "non_tensor_batch", "meta_info"):
            yield f"{here}.{name}", getattr(obj, name)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield f"{here}.{f.name}", getattr(obj, f.name)
    elif hasattr(obj, "__dict__") and not callable(obj):
        for key, value in vars(obj).items():
            yield f"{here}.{key}", value


def difference_values(
    a: Any, b: Any
) -> tuple[np.ndarray[Any, Any], int, int, tuple[int, ...], str] | None:
    """``a - b`` element-wise for two numeric tensors (or arrays) of the same shape.

    Returns:
        ``(finite differences as flat float64, number of non-finite ones, sampling stride,
        shape, dtype)``, or ``None`` when *a* and *b* are not such a pair. Complex values give
        ``|a - b|``; booleans count as 0/1. At most about two million elements are used: a
        larger tensor is sampled with a stride (the same positions in both).
    """
    shape_a, shape_b = _shape(a), _shape(b)
    if shape_a is None or shape_a != shape_b:
        return None
    step = max(1, math.ceil(math.prod(shape_a) / _MAX_SAMPLES))
    x, y = _flat(a, step), _flat(b, step)
    if x is None or y is None:
        return None
    if x.dtype.kind == "c" or y.dtype.kind == "c":
        values = np.abs(x.astype(np.complex128) - y.astype(np.complex128))
    else:
        values = x.astype(np.float64) - y.astype(np.float64)
    finite = np.isfinite(values)
    return values[finite], int(values.size - finite.sum()), step, shape_a, dtype_name(a)


def finite_values(value: Any) -> tuple[np.ndarray[Any, Any], int, int] | None:
    """The finite values of a numeric tensor or array, flat float64 (``|v|`` when complex).

    Returns:
        ``(values, number of NaN/infinite ones, sampling stride)``, or ``None`` when *value*
        is not numeric. Sampled with a stride beyond about two million elements.
    """
    shape = _shape(value)
    if shape is None:
        return None
    step = max(1, math.ceil(math.prod(shape) / _MAX_SAMPLES))
    flat = _flat(value, step)
    if flat is None:
        return None
    values = np.abs(flat) if flat.dtype.kind == "c" else flat.astype(np.float64)
    finite = np.isfinite(values)
    return values[finite], int(values.size - finite.sum()), step


def _shape(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, torch.Tensor) or (
        isinstance(value, np.ndarray) and value.dtype.kind in "biufc"
    ):
        return tuple(int(n) for n in value.shape)
    return None


def _flat(value: Any, step: int) -> np.ndarray[Any, Any] | None:
    """Every *step*-th element of a numeric tensor or array, as a numpy array."""
    if isinstance(value, np.ndarray):
        return value.reshape(-1)[::step]
    tensor = value.detach().cpu()
    if not within_budget(tensor):  # an expanded view of a small storage: not materialized
        return None
    try:
        if tensor.layout != torch.strided:
            tensor = tensor.to_dense()
        tensor = tensor.reshape(-1)[::step]
        if tensor.is_complex():
            tensor = tensor.to(torch.complex128)
        elif tensor.dtype != torch.int64:
            # float64 holds every value of the float and the smaller integer types exactly.
            tensor = tensor.to(torch.float64)
        array: np.ndarray[Any, Any] = tensor.numpy()
        return array
    except (RuntimeError, TypeError):  # quantized and other tensors without a plain view
        return None


def dtype_name(value: Any) -> str:
    """``float32``, ``int64``, ... for a tensor or an array."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    return str(value.dtype)
