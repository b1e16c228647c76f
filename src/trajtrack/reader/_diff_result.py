"""What :func:`~trajtrack.reader.diff_runs` returns: a :class:`DumpComparison` per dump name
in a :class:`RunDiff`, and how a pair's outcome becomes one; :func:`record_disagreement`, the
hint on a dump that changed since it was written (``diff`` and ``show`` both give it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from trajtrack._exceptions import DumpLoadError, UnsafeLoadError
from trajtrack.backends import checksum_of
from trajtrack.reader._compare import Difference, Tolerance
from trajtrack.reader._dumps import DumpInfo

__all__ = [
    "DumpComparison",
    "Pair",
    "RunDiff",
    "Status",
    "against_record",
    "compared",
    "failed",
    "message",
    "record_disagreement",
]

Status = Literal["equal", "different", "only_in_a", "only_in_b", "error"]


class DumpComparison(NamedTuple):
    """The comparison of one dump name across two runs (an immutable named tuple: a diff
    makes one per dump name).

    Attributes:
        name: The dump name.
        status: ``equal``, ``different``, ``only_in_a``, ``only_in_b`` or ``error``.
        a: The dump in run A (``None`` when absent).
        b: The dump in run B (``None`` when absent).
        differences: What differs (at most the per-dump limit).
        error: Why the dump could not be compared (``status == "error"``).
        order: Its place in dump order across both runs (0 first; see :func:`diff_runs`).
        notes: What the comparison noted that is not a difference: containers of other types
            compared by content, a pair equal without loading (and why it was not loaded).
        ignored: The key paths left out by the ``ignore`` patterns.
    """

    name: str
    status: Status
    a: DumpInfo | None
    b: DumpInfo | None
    differences: tuple[Difference, ...] = ()
    error: str | None = None
    order: int = 0
    notes: tuple[str, ...] = ()
    ignored: tuple[str, ...] = ()

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
            "notes": list(self.notes),
            "ignored": list(self.ignored),
        }


@dataclass(frozen=True, slots=True)
class RunDiff:
    """The comparison of two runs, dumps in dump order.

    Attributes:
        url_a: Run A.
        url_b: Run B.
        tolerance: The tolerance used.
        comparisons: One entry per dump name present in either run.
        ignore: The ``ignore`` patterns the comparisons left out.
    """

    url_a: str
    url_b: str
    tolerance: Tolerance
    comparisons: tuple[DumpComparison, ...]
    ignore: tuple[str, ...] = ()

    @property
    def equal(self) -> bool:
        """True when every dump exists in both runs and is equal within tolerance; false
        when there was nothing to compare (:attr:`no_dumps`: two empty runs, a ``names``
        glob that matches nothing), which is not "the runs are equal"."""
        return bool(self.comparisons) and all(c.status == "equal" for c in self.comparisons)

    @property
    def no_dumps(self) -> bool:
        """True when neither run had a dump to compare (matching the ``names`` glob)."""
        return not self.comparisons

    @property
    def exit_code(self) -> int:
        """0 equal, 1 different (or missing dumps, or nothing compared: :attr:`no_dumps`, as
        ``trajtrack verify`` exits when it verified nothing), 2 some dump could not be
        compared."""
        if any(c.status == "error" for c in self.comparisons):
            return 2
        return 0 if self.equal else 1

    def counts(self) -> dict[str, int]:
        """Number of dumps per status."""
        out = dict.fromkeys(("equal", "different", "only_in_a", "only_in_b", "error"), 0)
        for c in self.comparisons:
            out[c.status] += 1
        return out

    @property
    def differ(self) -> bool:
        """True when some dump differs or is in one run only (dumps that could not be
        compared, alone, do not make the runs differ: they are errors)."""
        return any(c.status not in ("equal", "error") for c in self.comparisons)

    def first_divergence(self) -> DumpComparison | None:
        """The first dump, in dump order, that differs or is in one run only (never an
        error: a dump that could not be compared is not a divergence)."""
        return next((c for c in self.comparisons if c.status not in _NOT_DIVERGED), None)

    def errors(self) -> list[DumpComparison]:
        """The dumps that could not be compared, in dump order."""
        return [c for c in self.comparisons if c.status == "error"]

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable dict."""
        first = self.first_divergence()
        return {
            "a": self.url_a,
            "b": self.url_b,
            "tolerance": dataclasses.asdict(self.tolerance),
            "equal": self.equal,
            "exit_code": self.exit_code,
            "no_dumps": self.no_dumps,
            "counts": self.counts(),
            "differ": self.differ,
            "first_divergence": first.name if first else None,
            "errors": [c.name for c in self.errors()],
            "ignore": list(self.ignore),
            "dumps": [c.to_json() for c in self.comparisons],
        }


_NOT_DIVERGED = ("equal", "error")

Pair = tuple[str, DumpInfo | None, DumpInfo | None, int]
"""``(name, a, b, order)``: a dump name, its dump in each run, its place in dump order."""


def failed(pair: Pair, exc: BaseException) -> DumpComparison:
    """The comparison of a pair that could not be compared (*exc* says why)."""
    name, a, b, order = pair
    return DumpComparison(name, "error", a, b, (), message(exc), order)


def compared(pair: Pair, found: list[Difference]) -> DumpComparison:
    """The comparison of a pair whose differences are *found* (none: equal), with its notes
    and ignored paths when *found* is a :class:`~trajtrack.reader._compare.Differences`."""
    name, a, b, order = pair
    status: Status = "different" if found else "equal"
    notes = getattr(found, "notes", ())
    ignored = getattr(found, "ignored", ())
    return DumpComparison(name, status, a, b, tuple(found), None, order, notes, ignored)


def message(exc: BaseException) -> str:
    """An error's text for a report: trajtrack's own load errors as they are, others typed."""
    if isinstance(exc, UnsafeLoadError | DumpLoadError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def against_record(
    comparison: DumpComparison, stored_a: bytes | int | None, stored_b: bytes | int | None
) -> DumpComparison:
    """An ``error`` *comparison* with, first, what its dumps' stored bytes (or, for a large
    local file, their size) say against their record: a dump that changed since it was
    written is the cause worth reading, not what the loader made of its bytes. Only errors
    are looked at: no other comparison pays for a checksum.

    Args:
        comparison: A pair's comparison.
        stored_a: Run A's dump as read (bytes), its stored size, or ``None`` when unknown.
        stored_b: The same for run B.
    """
    if comparison.status != "error":
        return comparison
    found = [
        text
        for side, info, stored in (("A", comparison.a, stored_a), ("B", comparison.b, stored_b))
        if (text := record_disagreement(f"{side}:{comparison.name}", info, stored)) is not None
    ]
    if not found:
        return comparison
    return comparison._replace(error="; ".join([*found, comparison.error or ""]).rstrip("; "))


def record_disagreement(
    where: str, info: DumpInfo | None, stored: bytes | int | None
) -> str | None:
    """How the stored dump differs from its record, or ``None`` (the same, or unknown): its
    size, else its CRC-32, against the recorded ones, with the hint that it changed since it
    was written. Worth its checksum only once a dump failed to load: put first, it names the
    cause that the loader's error hides.

    Args:
        where: How the text names the dump (``A:step1/obs``).
        info: The dump as listed (``None``, or unrecorded: nothing to hold it against).
        stored: Its bytes as read, its stored size, or ``None`` (its listed size is used).
    """
    if info is None or not info.recorded:
        return None
    if stored is None:
        stored = info.stored_size  # as listed
    if stored is None:
        return None
    size = stored if isinstance(stored, int) else len(stored)
    hint = "changed since it was written (`trajtrack verify` lists such dumps)"
    if size != info.size:
        return f"{where}: {size} bytes stored, {info.size} recorded: {hint}"
    if isinstance(stored, bytes) and info.checksum is not None:
        actual = checksum_of(stored)
        if actual != info.checksum:
            return f"{where}: checksum {actual}, recorded {info.checksum}: {hint}"
    return None
