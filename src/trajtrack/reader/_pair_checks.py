"""Comparing a pair of dumps, once their bytes are read: the per-pair work of ``diff``.

* :func:`compare_read` -- a batch of small pairs, their bytes read (``Run.read_many``): the
  hot path of a diff of many small dumps, written as one loop. A byte-identical pair needs no
  loading, only the refusal a load would give (:func:`check_loadable`; nearly always answered
  by the fast loader's remembered scan, :func:`only_default_globals`, in about a microsecond);
* :func:`load_and_compare` -- one pair from its bytes: two archives of the same pickle
  compared without loading (:mod:`trajtrack.reader._archive_diff`), others loaded;
* :func:`compare_files` -- one pair of local files, compared in place, loaded by torch itself.

Byte-identical pairs are equal without loading only when NaN equals NaN (the default): with
``equal_nan=False`` a NaN in both makes identical bytes different.
"""

from __future__ import annotations

from collections.abc import Sequence

from trajtrack._exceptions import TrajtrackError
from trajtrack.reader._archive_diff import compare_archives
from trajtrack.reader._compare import Difference, Tolerance, compare
from trajtrack.reader._diff_result import DumpComparison, Pair, compared, failed
from trajtrack.reader._fast_load import only_default_globals
from trajtrack.reader._files import LocalFile, inside_run, same_contents
from trajtrack.reader._safe_load import check_loadable, load_dump_bytes, load_dump_file

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
) -> list[DumpComparison]:
    """The comparison of each pair of *batch*, from its dumps' bytes (or the error reading
    them raised) in *data_a* and *data_b* (blocking)."""
    found = compare_unloaded(batch, data_a, data_b, tol, unsafe)
    return [
        done if done is not None else compare_loaded(pair, x, y, tol, unsafe, limit)
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
            if not (unsafe or only_default_globals(x)):
                check_loadable(x, where=f"A:{pair[0]}")
        except (TrajtrackError, OSError) as exc:
            append(failed(pair, exc))
            continue
        name, a, b, order = pair
        append(DumpComparison(name, "equal", a, b, (), None, order))
    return results


def compare_loaded(
    pair: Pair, x: bytes | Exception, y: bytes | Exception, tol: Tolerance, unsafe: bool, limit: int
) -> DumpComparison:
    """The comparison of a pair :func:`compare_unloaded` left: both loaded and compared."""
    try:
        return compared(pair, load_and_compare(x, y, pair[0], tol, unsafe, limit))  # type: ignore[arg-type]
    except (TrajtrackError, OSError) as exc:
        return failed(pair, exc)


def load_and_compare(
    data_a: bytes, data_b: bytes, name: str, tol: Tolerance, unsafe: bool, limit: int
) -> list[Difference]:
    """The differences between two dumps' bytes (none: equal)."""
    if tol.equal_nan and data_a == data_b:
        # Same bytes, same object: nothing to compare, but a dump the loader would refuse is
        # refused here too (a static scan of its pickle; the tensors are not loaded).
        check_loadable(data_a, unsafe=unsafe, where=f"A:{name}")
        return []
    if not unsafe:  # the same structure, other numbers: compared without loading
        found = compare_archives(data_a, data_b, tol, limit)
        if found is not None:
            return found
    obj_a = load_dump_bytes(data_a, unsafe=unsafe, where=f"A:{name}")
    obj_b = load_dump_bytes(data_b, unsafe=unsafe, where=f"B:{name}")
    return compare(obj_a, obj_b, tol, limit=limit)


def compare_files(
    file_a: LocalFile, file_b: LocalFile, name: str, tol: Tolerance, unsafe: bool, limit: int
) -> list[Difference]:
    """:func:`load_and_compare` for two local files: compared, then loaded by torch itself."""
    path_a, path_b = inside_run(file_a, f"A:{name}"), inside_run(file_b, f"B:{name}")
    if tol.equal_nan and same_contents(path_a, path_b):
        check_loadable(path_a, unsafe=unsafe, where=f"A:{name}")
        return []
    obj_a = load_dump_file(path_a, unsafe=unsafe, where=f"A:{name}")
    obj_b = load_dump_file(path_b, unsafe=unsafe, where=f"B:{name}")
    found: list[Difference] = compare(obj_a, obj_b, tol, limit=limit)
    return found
