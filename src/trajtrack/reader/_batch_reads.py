"""Reading a batch of dumps: :func:`read_remote` (and, off a local disk,
:func:`~trajtrack.reader._local_reads.read_local`).

Shard members that lie close together in one shard (a batch in dump order: consecutive
members) are fetched with one read of the span that holds them all, then sliced: one system
call per run of members on a local disk (``pread``) instead of one per member, and one ranged
request elsewhere (WebHDFS ``OPEN`` with offset and length) instead of a round trip per member.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final, TypeVar

from trajtrack._exceptions import DumpLoadError, StorageError, StoragePermissionError
from trajtrack.backends import Storage
from trajtrack.reader._dumps import DumpInfo
from trajtrack.reader._gather import gather_bounded, group_small

__all__ = [
    "GAP_MAX",
    "SMALL_DUMP",
    "SPAN_MAX",
    "check_held",
    "check_readable",
    "dump_batches",
    "member_spans",
    "read_batches",
    "read_remote",
    "span_end",
    "whole_member",
]

_BATCH: Final = 4096  # small dumps a group (one worker-thread hop, one read_remote), up to:
_BATCH_BYTES: Final = 16 << 20
T = TypeVar("T")


def read_batches(
    items: Sequence[T],
    small: Callable[[T], bool],
    size: Callable[[T], int],
) -> list[list[T]]:
    """*items* grouped for ``Run.read_many``, in their order, each larger item alone, the
    small ones up to 4,096 and 16 MiB (by *size*) a group: the larger a group, the longer the
    spans of neighbouring shard members, the fewer requests and worker-thread hops. A remote
    store's cost is per request, so large groups matter most there; the byte cap bounds the
    memory a group holds (larger groups trade peak memory for fewer requests). Measured by
    ``benchmarks/bench_hdfs_small_reads.py`` (HDFS) and ``benchmarks/bench_small_reads.py``
    (local disk).
    """
    return group_small(items, small, _BATCH, weight=size, max_weight=_BATCH_BYTES)


SMALL_DUMP: Final = 64 << 10
"""Dumps up to this size are read (and checked) in groups: per-dump work costs less than a
worker-thread hop or a request."""


def dump_batches(dumps: Sequence[DumpInfo]) -> list[list[DumpInfo]]:
    """:func:`read_batches` of *dumps*, the small ones those of :data:`SMALL_DUMP` or less."""
    return read_batches(dumps, _is_small, _size)


def _is_small(info: DumpInfo) -> bool:
    return info.size <= SMALL_DUMP


def _size(info: DumpInfo) -> int:
    return info.size


SPAN_MAX: Final = 16 << 20  # the most read at once for a run of neighbouring members (a group)
GAP_MAX: Final = 64 << 10  # members further apart than this are read on their own


async def read_remote(
    storage: Storage, url: str, infos: Sequence[DumpInfo]
) -> list[bytes | Exception]:
    """The bytes of each dump of *infos* in *storage*, or the error that reading it raised: a
    file each with ``read``, a run of neighbouring shard members with one ``read_range``;
    up to 16 of these requests in flight (the storage bounds its connections itself)."""
    requests, wants = _plan(url, infos)
    got = await gather_bounded(
        requests, lambda request: _fetch(storage, *request), limit=_REQUESTS_IN_FLIGHT
    )
    out: list[bytes | Exception] = []
    for info, want in zip(infos, wants, strict=True):
        if isinstance(want, Exception):
            out.append(want)
            continue
        data = got[want[0]]
        if isinstance(data, Exception) or want[1] is None:  # failed, or a whole file
            out.append(data)
            continue
        try:
            out.append(whole_member(info, data[want[1] : want[1] + info.size]))
        except DumpLoadError as exc:  # its shard holds fewer bytes than the record says
            out.append(exc)
    return out


_REQUESTS_IN_FLIGHT: Final = 16
_Request = tuple[str, int, int | None]  # (path, offset, length; None: the whole file)
_Want = tuple[int, int | None] | StorageError | DumpLoadError  # (request, where its bytes
# start; None: all), or why it is refused


def _plan(url: str, infos: Sequence[DumpInfo]) -> tuple[list[_Request], list[_Want]]:
    """The requests that fetch *infos* (each span of neighbouring members once), and for each
    dump the request holding its bytes (or why it is refused)."""
    spans = member_spans(infos)
    requests: list[_Request] = []
    wants: list[_Want] = []
    span: tuple[str, int, int, int] | None = None  # the last span: shard, start, end, request
    for index, info in enumerate(infos):
        try:
            check_readable(url, info)
            check_held(info)
        except (StorageError, DumpLoadError) as exc:
            wants.append(exc)
            continue
        if info.shard is None:
            wants.append((len(requests), None))
            requests.append((info.path, 0, None))
            continue
        offset = info.offset or 0
        if index in spans:
            start, length = spans[index]
            span = (info.shard, start, start + length, len(requests))
            requests.append((info.shard, start, length))
        if span is not None and span[0] == info.shard and span[1] <= offset <= span[2] - info.size:
            wants.append((span[3], offset - span[1]))
        else:
            wants.append((len(requests), 0))
            requests.append((info.shard, offset, info.size))
    return requests, wants


async def _fetch(storage: Storage, path: str, offset: int, length: int | None) -> bytes | Exception:
    try:
        if length is None:
            return await storage.read(path)
        return await storage.read_range(path, offset, length)
    except StorageError as exc:  # the outcome of each dump it holds
        return exc


def check_readable(url: str, info: DumpInfo) -> None:
    """Refuse a dump the listing found a problem with (its path would leave the run...)."""
    if info.problem is not None:
        raise StoragePermissionError(f"{url}: refusing to read {info.name!r}: {info.problem}")


def check_held(info: DumpInfo) -> None:
    """Refuse, before reading, a shard member its shard holds fewer bytes of than the record
    says (the listing's :attr:`~DumpInfo.stored_size`): a record's size or offset (``2**40``,
    ``2**63 - 1``) never sizes a read or an allocation, only the shard's own size does.

    Raises:
        DumpLoadError: The member is truncated (or placed past its shard's end).
    """
    if info.shard is not None and info.stored_size is not None and info.stored_size < info.size:
        raise DumpLoadError(
            f"{info.name}: its shard {info.shard} holds {info.stored_size} of its "
            f"{info.size} bytes (truncated)"
        )


def whole_member(info: DumpInfo, data: bytes) -> bytes:
    """*data*, the bytes of shard member *info*, if none is missing."""
    if len(data) != info.size:
        raise DumpLoadError(
            f"{info.name}: its shard {info.shard} holds {len(data)} of its "
            f"{info.size} bytes (truncated)"
        )
    return data


def member_spans(infos: Sequence[DumpInfo]) -> dict[int, tuple[int, int]]:
    """``index -> (offset, length)`` for the first of each run of two or more consecutive
    members of one shard lying close together: one read covers them all."""
    spans: dict[int, tuple[int, int]] = {}
    index = 0
    while index < len(infos):
        first = infos[index]
        if first.shard is None or first.problem is not None or first.offset is None:
            index += 1
            continue
        end, following = span_end(infos, index)
        if following - index > 1:
            spans[index] = (first.offset, end - first.offset)
        index = following
    return spans


def span_end(infos: Sequence[DumpInfo], index: int) -> tuple[int, int]:
    """Where the span starting at shard member *index* ends, and the index past its last
    member: the run of following members of its shard that each start at most
    :data:`GAP_MAX` after the one before ends, within :data:`SPAN_MAX` of the first."""
    first = infos[index]
    start = first.offset or 0
    end = start + first.size
    following = index + 1
    while following < len(infos):
        info = infos[following]
        offset = info.offset
        if info.shard != first.shard or info.problem is not None or offset is None:
            break
        if info.stored_size is not None and info.stored_size < info.size:
            break  # truncated: refused on its own (check_held), never part of a span
        if not end <= offset <= end + GAP_MAX or offset + info.size - start > SPAN_MAX:
            break
        end = offset + info.size
        following += 1
    return end, following
