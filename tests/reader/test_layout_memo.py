"""The archive parse's memo: an archive equal to a parsed one in every byte the parse read
takes its result, and never a result a fresh parse would not give."""

from __future__ import annotations

import random
import struct
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from _support.memo import emptied, inputs_checked
from reader.test_fast_load import archived, saved
from trajtrack.reader import _torch_archive
from trajtrack.reader._fast_load import DECLINED, fast_load
from trajtrack.reader._torch_archive import Declined, archive_records

_RECORDS = _torch_archive._records  # the parse itself, whatever a test puts in its place


@pytest.fixture(autouse=True)
def empty_memo() -> Iterator[None]:
    with emptied(_torch_archive._LAYOUTS):
        yield


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """The archives parsed record by record (not answered from the memo)."""
    return inputs_checked(monkeypatch, _torch_archive, "_records")


def fresh(data: bytes) -> Any:
    """The parse itself, remembering nothing (the reference)."""
    try:
        records, limit = _RECORDS(data, None)
        prefix = next(iter(records)).partition("/")[0] + "/"
        _torch_archive._check_records(data, records, prefix, limit, None)
    except Declined:
        return "declined"
    except (ValueError, IndexError, struct.error, UnicodeDecodeError):
        return "error"
    return records, prefix, limit


def verdict(data: bytes) -> Any:
    try:
        return archive_records(data)
    except Declined:
        return "declined"
    except (ValueError, IndexError, struct.error, UnicodeDecodeError):
        return "error"


def sample(index: int, writer: Any = saved) -> bytes:
    return writer({"index": index, "values": torch.arange(1000, dtype=torch.float32) + index})


def test_archives_that_differ_in_their_data_share_one_parse(parses: list[bytes]) -> None:
    first, second = sample(1), sample(2)
    assert len(first) == len(second) and first != second
    assert verdict(first) == verdict(second) == fresh(second)
    assert parses == [first]
    assert fast_load(second)["index"] == 2  # the loader on the remembered layout


def test_the_serialization_id_is_checked_at_every_match(parses: list[bytes]) -> None:
    first = sample(1)
    records, prefix, limit = verdict(first)
    local, size = records[prefix + ".data/serialization_id"]
    start = _torch_archive.member_start(first, local, size, limit)
    bad = bytearray(first)
    bad[start] = ord("x")  # no longer all digits
    assert verdict(bytes(bad)) == fresh(bytes(bad)) == "declined"
    assert fast_load(bytes(bad)) is DECLINED
    assert len(parses) == 1  # matched, and refused at the match


def test_an_archive_of_another_layout_is_parsed(parses: list[bytes]) -> None:
    small, large = sample(1), saved({"index": 1, "values": torch.zeros(3000)})
    verdict(small)
    assert verdict(large) == fresh(large)
    assert parses == [small, large]


@pytest.mark.parametrize("writer", [saved, archived], ids=["torch.save", "archive writer"])
def test_every_byte_changed_gets_what_a_fresh_parse_gives(writer: Any) -> None:
    # Each byte of the archive in turn, remembered first: a byte the parse read must make it
    # parse again (or decline as it would), a byte it did not read may be matched.
    original = sample(3, writer)
    verdict(original)
    for at in range(len(original)):
        damaged = bytearray(original)
        damaged[at] ^= 0x5A
        assert verdict(bytes(damaged)) == fresh(bytes(damaged)), at
        _torch_archive._LAYOUTS.clear()  # the next byte against the original alone
        verdict(original)


@pytest.mark.parametrize("seed", range(3))
def test_damaged_archives_get_what_a_fresh_parse_gives(seed: int) -> None:
    rng = random.Random(seed)
    archives = [sample(1), sample(2, archived), saved([torch.ones(2), torch.zeros(3, 4)])]
    for data in archives:
        verdict(data)  # remembered: the damaged copies below are matched against them
    for _ in range(1_500):
        damaged = bytearray(rng.choice(archives))
        for _ in range(rng.randint(1, 3)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        assert verdict(bytes(damaged)) == fresh(bytes(damaged))


def test_the_memo_is_bounded(parses: list[bytes]) -> None:
    archives = [saved(torch.zeros(n)) for n in range(1, 81)]  # 80 layouts
    for data in archives:
        verdict(data)
    assert _torch_archive._LAYOUTS.full
    verdict(archives[-1])  # beyond the bound: not remembered, parsed again
    verdict(archives[0])  # among the first: answered from the memo
    assert parses[-1] is archives[-1] and len(parses) == len(archives) + 1
