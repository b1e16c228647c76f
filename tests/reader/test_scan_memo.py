"""The opcode scan's memo: a pickle that matches a scanned one wherever the scan looked takes
its verdict, and never a verdict a fresh scan would not give."""

from __future__ import annotations

import pickle
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from _support.memo import emptied, inputs_checked
from reader.test_fast_load import saved
from trajtrack.reader import _torch_archive
from trajtrack.reader._torch_archive import Declined, archive_pickle, check_opcodes

_SCAN = _torch_archive.scan_opcodes  # the walk itself, whatever a test puts in its place


@pytest.fixture(autouse=True)
def empty_memo() -> Iterator[None]:
    with emptied(_torch_archive._SKELETONS):
        yield


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The pickles walked opcode by opcode (not answered from the memo)."""
    return inputs_checked(monkeypatch, _torch_archive, "scan_opcodes")


def pickle_of(data: bytes) -> bytes:
    start, end = archive_pickle(data)
    return data[start:end]


def sample_pickle(index: int, tag: str) -> bytes:
    return pickle_of(saved({"index": index, "tag": tag, "values": torch.ones(4) * index}))


def verdict(pickled: bytes) -> tuple[bytes, ...] | str:
    names: list[bytes] = []
    try:
        check_opcodes(pickled, names)
    except Declined:
        return "declined"
    except (ValueError, IndexError):  # what a walk over damage may raise besides Declined
        return "error"
    return tuple(names)


def fresh_verdict(pickled: bytes) -> tuple[bytes, ...] | str:
    builds: list[int] = []
    try:
        names = _SCAN(pickled, None, builds)
        return "declined" if builds else names  # check_opcodes declines a BUILD
    except Declined:
        return "declined"
    except (ValueError, IndexError):
        return "error"


def test_dumps_that_differ_in_numbers_and_strings_share_one_scan(scans: list[bytes]) -> None:
    first, second = sample_pickle(5, "abc"), sample_pickle(7, "xyz")
    assert len(first) == len(second) and first != second
    assert verdict(first) == verdict(second) == fresh_verdict(second)
    assert scans == [first]


def test_a_pickle_of_another_structure_is_scanned(scans: list[bytes]) -> None:
    first, longer = sample_pickle(5, "abc"), sample_pickle(300, "abc")  # BININT2, not BININT1
    verdict(first)
    assert verdict(longer) == fresh_verdict(longer)
    assert scans == [first, longer]


def _global_pickle(line: bytes) -> bytes:
    return pickle.PROTO + b"\x02" + pickle.GLOBAL + line + pickle.EMPTY_TUPLE + pickle.REDUCE + b"."


def test_another_global_of_the_same_length_gets_its_own_names(scans: list[bytes]) -> None:
    safe, other = (
        _global_pickle(b"collections\nOrderedDict\n"),
        _global_pickle(b"collections\nOrderedDicx\n"),
    )
    assert verdict(safe) == (b"collections\nOrderedDict\n",)
    assert verdict(other) == (b"collections\nOrderedDicx\n",)
    assert len(scans) == 2


def _memo_pickle(index: int) -> bytes:
    return (
        pickle.PROTO
        + b"\x02"
        + pickle.NONE
        + pickle.LONG_BINPUT
        + index.to_bytes(4, "little")
        + b"."
    )


def test_a_huge_memo_index_is_declined_though_a_small_one_was_scanned() -> None:
    assert verdict(_memo_pickle(3)) == ()
    assert verdict(_memo_pickle(2**31)) == "declined"


def test_a_string_length_is_part_of_the_structure() -> None:
    short = pickle.PROTO + b"\x02X\x02\x00\x00\x00ab." + b"\x00\x00"
    longer = pickle.PROTO + b"\x02X\x04\x00\x00\x00ab." + b"\x00\x00"  # the STOP is now inside
    assert len(short) == len(longer)
    assert verdict(short) == ()
    assert verdict(longer) == fresh_verdict(longer) == "declined"


@pytest.mark.parametrize("seed", range(4))
def test_damaged_pickles_get_what_a_fresh_scan_gives(seed: int) -> None:
    rng = random.Random(seed)
    pickles = [sample_pickle(i, t) for i, t in ((1, "a"), (200, "b"), (70_000, "c"))]
    for pickled in pickles:
        verdict(pickled)  # memoized: the damaged copies below are matched against it
    for _ in range(2_000):
        damaged = bytearray(rng.choice(pickles))
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        assert verdict(bytes(damaged)) == fresh_verdict(bytes(damaged)), damaged


def test_the_memo_is_bounded(scans: list[bytes]) -> None:
    pickles: list[Any] = [pickle_of(saved(list(range(n)))) for n in range(80)]
    for pickled in pickles:
        verdict(pickled)
    assert _torch_archive._SKELETONS.full
    verdict(pickles[-1])  # beyond the bound: not remembered, walked again
    verdict(pickles[0])  # among the first: answered from the memo
    assert scans[-1] is pickles[-1] and len(scans) == len(pickles) + 1


def test_no_more_than_the_bound_is_kept_when_threads_race_to_add() -> None:
    memo = _torch_archive._SKELETONS
    pickled = sample_pickle(1, "a")
    for _ in range(memo.LIMIT + 5):  # as threads that all found the memo not yet full
        memo.add(pickled, bytearray(len(pickled)), ())
    assert sum(len(entries) for entries in memo._by_length.values()) == memo.LIMIT
