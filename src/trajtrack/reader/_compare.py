"""Structural comparison of two dumped objects: :func:`compare`.

:func:`compare` walks two objects side by side: mappings (also duck-typed ones such as a
``TensorDict``), lists, tuples and 1-D object arrays, ``DataProto``/``RolloutBatch``-like
objects (``batch``, ``non_tensor_batch``, ``meta_info``), records (dataclasses by their fields,
other objects by their attributes), tensors, numpy arrays, scalars and strings. It reports
missing and extra keys, type, length, shape and dtype mismatches, for real numbers the largest
absolute and relative difference and the first element outside tolerance, for integers the
count and the first differing element, and for tensors with a batch dimension every differing
row (with its id where the batch has a ``uid``, ``sample_id`` or ``index`` column).

Containers compare by content (:mod:`trajtrack.reader._kinds`): a ``DataProto`` and a
``RolloutBatch``, a ``TensorDict`` and a ``dict``, verl's ``RolloutSample`` and trajtrack's
holding the same data are equal; a container-type difference alone is a note
(:attr:`Differences.notes`), not a difference (a record's field that only one side has counts
only when it holds something other than its default).

Every walk is bounded: a pair of shared nodes is compared once (a DAG of shared references costs
its size, not its paths); nesting deeper than 64 levels, and a tensor whose elements would have
to be materialized beyond :data:`~trajtrack.reader._kinds.ELEMENT_BUDGET` (an expanded view of
a small storage), raise :class:`~trajtrack.DumpLoadError`.

Tolerance: an element is equal when ``|a - b| <= atol + rtol * |b|`` (``torch.isclose``;
*b* is the second run). The defaults (``rtol=0``, ``atol=0``) mean exact equality. NaN policy:
by default NaN equals NaN at the same position (a NaN against a number is always a
difference); ``equal_nan=False`` makes every NaN a difference. The relative difference is
``|a - b| / |b|`` over elements with ``b != 0``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from trajtrack._exceptions import DumpLoadError
from trajtrack.reader._ignore import compile_ignore
from trajtrack.reader._kinds import (
    BATCH_PARTS,
    ELEMENT_BUDGET,
    abbreviate as _abbrev,
    batch_like,
    check_budget,
    dtype_text as _dtype,
    is_mapping,
    is_number,
    record_fields,
)
from trajtrack.reader._numeric import Mismatch, mismatch
from trajtrack.reader._rows import as_numpy, differing_rows, row_ids

__all__ = ["Difference", "Differences", "Tolerance", "compare", "numeric_difference"]

DifferenceKind = Literal["value", "shape", "dtype", "type", "missing", "extra", "length"]

MAX_DEPTH = 64
_MAX_ELEMENTS_WALKED = 10_000  # longer sequences of plain values: the tail compared at once
_ATOMS = frozenset({int, float, complex, str, bytes, bool, type(None)})
_NOTES = 20  # distinct container-type notes kept per comparison


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
        rows: Every index along the first (batch) dimension holding an element outside
            tolerance, for tensors and arrays of at least one dimension.
        id_column: The batch's id column the *row_ids* come from (``uid``, ``sample_id`` or
            ``index``), when it has one.
        row_ids: Run A's id of each of *rows* (abbreviated).
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
    rows: tuple[int, ...] | None = None
    id_column: str | None = None
    row_ids: tuple[str, ...] | None = None

    def rows_text(self, limit: int) -> str:
        """The first *limit* differing rows, each with its id where there is one
        (``"1 (uid u1), 5 (uid u5) and 3 more (--json lists all)"``); ``""`` for none."""
        rows, ids = self.rows or (), self.row_ids or ()
        shown = [
            f"{row} ({self.id_column} {ids[i]})" if i < len(ids) else str(row)
            for i, row in enumerate(rows[:limit])
        ]
        more = len(rows) - len(shown)
        return ", ".join(shown) + (f" and {more} more (--json lists all)" if more > 0 else "")

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict (non-finite floats become strings)."""
        out = dataclasses.asdict(self)
        for key in ("index", "rows", "row_ids"):
            value = out[key]
            out[key] = list(value) if value is not None else None
        for key in ("max_abs", "max_rel"):
            value = out[key]
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = str(value)
        return out


class Differences(list[Difference]):
    """What :func:`compare` found: the differences (a list, empty when equal), plus notes.

    Attributes:
        notes: Container-type differences that were compared by content and are not
            differences (``"DataProto vs RolloutBatch at .full_batch: compared by content"``).
        ignored: The paths left out because an ``ignore`` pattern matched them.
    """

    notes: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()


def compare(
    a: Any,
    b: Any,
    tolerance: Tolerance | None = None,
    *,
    limit: int = 50,
    ignore: Sequence[str] = (),
) -> Differences:
    """Compare two objects structurally; an empty list means equal within tolerance.

    Args:
        a: The first object (run A).
        b: The second object (run B).
        tolerance: Numeric tolerance and NaN policy (default: exact, NaN == NaN).
        limit: At most this many differences are returned; the walk stops there.
        ignore: Glob patterns (:mod:`trajtrack.reader._ignore`: ``*`` any run of characters,
            ``?`` one, brackets literal) matched against each key path as a
            :attr:`Difference.path` names it; a matching path and everything below it are
            neither compared nor counted.

    Returns:
        The :class:`Difference` objects found, in walk order (A's key order), as a
        :class:`Differences` list with the walk's notes and the ignored paths.

    Raises:
        DumpLoadError: The objects nest deeper than 64 levels, or a tensor's elements would
            have to be materialized beyond the element budget (an expanded view).
    """
    walker = _Walker(tolerance or Tolerance(), limit, compile_ignore(tuple(ignore)))
    walker.walk(a, b, "", 0)
    return walker.result()


class _Stop(Exception):
    """The difference limit is reached."""


class _Walker:
    def __init__(self, tol: Tolerance, limit: int, ignore: re.Pattern[str] | None) -> None:
        self.tol, self.limit, self.ignore = tol, limit, ignore
        self.found: list[Difference] = []
        self.notes: dict[tuple[str, str], list[Any]] = {}  # type pair -> [first path, count]
        self.ignored: list[str] = []
        # Pairs of containers already compared, kept alive so that their ids stay theirs.
        self.seen: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.parents: list[Any] = []  # the containers of A around the walk (row ids)

    def result(self) -> Differences:
        out = Differences(self.found)
        out.notes = tuple(
            f"{ta} vs {tb} at {where or '<root>'}"
            + (f" (and {n - 1} more {'place' if n == 2 else 'places'})" if n > 1 else "")
            + ": compared by content"
            for (ta, tb), (where, n) in self.notes.items()
        )
        out.ignored = tuple(self.ignored)
        return out

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
        if self.ignore is not None and path and self.ignore.fullmatch(path):
            self.ignored.append(path)  # before the identity check: listed whatever the values
        elif a is b and not isinstance(a, (float, torch.Tensor, np.ndarray)):
            return
        elif depth > MAX_DEPTH:
            where = path if len(path) <= 80 else f"{path[:77]}..."
            raise DumpLoadError(
                f"{where}: nested deeper than {MAX_DEPTH} levels; not compared (every walk "
                "over a loaded dump is bounded)"
            )
        elif isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            self._tensors(a, b, path)
        elif isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            self._arrays(a, b, path, depth)
        elif is_number(a) and is_number(b):
            self._numbers(a, b, path)
        else:
            self._containers(a, b, path, depth)

    def _containers(self, a: Any, b: Any, path: str, depth: int) -> None:
        kind = _kind(a)
        if kind is None or (type(a) is not type(b) and kind != _kind(b)):
            if type(a) is not type(b):
                detail = f"{_type_name(a)} vs {_type_name(b)}"
                self.add(Difference(path, "type", detail, a=_abbrev(a), b=_abbrev(b)))
            else:
                self._fallback(a, b, path)
            return
        key = (id(a), id(b))
        if key in self.seen:  # shared nodes: compared once, where first reached
            return
        self.seen[key] = (a, b)
        if type(a) is not type(b):
            self._note(a, b, path)
        if kind == "mapping":
            self._mappings(a, b, path, depth, a)
        elif kind == "sequence":
            self._sequences(a, b, path, depth)
        elif kind == "batch":
            self.parents.append(a)
            for name in BATCH_PARTS:
                self.walk(getattr(a, name), getattr(b, name), f"{path}.{name}", depth + 1)
            self.parents.pop()
        else:
            fields_a, fields_b = record_fields(a) or {}, record_fields(b) or {}
            if type(a) is not type(b):
                _drop_defaults(a, fields_a, fields_b)
                _drop_defaults(b, fields_b, fields_a)
            self._mappings(fields_a, fields_b, path, depth, None, attributes=True)

    def _note(self, a: Any, b: Any, path: str) -> None:
        pair = (_type_name(a), _type_name(b))
        noted = self.notes.get(pair)
        if noted is not None:
            noted[1] += 1
        elif len(self.notes) < _NOTES:
            self.notes[pair] = [path, 1]

    def _fallback(self, a: Any, b: Any, path: str) -> None:
        try:
            same = bool(a == b)
        except Exception:  # == that raises or returns something without a truth value
            same = _abbrev(a) == _abbrev(b)
        if not same:
            self.add(Difference(path, "value", "values differ", a=_abbrev(a), b=_abbrev(b)))

    def _mappings(
        self, a: Any, b: Any, path: str, depth: int, parent: Any, *, attributes: bool = False
    ) -> None:
        keys_a = list(a.keys())
        set_a, keys_b = set(keys_a), set(b.keys())

        def where(key: Any) -> str:
            return f"{path}.{key}" if attributes else f"{path}[{key!r}]"

        if parent is not None:
            self.parents.append(parent)
        if set_a == keys_b:  # the common case: nothing missing, nothing extra
            for key in keys_a:
                self.walk(a[key], b[key], where(key), depth + 1)
        else:
            self._keys(a, b, keys_a, set_a, keys_b, where)
            for key in keys_a:
                if key in keys_b:
                    self.walk(a[key], b[key], where(key), depth + 1)
        if parent is not None:
            self.parents.pop()

    def _keys(
        self, a: Any, b: Any, keys_a: list[Any], set_a: set[Any], keys_b: set[Any], where: Any
    ) -> None:
        for key in keys_a:
            if key not in keys_b and not self._ignored(where(key)):
                self.add(Difference(where(key), "missing", "only in A", a=_abbrev(a[key])))
        for key in list(b.keys()):
            if key not in set_a and not self._ignored(where(key)):
                self.add(Difference(where(key), "extra", "only in B", b=_abbrev(b[key])))

    def _ignored(self, path: str) -> bool:
        if self.ignore is not None and self.ignore.fullmatch(path):
            self.ignored.append(path)
            return True
        return False

    def _sequences(self, a: Any, b: Any, path: str, depth: int) -> None:
        if len(a) != len(b):
            self.add(Difference(path, "length", f"length {len(a)} vs {len(b)}"))
        n = min(len(a), len(b))
        for i in range(min(n, _MAX_ELEMENTS_WALKED)):
            self.walk(a[i], b[i], f"{path}[{i}]", depth + 1)
        if n <= _MAX_ELEMENTS_WALKED:
            return
        tail_a, tail_b = list(a[_MAX_ELEMENTS_WALKED:n]), list(b[_MAX_ELEMENTS_WALKED:n])
        if _plain(tail_a) and _plain(tail_b):  # a long list of plain values: == at once
            self._fallback(tail_a, tail_b, f"{path}[{_MAX_ELEMENTS_WALKED}:]")
            return
        for i in range(_MAX_ELEMENTS_WALKED, n):
            self.walk(a[i], b[i], f"{path}[{i}]", depth + 1)

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
            self._numeric(_as_tensor(a), _as_tensor(b), path, a.dtype.kind in "biu")
            return
        key = (id(a), id(b))
        if key in self.seen:
            return
        self.seen[key] = (a, b)
        if a.ndim == 1:
            self._sequences(a, b, path, d)
            return
        flat_a, flat_b = a.reshape(-1), b.reshape(-1)
        for i in range(flat_a.size):
            index = np.unravel_index(i, a.shape) if a.ndim else ()
            sub = f"{path}[{', '.join(str(int(j)) for j in index)}]"
            self.walk(flat_a[i], flat_b[i], sub, d + 1)

    def _tensors(self, a: torch.Tensor, b: torch.Tensor, path: str) -> None:
        if a.shape != b.shape:
            self.add(Difference(path, "shape", f"shape {list(a.shape)} vs {list(b.shape)}"))
            return
        if a.dtype != b.dtype:
            self.add(Difference(path, "dtype", f"dtype {_dtype(a)} vs {_dtype(b)}"))
            return
        if a.numel() > ELEMENT_BUDGET:  # (the same shapes: the same count)
            check_budget(a, f"A {path or '<root>'}")
            check_budget(b, f"B {path or '<root>'}")
        if a.layout != torch.strided or b.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        integer = not (a.is_floating_point() or a.is_complex())
        self._numeric(a.detach().cpu(), b.detach().cpu(), path, integer)

    def _numeric(self, a: torch.Tensor, b: torch.Tensor, path: str, integer: bool) -> None:
        tol = self.tol
        found = mismatch(a, b, rtol=tol.rtol, atol=tol.atol, equal_nan=tol.equal_nan)
        if found is None:
            return
        if found.values is not None:
            value_a, value_b = found.values
        else:
            first = found.first
            value_a, value_b = a.reshape(-1)[first].item(), b.reshape(-1)[first].item()
        flat = (as_numpy(a).reshape(-1), as_numpy(b).reshape(-1))
        self.add(
            numeric_difference(
                path,
                found,
                tuple(a.shape),
                a.numel(),
                value_a,
                value_b,
                integer=integer,
                rows_of=(*flat, tol, self.parents),
            )
        )


_KINDS: dict[type, str | None] = {
    dict: "mapping",
    list: "sequence",
    tuple: "sequence",
    str: None,
    bytes: None,
    bool: None,
    type(None): None,
}


def _kind(value: Any) -> str | None:
    """How a container is walked: ``mapping``, ``sequence``, ``batch``, ``record``, or
    ``None`` for a plain value (compared with ``==``)."""
    kind = type(value)
    if kind in _KINDS:  # the common types, without isinstance
        return _KINDS[kind]
    if isinstance(value, (str, bytes, bool, type(None))):
        return None
    if is_mapping(value):
        return "mapping"
    if isinstance(value, (list, tuple)) or (
        isinstance(value, np.ndarray) and value.dtype.kind == "O" and value.ndim == 1
    ):
        return "sequence"
    if batch_like(value):
        return "batch"
    if record_fields(value) is not None:
        return "record"
    return None


def _drop_defaults(record: Any, fields: dict[str, Any], other: dict[str, Any]) -> None:
    """Leave out the fields of dataclass *record* that the other record lacks and that hold
    their default (a field one class added later is no difference while it is unused)."""
    if not dataclasses.is_dataclass(record):
        return
    for f in dataclasses.fields(record):
        if f.name in other or f.name not in fields:
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        try:
            unused = type(fields[f.name]) is type(default) and bool(fields[f.name] == default)
        except Exception:  # == without a truth value: the field counts
            unused = False
        if unused:
            del fields[f.name]


def _plain(values: list[Any]) -> bool:
    return all(type(v) in _ATOMS for v in values)


def numeric_difference(
    path: str,
    found: Mismatch,
    shape: tuple[int, ...],
    numel: int,
    value_a: Any,
    value_b: Any,
    *,
    integer: bool = False,
    rows_of: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], Tolerance, Sequence[Any]]
    | None = None,
) -> Difference:
    """The :class:`Difference` of two tensors (or arrays) of *shape* that *found* says differ,
    *value_a* and *value_b* the elements at its first index; *integer*: integer or boolean
    elements (token ids, counts), reported by count and first position only (a relative
    difference of ids means nothing); *rows_of*: ``(flat a, flat b, tolerance, the containers
    around them)``, to name the differing rows and their ids."""
    max_abs, max_rel = (None, None) if integer else (found.max_abs, found.max_rel)
    detail = f"{found.mismatched} of {numel} elements differ"
    if max_abs is not None:
        detail += f" (max abs {max_abs:.6g}"
        detail += f", max rel {max_rel:.6g})" if max_rel is not None else ")"
    index = _unravel(found.first, shape)
    a, b = _abbrev(value_a), _abbrev(value_b)
    rows, column, ids = _rows(found, shape, rows_of) if rows_of else (None, None, None)
    # Positional, in field order: keywords double a frozen dataclass's construction.
    return Difference(
        path, "value", detail, max_abs, max_rel, index, found.mismatched, numel, a, b,
        rows, column, ids,
    )  # fmt: skip


def _rows(
    found: Mismatch,
    shape: tuple[int, ...],
    rows_of: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], Tolerance, Sequence[Any]],
) -> tuple[tuple[int, ...] | None, str | None, tuple[str, ...] | None]:
    x, y, tol, parents = rows_of
    rows = differing_rows(
        x,
        y,
        shape,
        rtol=tol.rtol,
        atol=tol.atol,
        equal_nan=tol.equal_nan,
        first=found.first,
        mismatched=found.mismatched,
    )
    column, ids = row_ids(parents, rows, shape[0]) if rows else (None, None)
    return rows, column, ids


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


def _isnan(value: complex) -> bool:
    return math.isnan(value.real) or math.isnan(value.imag)


def _type_name(value: Any) -> str:
    return type(value).__name__
