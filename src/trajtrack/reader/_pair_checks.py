"""Comparing a pair of dumps, once their bytes are read: the per-pair work of ``diff``.

* :func:`compare_read` -- a batch of small pairs, their bytes read (``Run.read_many``): the
  hot path of a diff of many small dumps, written as one loop. A byte-identical pair needs no
  loading, only the refusal a load would give (:func:`check_loadable`; nearly always answered
  by the fast loader's remembered scan, :func:`only_default_globals`, in about a microsecond);
* :func:`load_and_compare` -- one pair from its bytes: two archives of the same pickle
  compared without loading (:mod:`trajtrack.reader._archive_diff`), others loaded;
* :func:`compare_files` -- one pair of local files, compared in place, loaded by torch itself.

Byte-identical pairs are equal without loading only when NaN equals NaN (the default): with
``equal_nan=False`` a NaN in both makes identical bytes different. Such a pair is equal even
when its content would be refused as unsafe: nothing of it is loaded, and the refusal becomes a
note, not an error (the comparison of bytes does not need it). So is a pair whose load is
refused when the two ``torch.save`` archives are equal apart from torch's per-save
``.data/serialization_id`` record (:mod:`trajtrack.reader._same_archive`; a pair that loads is
compared as loaded, where that record plays no part: no extra work on the common path).

A pair compared with ``ignore`` patterns is always loaded and walked (the archive route has
no key paths for what it skips).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from trajtrack._exceptions import TrajtrackError, UnsafeLoadError
from trajtrack.reader._archive_diff import compare_archives
from trajtrack.reader._compare import Differences, Tolerance, compare
from trajtrack.reader._diff_result import DumpComparison, Pair, compared, failed
from trajtrack.reader._fast_load import only_default_globals
from trajtrack.reader._files import LocalFile, inside_run, same_contents
from trajtrack.reader._safe_load import check_loadable, load_dump_bytes, load_dump_file
from trajtrack.reader._same_archive import same_apart_from_serialization_id

__all__ = [
    "compare_files",
    "compare_loaded",
    "compare_read",
    "compare_unloaded",
    "load_and_compare",
]


def compare_read(
    batch: Sequence[Pair],
    data_a: Sequence[bytes | Exception],
    data_b: Sequence[bytes | Exception],
    tol: Tolerance,
    unsafe: bool,
    limit: int,
    ignore: tuple[str, ...] = (),
) -> list[DumpComparison]:
    """The comparison of each pair of *batch*, from its dumps' bytes (or the error reading
    them raised) in *data_a* and *data_b* (blocking)."""
    found = compare_unloaded(batch, data_a, data_b, tol, unsafe)
    return [
        done if done is not None else compare_loaded(pair, x, y, tol, unsafe, limit, ignore)
        for pair, x, y, done in zip(batch, data_a, data_b, found, strict=True)
    ]


def compare_unloaded(
    batch: Sequence[Pair],
    data_a: Sequence[bytes | Exception],
    data_b: Sequence[bytes | Exception],
    tol: Tolerance,
    unsafe: bool,
) -> list[DumpComparison | None]:
    """The comparison of each pair of *batch* that needs no loading (byte-identical, or not
    read), ``None`` for the others: :func:`compare_loaded` them. Nothing here runs torch's
    tensor code (blocking)."""
    results: list[DumpComparison | None] = []
    append = results.append
    identical_equal = tol.equal_nan
    for pair, x, y in zip(batch, data_a, data_b, strict=True):
        try:
            if isinstance(x, Exception):
                raise x
            if isinstance(y, Exception):
                raise y
            if not (identical_equal and x == y):
                append(None)
                continue
            # Written out: most pairs of a rerun are this one.
            notes = () if unsafe or only_default_globals(x) else _not_loaded(x, f"A:{pair[0]}")
        except (TrajtrackError, OSError) as exc:
            append(failed(pair, exc))
            continue
        name, a, b, order = pair
        append(DumpComparison(name, "equal", a, b, (), None, order, notes))
    return results


def compare_loaded(
    pair: Pair,
    x: bytes | Exception,
    y: bytes | Exception,
    tol: Tolerance,
    unsafe: bool,
    limit: int,
    ignore: tuple[str, ...] = (),
) -> DumpComparison:
    """The comparison of a pair :func:`compare_unloaded` left: both loaded and compared."""
    try:
        return compared(pair, load_and_compare(x, y, pair[0], tol, unsafe, limit, ignore))  # type: ignore[arg-type]
    except (TrajtrackError, OSError) as exc:
        return failed(pair, exc)


def load_and_compare(
    data_a: bytes,
    data_b: bytes,
    name: str,
    tol: Tolerance,
    unsafe: bool,
    limit: int,
    ignore: tuple[str, ...] = (),
) -> Differences:
    """The differences between two dumps' bytes (none: equal)."""
    if tol.equal_nan and data_a == data_b:  # same bytes, same object: nothing to compare
        return _unloaded(data_a, unsafe, f"A:{name}")
    if not (unsafe or ignore):  # the same structure, other numbers: compared without loading
        found = compare_archives(data_a, data_b, tol, limit)
        if found is not None:
            return Differences(found)
    loaded = _load_pair(load_dump_bytes, data_a, data_b, name, tol, unsafe)
    if isinstance(loaded, Differences):
        return loaded
    return compare(*loaded, tol, limit=limit, ignore=ignore)


def compare_files(
    file_a: LocalFile,
    file_b: LocalFile,
    name: str,
    tol: Tolerance,
    unsafe: bool,
    limit: int,
    ignore: tuple[str, ...] = (),
) -> Differences:
    """:func:`load_and_compare` for two local files: compared, then loaded by torch itself."""
    path_a, path_b = inside_run(file_a, f"A:{name}"), inside_run(file_b, f"B:{name}")
    if tol.equal_nan and same_contents(path_a, path_b):
        return _unloaded(path_a, unsafe, f"A:{name}")
    loaded = _load_pair(load_dump_file, path_a, path_b, name, tol, unsafe)
    if isinstance(loaded, Differences):
        return loaded
    return compare(*loaded, tol, limit=limit, ignore=ignore)


def _load_pair(
    load: Callable[..., Any], a: Any, b: Any, name: str, tol: Tolerance, unsafe: bool
) -> tuple[Any, Any] | Differences:
    """Both dumps loaded, or, when a load is refused and the two archives are equal apart
    from torch's per-save id, the pair's (equal) answer without loading."""
    try:
        return load(a, unsafe=unsafe, where=f"A:{name}"), load(b, unsafe=unsafe, where=f"B:{name}")
    except UnsafeLoadError:
        if tol.equal_nan and same_apart_from_serialization_id(a, b):
            return _unloaded(a, unsafe, f"A:{name}", _SAME_BUT_ID)
        raise


_SAME_BUT_ID = "the archives are equal apart from torch's per-save serialization id"


def _unloaded(source: bytes | str, unsafe: bool, where: str, *notes: str) -> Differences:
    """Equal without loading: no differences, with *notes* and, for a dump a safe load would
    refuse, why it was not loaded."""
    equal = Differences()
    equal.notes = notes if unsafe else notes + _not_loaded(source, where)
    return equal


def _not_loaded(source: bytes | str | os.PathLike[str], where: str) -> tuple[str, ...]:
    """``()`` for a dump a safe load accepts, else a note of why it was compared unloaded
    (a static scan of its pickle: nothing is loaded)."""
    try:
        check_loadable(source, where=where)
    except UnsafeLoadError as exc:
        return (f"equal bytes, compared without loading (a safe load refuses it: {exc})",)
    return ()
