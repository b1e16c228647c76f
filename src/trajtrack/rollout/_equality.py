"""Deep, tensor- and array-aware equality used by the batch container.

Python's ``==`` on a tensor or an ndarray is element-wise and cannot be used in an ``if``;
these helpers compare whole values instead and treat ``NaN`` as equal to itself so that a
batch read back from disk compares equal to the one that was written.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["values_equal"]


def values_equal(a: Any, b: Any) -> bool:
    """Return whether ``a`` and ``b`` hold the same data.

    Tensors must match in dtype, shape and values; arrays in shape, dtype kind and values
    (object arrays element by element, recursively); mappings (also mapping-likes without
    the ABC, such as a ``TensorDict``) and sequences recursively; batches (``DataProto``,
    ``RolloutBatch``: ``batch``, ``non_tensor_batch``, ``meta_info``) part by part; floats
    compare ``NaN == NaN`` as true. Never raises: a value whose ``==`` fails, or gives
    something without a truth value, counts as different.

    Args:
        a: First value.
        b: Second value.

    Returns:
        ``True`` when the two values are equal in the sense above.
    """
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _tensors_equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return _arrays_equal(a, b)
    if _batch_like(a) or _batch_like(b):
        return (
            _batch_like(a)
            and _batch_like(b)
            and all(values_equal(getattr(a, part), getattr(b, part)) for part in _BATCH_PARTS)
        )
    if _mapping_like(a) and _mapping_like(b):
        keys = list(a.keys())
        return set(keys) == set(b.keys()) and all(values_equal(a[k], b[k]) for k in keys)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        same_kind = isinstance(a, list) == isinstance(b, list)
        return same_kind and len(a) == len(b) and all(map(values_equal, a, b))
    return _scalars_equal(a, b)


_BATCH_PARTS = ("batch", "non_tensor_batch", "meta_info")


def _batch_like(value: Any) -> bool:
    return all(hasattr(value, part) for part in _BATCH_PARTS)


def _mapping_like(value: Any) -> bool:
    # TensorDict and other mapping-likes that do not register with the Mapping ABC.
    return isinstance(value, Mapping) or (
        hasattr(value, "keys") and hasattr(value, "__getitem__") and hasattr(value, "items")
    )


def _scalars_equal(a: Any, b: Any) -> bool:
    if isinstance(a, float | np.floating) and isinstance(b, float | np.floating):
        return bool(a == b) or (math.isnan(a) and math.isnan(b))
    try:
        return bool(a == b)
    except Exception:  # an element-wise == (a TensorDict's), or one that raises: different
        return False


def _tensors_equal(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(torch.equal(a.isnan(), b.isnan())) and bool(
            torch.equal(a.nan_to_num(), b.nan_to_num())
        )
    return bool(torch.equal(a, b))


def _arrays_equal(a: Any, b: Any) -> bool:
    if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
        return False
    if a.shape != b.shape or a.dtype.kind != b.dtype.kind:
        return False
    if a.dtype.kind == "O":
        return all(map(values_equal, a.ravel().tolist(), b.ravel().tolist()))
    equal_nan = a.dtype.kind in "fc"
    return bool(np.array_equal(a, b, equal_nan=equal_nan))
