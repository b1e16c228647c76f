"""What kind of container a loaded object is, and its bounded text, for every walk over
loaded dumps (``compare``, ``show``'s description, the reports, :mod:`._rows`).

Containers are recognised by what they expose, not by their class, so that the same data in
another container compares equal: mappings (also duck-typed ones such as a ``TensorDict``),
``DataProto``-like objects (``batch``, ``non_tensor_batch``, ``meta_info``: verl's
``DataProto``, trajtrack's ``RolloutBatch``) and records (dataclasses by their fields, other
objects by their attributes).
"""

from __future__ import annotations

import dataclasses
import numbers
import reprlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from trajtrack._exceptions import DumpLoadError

__all__ = [
    "BATCH_PARTS",
    "ELEMENT_BUDGET",
    "abbreviate",
    "batch_like",
    "check_budget",
    "dtype_text",
    "is_mapping",
    "is_number",
    "record_fields",
    "within_budget",
]

BATCH_PARTS = ("batch", "non_tensor_batch", "meta_info")
_PLAIN = frozenset({int, float, complex, bool, type(None), str, bytes})
_WIDTH = 60


class _BoundedRepr(reprlib.Repr):
    """A bounded repr: a few levels and items of each container, never the whole object (a
    list DAG of shared references or a 5,000-deep list has an unbounded or recursive plain
    repr); records shown by their fields through it, not by their own ``__repr__``."""

    def repr1(self, x: Any, level: int) -> str:
        fields = _record_view(x)
        if fields is None:
            return super().repr1(x, level)
        if level <= 0:
            return f"{type(x).__name__}{{...}}"
        return type(x).__name__ + self.repr_dict(fields, level)


_REPR = _BoundedRepr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxstring = _REPR.maxother = _WIDTH


def is_number(value: Any) -> bool:
    """A real or complex number (numpy scalars included), not a bool."""
    return isinstance(value, (numbers.Number, np.number)) and not isinstance(
        value, (bool, np.bool_)
    )


def is_mapping(value: Any) -> bool:
    """A ``Mapping``, or a mapping-like without the ABC (``keys``, ``__getitem__``, ``items``)."""
    if isinstance(value, Mapping):
        return True
    return hasattr(value, "keys") and hasattr(value, "__getitem__") and hasattr(value, "items")


def batch_like(value: Any) -> bool:
    """An object with ``batch``, ``non_tensor_batch`` and ``meta_info`` (``DataProto``-like)."""
    return all(hasattr(value, n) for n in BATCH_PARTS)


def record_fields(value: Any) -> dict[str, Any] | None:
    """A dataclass instance's fields, or another non-callable object's attributes, by name;
    ``None`` for anything else."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if hasattr(value, "__dict__") and not callable(value):
        return dict(vars(value))
    return None


def dtype_text(value: torch.Tensor | np.ndarray[Any, Any]) -> str:
    """``float32``, ``int64``, ... for a tensor or an array."""
    if isinstance(value, torch.Tensor):
        return str(value.dtype).removeprefix("torch.")
    return str(value.dtype)


def abbreviate(value: Any, width: int = _WIDTH) -> str:
    """A one-line text of *value*, at most *width* characters, computed in bounded time."""
    if isinstance(value, torch.Tensor):
        return f"tensor({dtype_text(value)}, {list(value.shape)})"
    if isinstance(value, np.ndarray):
        return f"ndarray({value.dtype}, {list(value.shape)})"
    try:
        # Plain values as repr gives them (bounded by their size), the rest by the bounded repr.
        text = repr(value) if type(value) in _PLAIN else _REPR.repr(value)
    except Exception:  # a broken __repr__ in a dumped object
        text = f"<{type(value).__name__}>"
    return text if len(text) <= width else text[: width - 3] + "..."


def _record_view(value: Any) -> dict[str, Any] | None:
    if isinstance(value, (str, bytes, int, float, list, tuple, dict, set, frozenset)):
        return None
    if value is None or isinstance(value, (torch.Tensor, np.ndarray, np.generic)):
        return None
    if batch_like(value):
        return {n: getattr(value, n, None) for n in BATCH_PARTS}
    return record_fields(value)


ELEMENT_BUDGET = 1 << 24
"""Elements a walk materializes at most for a tensor whose storage does not already hold them
(an expanded or overlapping view: a 1 KB stride-0 tensor can claim 2**34 elements)."""


def within_budget(tensor: torch.Tensor) -> bool:
    """Whether *tensor*'s elements can be computed on: at most :data:`ELEMENT_BUDGET` of them,
    or a strided tensor whose storage holds as many bytes as its elements take."""
    count = tensor.numel()
    if count <= ELEMENT_BUDGET:
        return True
    if tensor.layout != torch.strided:
        return False  # densifying allocates every element
    try:
        stored = tensor.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return False
    return stored >= count * tensor.element_size()


def check_budget(tensor: torch.Tensor, where: str) -> None:
    """Raise :class:`~trajtrack.DumpLoadError` unless :func:`within_budget` (*where* names the
    tensor in the message)."""
    if not within_budget(tensor):
        raise DumpLoadError(
            f"{where}: a {tensor.layout} tensor of {tensor.numel()} elements over a storage of "
            f"{_stored(tensor)} bytes (an expanded view): more than the budget of "
            f"{ELEMENT_BUDGET} elements to materialize; not compared"
        )


def _stored(tensor: torch.Tensor) -> str:
    try:
        return str(tensor.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):
        return "unknown"
