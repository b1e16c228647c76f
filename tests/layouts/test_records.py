"""Record segments: lines in columns (version 2) and a line per dump (version 1), both read;
one JSON call for a well-formed segment, line by line otherwise; damaged lines counted."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trajtrack.layouts.records import DumpRecord, decode_segment, encode_segment


def _records(n: int, *, writer: str = "w") -> list[DumpRecord]:
    return [
        DumpRecord(f"s{i}", f"s{i}.pth", i, "crc32:00000000", "h", 1, 0, writer, 1.0 + i)
        for i in range(n)
    ]


def _members(n: int) -> list[DumpRecord]:
    shards = [".trajtrack/shards/w-000000.tar", ".trajtrack/shards/w-000001.tar"]
    return [
        DumpRecord(
            f"m{i}", f"m{i}.pth", 100 + i, f"crc32:{i:08x}", "h", 1, 0, "w", 2.5 + i,
            shard=shards[i % 2], offset=512 * (i + 1),
        )
        for i in range(n)
    ]  # fmt: skip


def _v1(records: list[DumpRecord]) -> bytes:
    """A segment as version-1 writers wrote it: a JSON object per dump."""
    return "".join(json.dumps(r.to_json()) + "\n" for r in records).encode()


def _lines(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.splitlines()]


def test_a_segment_decodes_to_the_records_encoded() -> None:
    records = _records(5) + _members(6) + _records(2, writer="other")
    data = encode_segment(records)
    assert decode_segment(data) == (records, 0)
    # In columns: one line per writer and layout, each field once per dump.
    lines = _lines(data)
    assert [line["v"] for line in lines] == [2, 2, 2]
    assert lines[1]["shards"] == [f".trajtrack/shards/w-00000{i}.tar" for i in (0, 1)]
    assert lines[1]["shard"] == [0, 1, 0, 1, 0, 1]
    assert lines[0]["name"] == [f"s{i}" for i in range(5)] and lines[2]["writer"] == "other"


def test_version_1_lines_are_still_read_also_next_to_columns() -> None:
    old, new = _records(3), _members(2)
    assert decode_segment(_v1(old)) == (old, 0)
    assert decode_segment(_v1(old) + encode_segment(new)) == (old + new, 0)


def test_a_member_without_offset_is_written_on_a_line_of_its_own() -> None:
    odd = DumpRecord("x", "x.pth", 1, "crc32:00000000", "h", 1, 0, "w", 1.0, shard="s.tar")
    records = [*_records(2), odd, *_records(1)]
    data = encode_segment(records)
    assert [line["v"] for line in _lines(data)] == [2, 1, 2]
    assert decode_segment(data) == (records, 0)


_GOOD = _lines(encode_segment(_members(3)))[0]


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("name", "m0"),  # not a list
        ("name", ["m0", "m1"]),  # one entry short
        ("path", ["m0.pth", 5, "m2.pth"]),
        ("path", ["m0.pth", "m1.pth"]),  # a column one entry short
        ("size", [1, 2, 3, 4]),
        ("size", [1, True, 3]),  # a bool is not a size
        ("size", [1, 2.0, 3]),
        ("checksum", [None, "crc32:0", "crc32:0"]),
        ("time", [1.0, "2", 3.0]),
        ("pid", "1"),
        ("rank", None),
        ("host", 3),
        ("writer", ["w"]),
        ("shards", [".trajtrack/shards/w-000000.tar", 7]),
        ("shard", [0, 1, 2]),  # an index past the shards
        ("shard", [0, -1, 0]),
        ("shard", [0, 1]),
        ("offset", [512, None, 1536]),
        ("offset", [512, 1024]),
    ],
)
def test_a_line_in_columns_that_is_not_exactly_right_is_refused_whole(key: str, value: Any) -> None:
    line = {**_GOOD, key: value}
    files = _records(2)
    data = encode_segment(files) + json.dumps(line).encode() + b"\n"
    assert decode_segment(data) == (files, 1)


def test_a_member_line_without_its_shards_is_refused() -> None:
    line = {k: v for k, v in _GOOD.items() if k != "shards"}
    assert decode_segment(json.dumps(line).encode()) == ([], 1)


def test_whole_seconds_written_as_integers_are_times() -> None:
    line = {**_GOOD, "time": [1, 2.5, 3]}
    records, bad = decode_segment(json.dumps(line).encode())
    assert bad == 0 and [r.time for r in records] == [1.0, 2.5, 3.0]
    assert all(type(r.time) is float for r in records)


@pytest.mark.parametrize(
    "bad",
    [
        b"not json",
        b'{"name": "x"}',  # an object, but not a record
        b"{},{}",  # two objects on one line
        b"[1, 2]",
        b'{"name": ',  # cut short by a crash
        b'{"v": 2, "name": ',
    ],
)
def test_unreadable_lines_are_counted_and_the_rest_kept(bad: bytes) -> None:
    records = _records(4)
    lines = _v1(records).splitlines(keepends=True)
    data = b"".join([*lines[:2], bad + b"\n", *lines[2:]])
    assert decode_segment(data) == (records, 1)
    data = encode_segment(records[:2]) + bad + b"\n" + encode_segment(records[2:])
    assert decode_segment(data) == (records, 1)


def test_an_object_split_over_two_lines_is_not_joined_back() -> None:
    # Each line alone is unreadable; joined into one array they would parse as one object
    # and an empty one: the segment is read line by line, as it always was.
    records = _records(2)
    good = encode_segment(records)
    data = good + b'{"a": [{}\n{}]}\n{}\n'
    assert decode_segment(data) == (records, 3)


_V1_HOSTILE = {
    "size_1e999": '"size": 1e999',
    "size_infinity": '"size": Infinity',
    "size_400_digits": '"size": ' + "9" * 400,
    "negative_400_digits": '"pid": -' + "9" * 400,
    "offset_2_63": '"shard": ".trajtrack/shards/w-000000.tar", "offset": 9223372036854775808',
    "time_1e20": '"time": 1e20',
    "time_nan": '"time": NaN',
    "time_400_digits": '"time": ' + "9" * 400,
    "nested": '"host": ' + "[" * 100_000 + "]" * 100_000,
}


@pytest.mark.parametrize("value", list(_V1_HOSTILE.values()), ids=list(_V1_HOSTILE))
def test_a_v1_line_with_a_value_out_of_range_is_counted_and_skipped(value: str) -> None:
    records = _records(2)
    base = {k: v for k, v in records[0].to_json().items() if k not in value.split('"')[1::4]}
    hostile = json.dumps(base)[:-1] + ", " + value + "}"
    data = _v1(records[:1]) + hostile.encode() + b"\n" + _v1(records[1:])
    assert decode_segment(data) == (records, 1)


_V2_HOSTILE: dict[str, tuple[str, Any]] = {
    "size_400_digits": ("size", [1, 10**399]),
    "size_2_63": ("size", [1, 1 << 63]),
    "size_below_minus_2_63": ("size", [1, -(1 << 63)]),
    "time_400_digits": ("time", [1.0, 10**399]),
    "time_1e20": ("time", [1.0, 1e20]),
    "time_infinity": ("time", [1.0, float("inf")]),
    "time_nan": ("time", [1.0, float("nan")]),
    "offset_2_63": ("offset", [512, 1 << 63]),
    "pid_400_digits": ("pid", 10**399),
    "rank_2_63": ("rank", 1 << 63),
}


@pytest.mark.parametrize("key_value", list(_V2_HOSTILE.values()), ids=list(_V2_HOSTILE))
def test_a_v2_column_with_a_value_out_of_range_is_counted_and_skipped(
    key_value: tuple[str, Any],
) -> None:
    key, value = key_value
    line = {**json.loads(encode_segment(_members(2))), key: value}
    files = _records(2)
    data = encode_segment(files) + json.dumps(line).encode() + b"\n"
    assert decode_segment(data) == (files, 1)


def test_a_deeply_nested_line_among_good_lines_is_counted_and_skipped() -> None:
    # One JSON array of every line would raise RecursionError, as the nested line alone.
    records = _records(2)
    nested = b'{"v": 2, "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    assert decode_segment(encode_segment(records) + nested) == (records, 1)


def test_the_largest_values_in_range_are_kept() -> None:
    record = DumpRecord("s", "s.pth", (1 << 63) - 1, "crc32:00000000", "h", 1, 0, "w", 9.9e10)
    assert decode_segment(encode_segment([record])) == ([record], 0)
    assert decode_segment(_v1([record])) == ([record], 0)
