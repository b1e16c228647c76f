"""Structural comparison of two dumped objects: :func:`compare`.

:func:`compare` walks two objects side by side: mappings (also duck-typed ones such as a
``TensorDict``), lists and tuples, dataclasses, ``DataProto``/``RolloutBatch``-like objects
(``batch``, ``non_tensor_batch``, ``meta_info``), tensors, numpy arrays, scalars and strings.
It reports missing and extra keys, type, length, shape and dtype mismatches, and for numbers
the largest absolute and relative difference and the first element outside tolerance.

Tolerance: an element is equal when ``|a - b| <= atol + rtol * |b|`` (``torch.isclose``;
*b* is the second run). The defaults (``rtol=0``, ``atol=0``) mean exact equality. NaN policy:
by default NaN equals NaN at the same position (a NaN against a number is always a
difference); ``equal_nan=False`` makes every NaN a difference. The relative difference is
``|a - b| / |b|`` over elements with ``b != 0``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from trajtrack.reader._numeric import Mismatch, mismatch

__all__ = ["Difference", "Tolerance", "compare", "numeric_difference"]

DifferenceKind = Literal["value", "shape", "dtype", "type", "missing", "extra", "length"]

_MAX_DEPTH = 64
_MAX_ELEMENTS_WALKED = 10_000  # object arrays / long lists compared element by element
_ABBREVIATE = 60


@dataclass(frozen=True, slots=True)
class Tolerance:
    """When two numbers count as equal: ``|a - b| <= atol + rtol * |b|``.

    Attributes:
        rtol: Relative tolerance (default 0: exact).
        atol: Absolute tolerance (default 0: exact).
        equal_nan: NaN equals NaN at the same position (default True).
    """

    rtol: float = 0.0
    atol: float = 0.0
    equal_nan: bool = True

    def __post_init__(self) -> None:
        if not (self.rtol >= 0 and self.atol >= 0):
            raise ValueError(f"tolerances must be >= 0, got rtol={self.rtol} atol={self.atol}")


@dataclass(frozen=True, slots=True)
class Difference:
    """One difference between two objects.

    Attributes:
        path: Where, from the dump's root: ``.field`` for attributes, ``['key']`` for mapping
            keys, ``[3]`` for sequence items (``""`` is the root).
        kind: ``value``, ``shape``, ``dtype``, ``type``, ``missing`` (only in A), ``extra``
            (only in B) or ``length``.
        detail: A one-line human description.
        max_abs: Largest ``|a - b|`` (numbers only; NaN pairs excluded).
        max_rel: Largest ``|a - b| / |b|`` over ``b != 0`` (numbers only).
        index: Index of the first element outside tolerance (row-major), for arrays.
        mismatched: Elements outside tolerance.
        total: Elements compared.
        a: The value in A at *index* (abbreviated).
        b: The value in B at *index* (abbreviated).
    """

    path: str
    kind: DifferenceKind
    detail: str
    max_abs: float | None = None
    max_rel: float | None = None
    index: tuple[int, ...] | None = None
    mismatched: int | None = None
    total: int | None = None
    a: str | None = None
    b: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict (non-finite floats become strings)."""
        out = dataclasses.asdict(self)
        out["index"] = list(self.index) if self.index is not None else None
        for key in ("max_abs", "max_rel"):
            value = out[key]
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = str(value)
        return out


def compare(
    a: Any, b: Any, tolerance: Tolerance | None = None, *, limit: int = 50
) -> list[Difference]:
    """Compare two objects structurally; an empty list means equal within tolerance.

    Args:
        a: The first object (run A).
        b: The second object (run B).
        tolerance: Numeric tolerance and NaN policy (default: exact, NaN == NaN).
        limit: At most this many differences are returned; the walk stops there.

    Returns:
        The :class:`Difference` objects found, in walk order (A's key order).
    """
    walker = _Walker(tolerance or Tolerance(), limit)
    walker.walk(a, b, "", 0)
    return walker.found


class _Stop(Exception):
    """The difference limit is reached."""


@dataclass
class _Walker:
    tol: Tolerance
    limit: int
    found: list[Difference] = field(default_factory=list)

    def add(self, difference: Difference) -> None:
        self.found.append(difference)
        if len(self.found) >= self.limit:
            raise _Stop

    def walk(self, a: Any, b: Any, path: str, depth: int) -> None:
        try:
            self._walk(a, b, path, depth)
        except _Stop:
            if depth:
                raise

    def _walk(self, a: Any, b: Any, path: str, depth: int) -> None:
        if a is b and not isinstance(a, (float, torch.Tensor, np.ndarray)):
            return
        if depth > _MAX_DEPTH:
            self._fallback(a, b, path)
        elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            self._tensors(a, b, path)
        elif isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            self._arrays(a, b, path, depth)
        elif _is_number(a) and _is_number(b):
            self._numbers(a, b, path)
        elif type(a) is not type(b) and not (_batch_like(a) and _batch_like(b)):
            self.add(
                Difference(
                    path, "type", f"{_type_name(a)} vs {_type_name(b)}", a=_abbrev(a), b=_abbrev(b)
                )
            )
        elif isinstance(a, (str, bytes, type(None), bool)):
            if a != b:
                self.add(Difference(path, "value", "values differ", a=_abbrev(a), b=_abbrev(b)))
        elif _is_mapping(a):
            self._mappings(a, b, path, depth)
        elif isinstance(a, (list, tuple)):
            self._sequences(a, b, path, depth)
        elif _batch_like(a):
            for name in ("batch", "non_tensor_batch", "meta_info"):
                self.walk(getattr(a, name), getattr(b, name), f"{path}.{name}", depth + 1)
        elif dataclasses.is_dataclass(a) and not isinstance(a, type):
            for f in dataclasses.fields(a):
                self.walk(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}", depth + 1)
        elif hasattr(a, "__dict__") and not callable(a):
            self._mappings(vars(a), vars(b), path, depth, attributes=True)
        else:
            self._fallback(a, b, path)

    def _fallback(self, a: Any, b: Any, path: str) -> None:
        try:
            same = bool(a == b)
        except Exception:  # == that raises or returns something without a truth value
            same = repr(a) == repr(b)
        if not same:
            self.add(Difference(path, "value", "values differ", a=_abbrev(a), b=_abbrev(b)))

    def _mappings(self, a: Any, b: Any, path: str, depth: int, *, attributes: bool = False) -> None:
        keys_a = list(a.keys())
        set_a, keys_b = set(keys_a), set(b.keys())

        def where(key: Any) -> str:
            return f"{path}.{key}" if attributes else f"{path}[{key!r}]"

        if set_a == keys_b:  # the common case: nothing missing, nothing extra
            for key in keys_a:
                self.walk(a[key], b[key], where(key), depth + 1)
            return
        for key in keys_a:
            if key not in keys_b:
                self.add(Difference(where(key), "missing", "only in A", a=_abbrev(a[key])))
        for key in list(b.keys()):
            if key not in set_a:
                self.add(Difference(where(key), "extra", "only in B", b=_abbrev(b[key])))
        for key in keys_a:
            if key in keys_b:
                self.walk(a[key], b[key], where(key), depth + 1)

    def _sequences(self, a: Any, b: Any, path: str, depth: int) -> None:
        if len(a) != len(b):
            self.add(Difference(path, "length", f"length {len(a)} vs {len(b)}"))
        for i, (x, y) in enumerate(zip(a, b, strict=False)):  # lengths checked above
            if i >= _MAX_ELEMENTS_WALKED:
                self._fallback(list(a[i:]), list(b[i:]), f"{path}[{i}:]")
                break
            self.walk(x, y, f"{path}[{i}]", depth + 1)

    def _numbers(self, a: Any, b: Any, path: str) -> None:
        try:
            x, y = complex(a), complex(b)
        except OverflowError:  # integers beyond float range: compare exactly
            self._fallback(a, b, path)
            return
        if x == y:
            return
        both_nan = _isnan(x) and _isnan(y)
        if both_nan and self.tol.equal_nan:
            return
        diff = abs(x - y)
        finite = not (_isnan(x) or _isnan(y))
        if finite and diff <= self.tol.atol + self.tol.rtol * abs(y):
            return
        rel = diff / abs(y) if y != 0 and not math.isnan(diff) else None
        self.add(
            Difference(
                path,
                "value",
                "numbers differ",
                max_abs=None if math.isnan(diff) else diff,
                max_rel=rel,
                a=_abbrev(a),
                b=_abbrev(b),
            )
        )

    def _arrays(self, a: np.ndarray[Any, Any], b: np.ndarray[Any, Any], path: str, d: int) -> None:
        if a.shape != b.shape:
            self.add(Difference(path, "shape", f"shape {list(a.shape)} vs {list(b.shape)}"))
            return
        if a.dtype != b.dtype:
            self.add(Difference(path, "dtype", f"dtype {a.dtype} vs {b.dtype}"))
            return
        if a.dtype.kind in "biufc" and a.dtype.byteorder in "=|<":
            self._numeric(_as_tensor(a), _as_tensor(b), path)
            return
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        for i in range(min(flat_a.size, _MAX_ELEMENTS_WALKED)):
            index = np.unravel_index(i, a.shape) if a.ndim else ()
            sub = f"{path}[{', '.join(str(int(j)) for j in index)}]"
            self.walk(flat_a[i], flat_b[i], sub, d + 1)
        if flat_a.size > _MAX_ELEMENTS_WALKED:
            self._fallback(
                flat_a[_MAX_ELEMENTS_WALKED:].tolist(),
                flat_b[_MAX_ELEMENTS_WALKED:].tolist(),
                f"{path}[{_MAX_ELEMENTS_WALKED}:]",
            )

    def _tensors(self, a: torch.Tensor, b: torch.Tensor, path: str) -> None:
        if a.shape != b.shape:
            self.add(Difference(path, "shape", f"shape {list(a.shape)} vs {list(b.shape)}"))
            return
        if a.dtype != b.dtype:
            self.add(Difference(path, "dtype", f"dtype {_dtype(a)} vs {_dtype(b)}"))
            return
        if a.layout != torch.strided or b.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        self._numeric(a.detach().cpu(), b.detach().cpu(), path)

    def _numeric(self, a: torch.Tensor, b: torch.Tensor, path: str) -> None:
        tol = self.tol
        found = mismatch(a, b, rtol=tol.rtol, atol=tol.atol, equal_nan=tol.equal_nan)
        if found is None:
            return
        if found.values is not None:
            value_a, value_b = found.values
        else:
            first = found.first
            value_a, value_b = a.reshape(-1)[first].item(), b.reshape(-1)[first].item()
        self.add(numeric_difference(path, found, a.shape, a.numel(), value_a, value_b))


def numeric_difference(
    path: str, found: Mismatch, shape: tuple[int, ...], numel: int, value_a: Any, value_b: Any
) -> Difference:
    """The :class:`Difference` of two tensors (or arrays) of *shape* that *found* says differ,
    *value_a* and *value_b* the elements at its first index."""
    max_abs, max_rel = found.max_abs, found.max_rel
    detail = f"{found.mismatched} of {numel} elements differ"
    if max_abs is not None:
        detail += f" (max abs {max_abs:.6g}"
        detail += f", max rel {max_rel:.6g})" if max_rel is not None else ")"
    index = _unravel(found.first, shape)
    a, b = _abbrev(value_a), _abbrev(value_b)
    # Positional, in field order: keywords double a frozen dataclass's construction.
    return Difference(path, "value", detail, max_abs, max_rel, index, found.mismatched, numel, a, b)


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The index of row-major element *flat* in *shape* (``np.unravel_index``, for plain
    ints: a fifth of its cost on a small tensor)."""
    index = []
    for size in reversed(shape):
        flat, at = divmod(flat, size)
        index.append(at)
    return tuple(reversed(index))


def _as_tensor(array: np.ndarray[Any, Any]) -> torch.Tensor:
    if array.dtype.kind == "u" and array.dtype.itemsize > 1:
        array = array.astype(np.int64 if array.dtype.itemsize < 8 else np.float64)
    if not array.flags.writeable:  # torch warns about sharing read-only memory
        array = array.copy()
    return torch.from_numpy(np.ascontiguousarray(array))


def _is_number(value: Any) -> bool:
    return isinstance(value, (numbers.Number, np.number)) and not isinstance(
        value, (bool, np.bool_)
    )


def _isnan(value: complex) -> bool:
    return math.isnan(value.real) or math.isnan(value.imag)


def _is_mapping(value: Any) -> bool:
    if isinstance(value, Mapping):
        return True
    # TensorDict and other mapping-likes without the ABC.
    return hasattr(value, "keys") and hasattr(value, "__getitem__") and hasattr(value, "items")


def _batch_like(value: Any) -> bool:
    return all(hasattr(value, n) for n in ("batch", "non_tensor_batch", "meta_info"))


def _type_name(value: Any) -> str:
    return type(value).__name__


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _abbrev(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor({_dtype(value)}, {list(value.shape)})"
    if isinstance(value, np.ndarray):
        return f"ndarray({value.dtype}, {list(value.shape)})"
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ in a dumped object
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _ABBREVIATE else text[: _ABBREVIATE - 3] + "..."
