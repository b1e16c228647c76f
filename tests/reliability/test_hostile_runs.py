"""Hostile runs (issue #32): FIFOs, record values out of range, sizes and offsets that would
size a read, names that would drive the terminal. Each run is built here, on a real run a
real tracker wrote, and replayed through every command: none may hang, crash with a
traceback, or read more than the run holds. ``SECURITY.md`` section 7 describes each case."""

from __future__ import annotations

import errno
import io
import json
import os
import tarfile
import threading
import zlib
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import trajtrack
from trajtrack import DumpLoadError
from trajtrack.backends.local import LocalStorage
from trajtrack.cli import main
from trajtrack.layouts.records import RECORDS_PREFIX
from trajtrack.layouts.shards import SHARDS_DIR
from trajtrack.reader import _listing, open_run

DUMPS = {f"step{i}/s": {"i": i, "x": torch.arange(5) * float(i)} for i in range(4)}
COMMANDS = ("ls", "show", "diff", "verify", "export")


def _write(dest: Path, layout: str) -> Path:
    async def go() -> None:
        async with trajtrack.Tracker(dest, layout=layout, workers=1) as tracker:  # type: ignore[arg-type]
            for name, obj in DUMPS.items():
                await (await tracker.dump(obj, name))

    anyio.run(go)
    return dest


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def _every_command(
    run: Path, other: Path, tmp_path: Path, name: str, commands: tuple[str, ...] = COMMANDS
) -> dict[str, int]:
    """The exit code of each command on *run* (``show`` of dump *name*)."""
    argv = {
        "ls": ("ls", str(run)),
        "show": ("show", str(run), name),
        "diff": ("diff", str(run), str(other)),
        "verify": ("verify", str(run)),
        "export": ("export", str(run), str(tmp_path / f"export-{run.name}")),
    }
    return {command: _cli(*argv[command])[0] for command in commands}


class _FifoWatch:
    """Watches FIFOs for a reader: a thread opens each to write without blocking, which
    succeeds only while some process has it open to read; the open is recorded, and closing
    it again gives that reader end-of-file (so a reader that blocks on a FIFO fails the test
    instead of hanging it)."""

    def __init__(self, fifos: list[Path]) -> None:
        self.opened: set[Path] = set()
        self._fifos = fifos
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            for fifo in self._fifos:
                try:
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                except OSError as exc:
                    if exc.errno not in (errno.ENXIO, errno.ENOENT):  # ENXIO: no reader
                        raise
                    continue
                self.opened.add(fifo)
                os.close(fd)

    def __enter__(self) -> _FifoWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def files_run(tmp_path: Path) -> Path:
    return _write(tmp_path / "files", "files")


@pytest.fixture
def sharded_run(tmp_path: Path) -> Path:
    return _write(tmp_path / "shards", "shards")


def _fifo_at(path: Path) -> Path:
    if path.exists():
        path.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(
    "where", ["a recorded dump", "an unrecorded dump", "a record segment", "a link to a fifo"]
)
def test_a_fifo_in_a_files_run_blocks_no_command(
    tmp_path: Path, files_run: Path, where: str
) -> None:
    other = _write(tmp_path / "other", "files")
    if where == "a recorded dump":
        fifo = _fifo_at(files_run / "step1" / "s.pth")
    elif where == "an unrecorded dump":
        fifo = _fifo_at(files_run / "planted.pth")
    elif where == "a record segment":
        fifo = _fifo_at(files_run / RECORDS_PREFIX / "evil-000000.jsonl")
    else:
        fifo = _fifo_at(files_run / "hidden" / "f")
        (files_run / "step1" / "s.pth").unlink()
        (files_run / "step1" / "s.pth").symlink_to(fifo)
    with _FifoWatch([fifo]) as watch:
        codes = _every_command(files_run, other, tmp_path, "step1/s")
    assert watch.opened == set()
    assert codes["ls"] == 0 and codes["verify"] == 1
    code, listing = _json("ls", str(files_run))
    assert code == 0
    assert any("not a regular file" in (d["problem"] or "") for d in listing["dumps"])


@pytest.mark.parametrize("where", ["its recorded shard", "an unrecorded shard"])
def test_a_fifo_in_a_sharded_run_blocks_no_command(
    tmp_path: Path, sharded_run: Path, where: str
) -> None:
    other = _write(tmp_path / "other", "files")
    if where == "its recorded shard":
        _, listing = _json("ls", str(sharded_run))
        (shard,) = [d["shard"] for d in listing["dumps"] if d["name"] == "step1/s"]
        fifo = _fifo_at(sharded_run / shard)
    else:
        fifo = _fifo_at(sharded_run / SHARDS_DIR / "evil-000000.tar")
    with _FifoWatch([fifo]) as watch:
        codes = _every_command(sharded_run, other, tmp_path, "step1/s")
    assert watch.opened == set()
    assert codes["ls"] == 0 and codes["verify"] == 1
    if where == "an unrecorded shard":  # the recorded dumps are untouched
        assert codes["show"] == 0 and codes["diff"] == 1
    _, listing = _json("ls", str(sharded_run))
    assert any("regular" in (d["problem"] or "") for d in listing["dumps"])


def _json(*argv: str) -> tuple[int, Any]:
    code, out, _ = _cli(*argv, "--json")
    return code, json.loads(out)


def _v1_line(**values: Any) -> str:
    """A version-1 record line for step1/s, its values replaced by raw JSON text."""
    fields = {
        "v": "1",
        "name": '"step1/s"',
        "path": '"step1/s.pth"',
        "size": "1",
        "checksum": '"crc32:00000000"',
        "time": "9e10",  # newer than the real record: it would win if it were read
        **values,
    }
    return "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}\n"


HOSTILE_LINES = {
    "size_1e999": _v1_line(size="1e999"),
    "size_infinity": _v1_line(size="Infinity"),
    "size_400_digits": _v1_line(size="9" * 400),
    "time_1e20": _v1_line(time="1e20"),
    "nested": _v1_line(host="[" * 100_000 + "]" * 100_000),
    "v2_size_400_digits": json.dumps(
        {"v": 2, "host": "h", "pid": 1, "rank": 0, "writer": "w", "name": ["step1/s"],
         "path": ["step1/s.pth"], "size": [10**399], "checksum": ["crc32:0"], "time": [9e10]}
    ) + "\n",
    "v2_time_1e20": json.dumps(
        {"v": 2, "host": "h", "pid": 1, "rank": 0, "writer": "w", "name": ["step1/s"],
         "path": ["step1/s.pth"], "size": [1], "checksum": ["crc32:0"], "time": [1e20]}
    ) + "\n",
}  # fmt: skip


@pytest.mark.parametrize("line", list(HOSTILE_LINES.values()), ids=list(HOSTILE_LINES))
def test_a_record_line_out_of_range_is_skipped_by_every_command(
    tmp_path: Path, files_run: Path, line: str
) -> None:
    (files_run / RECORDS_PREFIX / "evil-000000.jsonl").write_text(line)
    codes = _every_command(files_run, files_run, tmp_path, "step1/s")
    # verify fails on the unreadable line; the others read the run as its good lines say
    assert codes == {"ls": 0, "show": 0, "diff": 0, "verify": 1, "export": 0}
    _, listing = _json("ls", str(files_run))
    assert listing["bad_record_lines"] == 1
    assert [d["size"] for d in listing["dumps"]] == [
        (files_run / f"step{i}/s.pth").stat().st_size for i in range(4)
    ]
    _, report = _json("verify", str(files_run))
    assert report["bad_record_lines"] == 1 and report["counts"]["ok"] == 4


def _member_line(run: Path, **changes: int) -> str:
    """The record line of step1/s in sharded *run*, as version 1, with *changes*."""
    lines = [
        json.loads(line)
        for s in (run / RECORDS_PREFIX).glob("*.jsonl")
        for line in s.read_text().splitlines()
    ]
    columns = next(line for line in lines if "step1/s" in line["name"])
    index = columns["name"].index("step1/s")
    line = {
        "v": 1, "name": "step1/s", "path": "step1/s.pth", "size": columns["size"][index],
        "checksum": columns["checksum"][index], "time": 9e10,
        "shard": columns["shards"][columns["shard"][index]], "offset": columns["offset"][index],
        **changes,
    }  # fmt: skip
    return json.dumps(line) + "\n"


@pytest.mark.parametrize(
    "changes",
    [{"size": 1 << 40}, {"offset": 1 << 40}, {"offset": (1 << 63) - 1}, {"size": (1 << 63) - 1}],
    ids=["size_2_40", "offset_2_40", "offset_2_63", "size_2_63"],
)
def test_a_member_size_or_offset_past_its_shard_is_a_typed_error(
    tmp_path: Path, sharded_run: Path, changes: dict[str, int]
) -> None:
    (sharded_run / RECORDS_PREFIX / "evil-000000.jsonl").write_text(
        _member_line(sharded_run, **changes)
    )
    anyio.run(_reads_refuse_step1, sharded_run)
    other = _write(tmp_path / "other", "files")
    codes = _every_command(sharded_run, other, tmp_path, "step1/s", COMMANDS[:-1])
    # export: its going on past a dump it cannot read is helper "defects"' part of #32
    assert codes == {"ls": 0, "show": 2, "diff": 2, "verify": 1}


async def _reads_refuse_step1(sharded_run: Path) -> None:
    async with open_run(sharded_run) as run:
        info = await run.info("step1/s")
        assert info.stored_size is not None and info.stored_size < info.size
        with pytest.raises(DumpLoadError, match="truncated"):
            await run.read_bytes(info)
        infos = await run.list()
        got = await run.read_many(infos)  # in one span with its neighbours
    for each, data in zip(infos, got, strict=True):
        if each.name == "step1/s":
            assert isinstance(data, DumpLoadError)
        else:
            assert isinstance(data, bytes) and f"crc32:{zlib.crc32(data):08x}" == each.checksum


ESCAPES = "\x1b[2J\x1b]0;owned\x07\r\nFAKE LINE\x9b\u202e"


def test_names_and_writers_are_escaped_when_printed(tmp_path: Path, files_run: Path) -> None:
    size = (files_run / "step1" / "s.pth").stat().st_size
    line = json.loads(_v1_line(size=str(size)))
    data = (files_run / "step1" / "s.pth").read_bytes()
    line.update(
        name="evil" + ESCAPES, writer="w" + ESCAPES, checksum=f"crc32:{zlib.crc32(data):08x}"
    )
    (files_run / RECORDS_PREFIX / "evil-000000.jsonl").write_text(json.dumps(line) + "\n")
    (files_run / "step2" / "s.pth").unlink()  # a problem for verify to print
    other = _write(tmp_path / "other", "files")
    outputs = [
        _cli("ls", str(files_run)),
        _cli("show", str(files_run), "step1/s.pth"),
        _cli("diff", str(files_run), str(other)),
        _cli("verify", str(files_run)),
        _cli("show", str(files_run), "nothing" + ESCAPES),  # an error naming it
    ]
    for code, out, err in outputs:
        for text in (out, err):
            assert not any(c in text for c in "\x1b\x07\r\x9b\u202e"), (code, text)
            assert not any(line.startswith("FAKE LINE") for line in text.splitlines())
    assert "evil\\x1b[2J\\x1b]0;owned\\x07\\x0d\\x0aFAKE LINE\\x9b\\u202e" in outputs[0][1]
    assert "w\\x1b[2J" in outputs[1][1]


def _plant_shard(run: Path, tail: bytes = b"") -> Path:
    """An unrecorded shard in *run* (a crash before its record): one member, a copy of
    step1/s, written by stdlib tarfile; *tail* before the member."""
    shard = run / SHARDS_DIR / "planted-000000.tar"
    body = (run / "step1" / "s.pth").read_bytes()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        info = tarfile.TarInfo("planted/x.pth")
        info.size = len(body)
        archive.addfile(info, io.BytesIO(body))
    shard.write_bytes(tail + out.getvalue())
    return shard


def test_an_unrecorded_shard_is_indexed_from_its_headers_not_read_whole(
    files_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (files_run / SHARDS_DIR).mkdir(parents=True)
    shard = _plant_shard(files_run)
    with shard.open("r+b") as file:
        file.truncate(2 << 30)  # 2 GiB, sparse: zeros after the end blocks
    whole_reads: list[str] = []
    read = LocalStorage.read

    async def recording_read(self: LocalStorage, path: str) -> bytes:
        whole_reads.append(path)
        return await read(self, path)

    monkeypatch.setattr(LocalStorage, "read", recording_read)
    code, listing = _json("ls", str(files_run))
    assert code == 0
    (planted,) = [d for d in listing["dumps"] if d["name"] == "planted/x"]
    assert (planted["recorded"], planted["problem"]) == (False, None)
    assert not any(path.endswith(".tar") for path in whole_reads)
    code, shown = _json("show", str(files_run), "planted/x")
    assert code == 0 and shown["structure"]["children"][0]["value"] == "1"  # as in step1/s


def test_an_unrecorded_shard_with_an_oversized_pax_header_is_refused(files_run: Path) -> None:
    # CVE-2024-6232: stdlib tarfile parses a pax header of digits in quadratic time.
    (files_run / SHARDS_DIR).mkdir(parents=True)
    info = tarfile.TarInfo("././@PaxHeader")
    records = b"9" * (1 << 20)
    info.type, info.size = tarfile.XHDTYPE, len(records)
    header = info.tobuf(tarfile.USTAR_FORMAT) + records + bytes(-len(records) % 512)
    _plant_shard(files_run, tail=header)
    code, listing = _json("ls", str(files_run))
    assert code == 0
    (refused,) = [d for d in listing["dumps"] if d["problem"]]
    assert refused["path"].startswith(SHARDS_DIR) and "tar header" in refused["problem"]
    assert _cli("verify", str(files_run))[0] == 1


def test_a_record_segment_over_the_budget_is_refused_not_read(
    files_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_listing, "SEGMENT_MAX", 4096)  # the mechanism, without a 1 GiB file
    segment = files_run / RECORDS_PREFIX / "evil-000000.jsonl"
    with segment.open("wb") as file:
        file.truncate(4097)  # sparse zeros: whole, it would be read into memory
    reads: list[str] = []
    read = LocalStorage.read

    async def recording_read(self: LocalStorage, path: str) -> bytes:
        reads.append(path)
        return await read(self, path)

    monkeypatch.setattr(LocalStorage, "read", recording_read)
    code, listing = _json("ls", str(files_run))
    assert code == 0 and str(segment.relative_to(files_run)) not in reads
    (refused,) = [d for d in listing["dumps"] if d["problem"]]
    assert refused["path"] == str(segment.relative_to(files_run))
    assert "4097 bytes" in refused["problem"]
    assert [d["name"] for d in listing["dumps"] if not d["problem"]] == list(DUMPS)
    assert _cli("verify", str(files_run))[0] == 1


def test_a_fifo_planted_after_the_listing_blocks_no_read(files_run: Path) -> None:
    async def go() -> list[object]:
        async with open_run(files_run) as run:
            infos = await run.list()
            info = next(i for i in infos if i.name == "step1/s")
            fifo = _fifo_at(files_run / "step1" / "s.pth")
            outcomes: list[object] = []
            with _FifoWatch([fifo]):  # a reader that blocked would get end-of-file from it
                outcomes += await run.read_many(infos)
                for call in (run.read_bytes, run.load):
                    try:
                        outcomes.append(await call(info))
                    except trajtrack.TrajtrackError as exc:
                        outcomes.append(exc)
            return outcomes

    outcomes = anyio.run(go)
    step1 = [outcomes[1], *outcomes[4:]]
    # In a batch: read without blocking, nothing there; alone: refused (not a regular file)
    assert step1[0] == b""
    assert all(isinstance(o, trajtrack.StoragePermissionError) for o in step1[1:]), step1
    assert all("regular file" in str(o) for o in step1[1:])
