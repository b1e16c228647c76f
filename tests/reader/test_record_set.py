"""The recorded dumps built a column at a time give exactly what the record-by-record way
gives, problems included (which the column way leaves to the record-by-record way)."""

from __future__ import annotations

import dataclasses
import json
import random
from typing import Any

import pytest

from trajtrack.backends import FileInfo
from trajtrack.layouts.records import DumpRecord, decode_segment_parts, encode_segment
from trajtrack.reader import _record_set
from trajtrack.reader._record_set import RecordSet

SHARDS = [".trajtrack/shards/w-000000.tar", ".trajtrack/shards/w-000001.tar"]


def _records(sharded: bool, count: int = 12) -> list[DumpRecord]:
    records = []
    for i in range(count):
        shard = SHARDS[i % 2] if sharded else None
        offset = 512 + 1024 * (i // 2) if sharded else None
        records.append(
            DumpRecord(
                f"s/{i}", f"s/{i}.pth", 100 + i, f"crc32:{i:08x}", "h", 7, 1, "w", 5.0 + i,
                shard=shard, offset=offset,
            )
        )  # fmt: skip
    return records


def _storage(records: list[DumpRecord]) -> tuple[dict[str, FileInfo], dict[str, FileInfo]]:
    listed = {r.path: FileInfo(r.path, r.size, 1.0) for r in records if r.shard is None}
    shards = {shard: FileInfo(shard, 1 << 20, 1.0) for shard in SHARDS}
    return listed, shards


def _both_ways(
    data: bytes, listed: dict[str, FileInfo], shards: dict[str, FileInfo]
) -> tuple[list[Any], list[Any]]:
    parts, bad = decode_segment_parts(data)
    assert bad == 0
    record = RecordSet(parts, bad)
    by_columns = record.dumps(listed, shards)
    by_records = _record_set._from_records(record.latest().values(), listed, shards)
    return sorted(by_columns), sorted(by_records)


KINDS = [
    "path", "size", "missing file", "outside file", "offset", "missing shard", "outside shard",
    "not a shard", "short shard", "nothing",
]  # fmt: skip


def _damage(
    rng: random.Random,
    line: dict[str, Any],
    listed: dict[str, FileInfo],
    shards: dict[str, Any],
    kind: str | None = None,
) -> str:
    i = rng.randrange(len(line["name"]))
    kind = kind or rng.choice(KINDS)
    path = line["path"][i]
    if kind == "path":
        line["path"][i] = rng.choice(["../x.pth", "a//b.pth", ".hidden.pth", "é.pth", "x" * 300])
    elif kind == "size":
        line["size"][i] = -1
    elif kind == "missing file":
        listed.pop(path, None)
    elif kind == "outside file" and path in listed:
        listed[path] = listed[path]._replace(outside=True)
    elif kind == "offset" and "offset" in line:
        line["offset"][i] = -5
    elif kind == "missing shard":
        shards.pop(rng.choice(SHARDS), None)
    elif kind == "outside shard" and SHARDS[0] in shards:
        shards[SHARDS[0]] = shards[SHARDS[0]]._replace(outside=True)
    elif kind == "not a shard" and "shards" in line:
        line["shards"][0] = rng.choice(["../s.tar", ".trajtrack/other/s.tar", "s.tar"])
    elif kind == "short shard" and SHARDS[1] in shards:
        shards[SHARDS[1]] = shards[SHARDS[1]]._replace(size=rng.randrange(0, 8000))
    return kind


@pytest.mark.parametrize("sharded", [False, True], ids=["files", "shards"])
def test_an_intact_record_is_built_a_column_at_a_time(
    sharded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    records = _records(sharded)
    listed, shards = _storage(records)
    slow: list[int] = []
    real = _record_set._from_records

    def counted(*args: Any) -> Any:
        slow.append(1)
        return real(*args)

    monkeypatch.setattr(_record_set, "_from_records", counted)
    record = RecordSet(*decode_segment_parts(encode_segment(records)))
    dumps = record.dumps(listed, shards)
    assert slow == []  # no record-by-record way
    assert [d.name for d in dumps] == [r.name for r in records]
    assert all(d.problem is None and d.stored_size == d.size and d.recorded for d in dumps)
    assert [(d.shard, d.offset) for d in dumps] == [(r.shard, r.offset) for r in records]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("sharded", [False, True], ids=["files", "shards"])
def test_each_damage_alone_gives_what_the_record_by_record_way_gives(
    kind: str, sharded: bool
) -> None:
    for seed in range(5):
        records = _records(sharded)
        listed, shards = _storage(records)
        line = json.loads(encode_segment(records))
        _damage(random.Random(seed), line, listed, shards, kind)
        columns, one_by_one = _both_ways(json.dumps(line).encode(), listed, shards)
        assert columns == one_by_one


@pytest.mark.parametrize("seed", range(40))
def test_damaged_records_and_storages_give_what_the_record_by_record_way_gives(
    seed: int,
) -> None:
    rng = random.Random(seed)
    sharded = seed % 2 == 1
    records = _records(sharded)
    listed, shards = _storage(records)
    line = json.loads(encode_segment(records))
    kinds = [_damage(rng, line, listed, shards) for _ in range(rng.randint(1, 3))]
    columns, one_by_one = _both_ways(json.dumps(line).encode(), listed, shards)
    assert columns == one_by_one, kinds


def test_a_path_recorded_twice_keeps_the_newest_record() -> None:
    first, second = _records(False, 3), _records(False, 3)
    second = [dataclasses.replace(r, time=r.time + 100, size=1) for r in second]
    listed, shards = _storage(first)
    record = RecordSet(*decode_segment_parts(encode_segment(first) + encode_segment(second)))
    assert not record.unique
    assert sorted(d.size for d in record.dumps(listed, shards)) == [1, 1, 1]
