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

from trajtrack.reader._compare import _batch_like, _is_mapping, _is_number

__all__ = ["MISSING", "difference_values", "find_at_path"]

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


def _children(obj: Any, here: str, path: str) -> Iterator[tuple[str, Any]]:
    """(path, child) pairs, in the order and with the names of ``compare``'s walk."""
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
        rest = path[len(here) :]
        if rest.startswith("["):  # straight to the item: a long list is not walked
            token = rest[1:].split("]", 1)[0]
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
    return values[finite], int(values.size - finite.sum()), step, shape_a, _dtype_name(a)


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


def _dtype_name(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    return str(value.dtype)
