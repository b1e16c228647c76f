"""Record segments: one JSON call for a well-formed segment, line by line otherwise."""

from __future__ import annotations

import pytest

from trajtrack.layouts.records import DumpRecord, decode_segment, encode_segment


def _records(n: int) -> list[DumpRecord]:
    return [
        DumpRecord(f"s{i}", f"s{i}.pth", i, "crc32:00000000", "h", 1, 0, "w", 1.0 + i)
        for i in range(n)
    ]


def test_a_segment_decodes_to_the_records_encoded() -> None:
    records = _records(5)
    assert decode_segment(encode_segment(records)) == (records, 0)


@pytest.mark.parametrize(
    "bad",
    [
        b"not json",
        b'{"name": "x"}',  # an object, but not a record
        b"{},{}",  # two objects on one line
        b"[1, 2]",
        b'{"name": ',  # cut short by a crash
    ],
)
def test_unreadable_lines_are_counted_and_the_rest_kept(bad: bytes) -> None:
    records = _records(4)
    lines = encode_segment(records).splitlines(keepends=True)
    data = b"".join([*lines[:2], bad + b"\n", *lines[2:]])
    assert decode_segment(data) == (records, 1)


def test_an_object_split_over_two_lines_is_not_joined_back() -> None:
    # Each line alone is unreadable; joined into one array they would parse as one object
    # and an empty one: the segment is read line by line, as it always was.
    records = _records(2)
    good = encode_segment(records)
    data = good + b'{"a": [{}\n{}]}\n{}\n'
    assert decode_segment(data) == (records, 3)
