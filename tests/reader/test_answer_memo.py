"""The global scan's answers remembered (``only_default_globals``) and the windows the memo
compares: an archive equal to an answered one wherever the answer read takes its answer, and
never an answer a fresh scan would not give."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from _support.memo import emptied, inputs_checked
from reader.test_fast_load import archived, saved
from trajtrack.reader import _fast_load, _torch_archive
from trajtrack.reader._fast_load import only_default_globals
from trajtrack.reader._remembered import GAP, Remembered, windows_of


@pytest.fixture(autouse=True)
def empty_memos() -> Iterator[None]:
    with emptied(_fast_load._ANSWERS), emptied(_torch_archive._SKELETONS):
        yield


@pytest.fixture
def answered(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The archives whose directory was parsed for the answer (not answered from the memo)."""
    return inputs_checked(monkeypatch, _fast_load, "archive_pickle")


def fresh(data: bytes) -> bool:
    """The answer computed from scratch, remembering nothing (the reference)."""
    try:
        start, end = _torch_archive.archive_pickle(data)
        names = _torch_archive.scan_opcodes(data[start:end], None)
    except Exception:  # every failure is a 'no': torch's own check decides then
        return False
    return _fast_load._GLOBAL_LINES.issuperset(names)


def sample(index: int, writer: Any = saved) -> bytes:
    return writer({"index": index, "values": torch.arange(1000, dtype=torch.float32) + index})


class Odd:
    """A global outside the table (module-level: picklable)."""


def test_dumps_that_differ_in_numbers_and_data_share_one_answer(answered: list[bytes]) -> None:
    first, second = sample(1), sample(2)
    assert len(first) == len(second) and first != second
    assert only_default_globals(first) and only_default_globals(second)
    assert answered == [first]


def test_a_global_outside_the_table_gets_its_own_answer(answered: list[bytes]) -> None:
    plain = saved({"a": torch.ones(3), "b": None})
    odd = bytearray(plain)
    # The same archive with a global of another name but the same length: the scan read the
    # name, so the remembered answer cannot be taken (torch must decide).
    name = b"collections\nOrderedDict\n"
    at = bytes(odd).find(name)
    if at < 0:
        pytest.skip("this torch writes no OrderedDict global for a dict")
    odd[at : at + len(name)] = b"collections\nOrderedDicx\n"
    assert only_default_globals(plain) is True
    assert only_default_globals(bytes(odd)) is False == fresh(bytes(odd))
    assert len(answered) == 2


@pytest.mark.parametrize("writer", [saved, archived], ids=["torch.save", "archive writer"])
def test_every_byte_changed_gets_what_a_fresh_scan_gives(writer: Any) -> None:
    original = sample(3, writer)
    assert only_default_globals(original)
    for at in range(len(original)):
        damaged = bytearray(original)
        damaged[at] ^= 0x5A
        assert only_default_globals(bytes(damaged)) == fresh(bytes(damaged)), at
        _fast_load._ANSWERS.clear()  # the next byte against the original alone
        _torch_archive._SKELETONS.clear()
        only_default_globals(original)


@pytest.mark.parametrize("seed", range(3))
def test_damaged_archives_get_what_a_fresh_scan_gives(seed: int) -> None:
    rng = random.Random(seed)
    archives = [sample(1), sample(2, archived), saved([torch.ones(2), torch.zeros(3, 4)])]
    for data in archives:
        only_default_globals(data)
    for _ in range(1_500):
        damaged = bytearray(rng.choice(archives))
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        assert only_default_globals(bytes(damaged)) == fresh(bytes(damaged))


def test_the_memo_is_bounded(answered: list[bytes]) -> None:
    archives = [saved(torch.zeros(n)) for n in range(1, 81)]  # 80 layouts
    for data in archives:
        only_default_globals(data)
    assert _fast_load._ANSWERS.full
    only_default_globals(archives[-1])  # beyond the bound: not remembered, answered again
    only_default_globals(archives[0])  # among the first: from the memo
    assert answered[-1] is archives[-1] and len(answered) == len(archives) + 1


# ------------------------------------------------------------------------- windows


def _kept(size: int, *read: tuple[int, int]) -> bytearray:
    kept = bytearray(size)
    for start, end in read:
        kept[start:end] = b"\xff" * (end - start)
    return kept


# Bytes read: two stretches GAP apart (one window), one more than GAP further, one at the end.
_FAR = 31 + 2 * GAP
_SIZE = _FAR + 2 * GAP
_READ = ((10, 20), (20 + GAP, 30 + GAP), (_FAR, _FAR + 10), (_SIZE - 10, _SIZE))


def test_windows_split_at_long_gaps_only() -> None:
    assert windows_of(_kept(_SIZE, *_READ)) == [
        (10, 30 + GAP),
        (_FAR, _FAR + 10),
        (_SIZE - 10, _SIZE),
    ]
    assert windows_of(_kept(50)) == []
    assert windows_of(_kept(50, (0, 50))) == [(0, 50)]


def _remembered(data: bytes) -> Remembered[str]:
    memo: Remembered[str] = Remembered()
    memo.add(data, _kept(_SIZE, *_READ), "v")
    return memo


@pytest.mark.parametrize("at", [10, 19, 25 + GAP, _FAR, _SIZE - 1])
def test_a_byte_read_in_any_window_breaks_the_match(at: int) -> None:
    data = random.Random(at).randbytes(_SIZE)
    memo = _remembered(data)
    assert memo.match(data) == "v"
    changed = bytearray(data)
    changed[at] ^= 1
    assert memo.match(bytes(changed)) is None


@pytest.mark.parametrize("at", [0, 9, 20, 40 + GAP, _SIZE - 11])
def test_a_byte_not_read_does_not(at: int) -> None:
    data = random.Random(at).randbytes(_SIZE)
    memo = _remembered(data)
    changed = bytearray(data)
    changed[at] ^= 1
    assert memo.match(bytes(changed)) == "v"
    assert memo.match(bytes(changed) + b"x") is None  # another length: never
