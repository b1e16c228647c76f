"""Structural comparison of dumps, and of two whole runs.

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

:func:`diff_runs` pairs two runs' dumps by name, reads them in parallel (each file once), and
returns the comparisons sorted in dump order (commit time relative to the run's first dump,
then name), so the first divergence is the first entry that is not equal.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import anyio.to_thread
import numpy as np
import torch

from trajtrack._exceptions import DumpLoadError, TrajtrackError, UnsafeLoadError
from trajtrack.reader._numeric import mismatch
from trajtrack.reader._run import DumpInfo, Run, gather_bounded
from trajtrack.reader._safe_load import check_loadable, load_dump_bytes

__all__ = [
    "Difference",
    "DumpComparison",
    "RunDiff",
    "Tolerance",
    "compare",
    "diff_runs",
]

DifferenceKind = Literal["value", "shape", "dtype", "type", "missing", "extra", "length"]
Status = Literal["equal", "different", "only_in_a", "only_in_b", "error"]

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
        keys_b = set(b.keys())

        def where(key: Any) -> str:
            return f"{path}.{key}" if attributes else f"{path}[{key!r}]"

        for key in keys_a:
            if key not in keys_b:
                self.add(Difference(where(key), "missing", "only in A", a=_abbrev(a[key])))
        set_a = set(keys_a)
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
        max_abs, max_rel, first = found.max_abs, found.max_rel, found.first
        index = tuple(int(i) for i in np.unravel_index(first, tuple(a.shape))) if a.dim() else ()
        detail = f"{found.mismatched} of {a.numel()} elements differ"
        if max_abs is not None:
            detail += f" (max abs {max_abs:.6g}"
            detail += f", max rel {max_rel:.6g})" if max_rel is not None else ")"
        self.add(
            Difference(
                path,
                "value",
                detail,
                max_abs=max_abs,
                max_rel=max_rel,
                index=index,
                mismatched=found.mismatched,
                total=a.numel(),
                a=_abbrev(a.reshape(-1)[first].item()),
                b=_abbrev(b.reshape(-1)[first].item()),
            )
        )


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


# --------------------------------------------------------------------------- two runs


@dataclass(frozen=True, slots=True)
class DumpComparison:
    """The comparison of one dump name across two runs.

    Attributes:
        name: The dump name.
        status: ``equal``, ``different``, ``only_in_a``, ``only_in_b`` or ``error``.
        a: The dump in run A (``None`` when absent).
        b: The dump in run B (``None`` when absent).
        differences: What differs (at most the per-dump limit).
        error: Why the dump could not be compared (``status == "error"``).
        order: Commit time relative to its run's first dump (dump order across both runs).
    """

    name: str
    status: Status
    a: DumpInfo | None
    b: DumpInfo | None
    differences: tuple[Difference, ...] = ()
    error: str | None = None
    order: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        return {
            "name": self.name,
            "status": self.status,
            "path_a": self.a.path if self.a else None,
            "path_b": self.b.path if self.b else None,
            "order": self.order,
            "error": self.error,
            "differences": [d.to_json() for d in self.differences],
        }


@dataclass(frozen=True, slots=True)
class RunDiff:
    """The comparison of two runs, dumps in dump order.

    Attributes:
        url_a: Run A.
        url_b: Run B.
        tolerance: The tolerance used.
        comparisons: One entry per dump name present in either run.
    """

    url_a: str
    url_b: str
    tolerance: Tolerance
    comparisons: tuple[DumpComparison, ...]

    @property
    def equal(self) -> bool:
        """True when every dump exists in both runs and is equal within tolerance."""
        return all(c.status == "equal" for c in self.comparisons)

    @property
    def exit_code(self) -> int:
        """0 equal, 1 different (or missing dumps), 2 some dump could not be compared."""
        if any(c.status == "error" for c in self.comparisons):
            return 2
        return 0 if self.equal else 1

    def counts(self) -> dict[str, int]:
        """Number of dumps per status."""
        out = dict.fromkeys(("equal", "different", "only_in_a", "only_in_b", "error"), 0)
        for c in self.comparisons:
            out[c.status] += 1
        return out

    def first_divergence(self) -> DumpComparison | None:
        """The first dump, in dump order, that is not equal."""
        return next((c for c in self.comparisons if c.status != "equal"), None)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        first = self.first_divergence()
        return {
            "a": self.url_a,
            "b": self.url_b,
            "tolerance": dataclasses.asdict(self.tolerance),
            "equal": self.equal,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "first_divergence": first.name if first else None,
            "dumps": [c.to_json() for c in self.comparisons],
        }


async def diff_runs(
    run_a: Run,
    run_b: Run,
    *,
    names: str | None = None,
    tolerance: Tolerance | None = None,
    unsafe: bool = False,
    limit_per_dump: int = 20,
    on_progress: Callable[[int, int], None] | None = None,
) -> RunDiff:
    """Compare two runs dump by dump (paired by name), reading each file once, in parallel.

    Args:
        run_a: The first run.
        run_b: The second run (the reference for relative differences).
        names: Only dump names (or paths) matching this glob.
        tolerance: Numeric tolerance and NaN policy.
        unsafe: Allow full unpickling (runs code from the dumps).
        limit_per_dump: At most this many differences per dump.
        on_progress: Called with ``(done, total)`` as pairs finish.

    Raises:
        StorageError: Listing a run failed (per-dump read failures become ``error`` entries).
    """
    tol = tolerance or Tolerance()
    listed_a, listed_b = await _list_both(run_a, run_b, names)
    dumps_a = {d.name: d for d in listed_a}
    dumps_b = {d.name: d for d in listed_b}
    start_a = _first_time(dumps_a.values())
    start_b = _first_time(dumps_b.values())

    def order(info: DumpInfo, start: float) -> float:
        return (info.time - start) if info.time is not None else math.inf

    pairs: list[tuple[str, DumpInfo | None, DumpInfo | None, float]] = []
    for name in dumps_a.keys() | dumps_b.keys():
        a, b = dumps_a.get(name), dumps_b.get(name)
        rank = order(a, start_a) if a is not None else order(b, start_b)  # type: ignore[arg-type]
        pairs.append((name, a, b, rank))
    total = len(pairs)

    async def one(pair: tuple[str, DumpInfo | None, DumpInfo | None, float]) -> DumpComparison:
        name, a, b, rank = pair
        if a is None or b is None:
            status: Status = "only_in_b" if a is None else "only_in_a"
            return DumpComparison(name, status, a, b, order=rank)
        try:
            data_a, data_b = await _read_pair(run_a, run_b, a, b)
            found = await anyio.to_thread.run_sync(
                _load_and_compare,
                data_a,
                data_b,
                name,
                tol,
                unsafe,
                limit_per_dump,
                limiter=cpu,
            )
        except (TrajtrackError, OSError) as exc:
            return DumpComparison(name, "error", a, b, error=_message(exc), order=rank)
        status = "different" if found else "equal"
        return DumpComparison(name, status, a, b, tuple(found), order=rank)

    progress = (lambda done: on_progress(done, total)) if on_progress else None
    limit = max(1, min(run_a.concurrency, run_b.concurrency))
    # Loading and comparing is CPU work: more threads than cores only contend for the GIL,
    # the caches and the cores the reads need (measured: not faster, often slower).
    cpu = anyio.CapacityLimiter(min(limit, os.cpu_count() or 1))
    results = await gather_bounded(pairs, one, limit=limit, on_done=progress)
    results.sort(key=lambda c: (c.order, c.name))
    return RunDiff(run_a.url, run_b.url, tol, tuple(results))


async def _list_both(
    run_a: Run, run_b: Run, names: str | None
) -> tuple[list[DumpInfo], list[DumpInfo]]:
    """Both listings at once; a failure raises as ``run_a.list()`` / ``run_b.list()`` would."""
    listed: dict[int, list[DumpInfo] | Exception] = {}

    async def listing(key: int, run: Run) -> None:
        try:
            listed[key] = await run.list(names)
        except Exception as exc:  # re-raised below, unwrapped, A's first
            listed[key] = exc

    async with anyio.create_task_group() as group:
        group.start_soon(listing, 0, run_a)
        group.start_soon(listing, 1, run_b)
    for key in (0, 1):
        failure = listed[key]
        if isinstance(failure, Exception):
            raise failure
    return listed[0], listed[1]  # type: ignore[return-value]  # no exceptions left


async def _read_pair(run_a: Run, run_b: Run, a: DumpInfo, b: DumpInfo) -> tuple[bytes, bytes]:
    for info in (a, b):
        if not info.present:
            raise DumpLoadError(f"{info.path} is recorded but missing from the storage")
    # One after the other: the parallelism is across pairs (a task group per pair would cost
    # more than it saves when every pair is in flight at once).
    return await run_a.read_bytes(a), await run_b.read_bytes(b)


def _load_and_compare(
    data_a: bytes, data_b: bytes, name: str, tol: Tolerance, unsafe: bool, limit: int
) -> list[Difference]:
    if tol.equal_nan and data_a == data_b:
        # Same bytes, same object: nothing to compare, but a dump the loader would refuse is
        # refused here too (a static scan of its pickle; the tensors are not loaded).
        check_loadable(data_a, unsafe=unsafe, where=f"A:{name}")
        return []
    # The objects are only compared, never written to or returned: their tensors may use the
    # read bytes' memory (no copy, no fresh pages).
    obj_a = load_dump_bytes(data_a, unsafe=unsafe, where=f"A:{name}", share_memory=True)
    obj_b = load_dump_bytes(data_b, unsafe=unsafe, where=f"B:{name}", share_memory=True)
    found: list[Difference] = compare(obj_a, obj_b, tol, limit=limit)
    return found


def _first_time(dumps: Any) -> float:
    times = [d.time for d in dumps if d.time is not None]
    return min(times) if times else 0.0


def _message(exc: BaseException) -> str:
    if isinstance(exc, UnsafeLoadError | DumpLoadError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
