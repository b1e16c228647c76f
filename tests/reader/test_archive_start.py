"""Bytes before a torch archive: the fast path declines them, and torch decides.

``torch.load`` reads bytes as its zip format only if they start with a local header's
signature; anything else it reads as its legacy pickle stream, from the first byte. The fast
path parses an archive from its end, so a legacy stream followed by a real ``torch.save``
archive (offsets moved along) is two objects: torch's and the archive's. Each case here is
built from real ``torch.save`` output and checked against ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from _support.memo import emptied
from reader.test_fast_load import saved
from reader.test_load_agreement import assert_same, torch_load
from trajtrack import DumpLoadError, UnsafeLoadError
from trajtrack.reader import (
    _fast_load,
    _torch_archive,
    check_loadable,
    diff_runs,
    load_dump_bytes,
    load_dump_file,
    open_run,
)
from trajtrack.reader._archive_diff import compare_archives
from trajtrack.reader._compare import Tolerance
from trajtrack.reader._fast_load import DECLINED, fast_load, only_default_globals
from trajtrack.reader._same_archive import same_apart_from_serialization_id

ZIPPED: Any = {"verdict": torch.tensor([1.0, 2.0, 3.0])}
CALLS: list[tuple[Any, ...]] = []


def ran(*args: Any) -> None:
    """A global outside every allow-list: a pickle that reaches it has run."""
    CALLS.append(args)


@pytest.fixture(autouse=True)
def empty_memos() -> Iterator[None]:
    with (
        emptied(_torch_archive._LAYOUTS),
        emptied(_torch_archive._SKELETONS),
        emptied(_fast_load._ANSWERS),
    ):
        yield
    assert not CALLS  # nothing a hostile pickle names ever ran


def shifted(archive: bytes, prefix: bytes) -> bytes:
    """*prefix*, then *archive* with every offset its directory and end records hold moved
    along: a zip archive that a reader parsing from the end takes as valid."""
    out, by = bytearray(prefix + archive), len(prefix)

    def move(fmt: str, at: int) -> None:
        struct.pack_into(fmt, out, by + at, struct.unpack_from(fmt, archive, at)[0] + by)

    end = len(archive) - 22
    total, cd_offset = struct.unpack_from("<H4xI", archive, end + 10)
    position = cd_offset
    for _ in range(total):
        move("<I", position + 42)  # the local header's offset
        position += 46 + sum(struct.unpack_from("<HHH", archive, position + 28))
    move("<I", end + 16)
    locator = end - 20
    assert archive[locator : locator + 4] == b"PK\x06\x07"  # torch.save writes zip64 records
    record = struct.unpack_from("<Q", archive, locator + 8)[0]
    move("<Q", locator + 8)
    move("<Q", record + 48)  # the zip64 end record's directory offset
    return bytes(out)


def legacy(pickled: bytes) -> bytes:
    """torch's legacy format around the object pickle *pickled* (no storages)."""
    header = (
        torch.serialization.MAGIC_NUMBER,
        torch.serialization.PROTOCOL_VERSION,
        {"protocol_version": 1001, "little_endian": True, "type_sizes": {"int": 4}},
    )
    stream = b"".join(pickle.dumps(part, protocol=2) for part in header)
    return stream + pickled + pickle.dumps([], protocol=2)


def calling(module: str, name: str) -> bytes:
    """A pickle that calls ``module.name("exit 0")`` (never loaded by anything here)."""
    return b"\x80\x02c%s\n%s\nX\x06\x00\x00\x00exit 0\x85R." % (module.encode(), name.encode())


HOSTILE = [("os", "system"), (__name__, "ran")]
SAFE_FRONT = legacy(pickle.dumps({"verdict": "the legacy stream"}, protocol=2))


def torch_refuses(data: bytes) -> None:
    with pytest.raises(Exception):  # noqa: B017,PT011  any refusal of torch's
        torch_load(data)


def assert_not_the_archive(data: bytes) -> None:
    """The fast path and the archive comparison leave *data* to torch."""
    assert fast_load(data) is DECLINED
    assert only_default_globals(data) is False
    assert compare_archives(data, data, Tolerance(), 10) is None


def test_a_legacy_stream_before_an_archive_loads_as_torch_loads_it() -> None:
    data = shifted(saved(ZIPPED), SAFE_FRONT)
    want = torch_load(data)
    assert want == {"verdict": "the legacy stream"}  # torch reads the front, not the zip
    assert_not_the_archive(data)
    assert_same(load_dump_bytes(data), want, {})


@pytest.mark.parametrize(("module", "name"), HOSTILE)
def test_a_hostile_legacy_stream_before_an_archive_is_refused(
    module: str, name: str, tmp_path: Path
) -> None:
    data = shifted(saved(ZIPPED), legacy(calling(module, name)))
    (tmp_path / "x.pth").write_bytes(data)
    with pytest.raises(pickle.UnpicklingError, match=name):
        torch_load(data)
    assert_not_the_archive(data)
    with pytest.raises(UnsafeLoadError, match=name):
        load_dump_bytes(data)
    with pytest.raises(UnsafeLoadError, match=name):
        check_loadable(data)
    with pytest.raises(UnsafeLoadError, match=name):
        load_dump_file(str(tmp_path / "x.pth"))


def test_junk_before_an_archive_is_not_loaded() -> None:
    data = shifted(saved(ZIPPED), b"JUNK")
    torch_refuses(data)
    assert_not_the_archive(data)
    with pytest.raises((DumpLoadError, UnsafeLoadError)):
        load_dump_bytes(data)


def test_an_archive_not_at_the_first_byte_goes_to_torch() -> None:
    # Bytes that start like a local header, then the archive: torch's zip reader takes it
    # (it parses from the end too), but torch.save never writes it: the fast path declines.
    data = shifted(saved(ZIPPED), b"PK\x03\x04" + bytes(60))
    want = torch_load(data)
    assert_not_the_archive(data)
    assert_same(load_dump_bytes(data), want, {})


def test_a_remembered_layout_does_not_skip_the_start() -> None:
    good = saved(ZIPPED)
    _torch_archive.archive_records(good)  # remembered by the bytes it read
    for front in (b"JUNK", SAFE_FRONT[:4]):
        other = front + good[4:]
        with pytest.raises(_torch_archive.Declined):
            _torch_archive.archive_records(other)
        torch_refuses(other)
        assert fast_load(other) is DECLINED


@pytest.mark.parametrize(("module", "name"), HOSTILE)
def test_a_verdict_on_a_good_file_does_not_carry_over_to_a_polyglot(module: str, name: str) -> None:
    archive = saved(ZIPPED)
    front = legacy(calling(module, name))
    # Same length, same archive after the front: one torch reads as a zip, one as a stream.
    good = shifted(archive, b"PK\x03\x04" + bytes(len(front) - 4))
    hostile = shifted(archive, front)
    assert len(good) == len(hostile) and good[len(front) :] == hostile[len(front) :]
    assert_same(load_dump_bytes(good), torch_load(good), {})
    check_loadable(good)
    with pytest.raises(UnsafeLoadError, match=name):
        load_dump_bytes(hostile)
    with pytest.raises(UnsafeLoadError, match=name):
        check_loadable(hostile)
    assert_not_the_archive(hostile)


async def test_a_run_with_a_polyglot_dump_refuses_it_in_load_and_diff(tmp_path: Path) -> None:
    data = shifted(saved(ZIPPED), legacy(calling(__name__, "ran")))
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "x.pth").write_bytes(data)
    async with open_run(tmp_path / "a") as run_a, open_run(tmp_path / "b") as run_b:
        with pytest.raises(UnsafeLoadError, match="ran"):
            await run_a.load("x")
        (found,) = (await diff_runs(run_a, run_b)).comparisons
    # Equal bytes are equal, but never passed as a dump a safe load accepts.
    assert found.status == "equal"
    assert any("a safe load refuses it" in note for note in found.notes), found


def test_the_shift_gives_what_torch_loads() -> None:
    # The helper itself: an archive moved along is still one torch's zip reader loads.
    data = shifted(saved(ZIPPED), b"PK\x03\x04" + bytes(4))
    assert_same(torch.load(io.BytesIO(data), weights_only=True), ZIPPED, {})


@pytest.mark.parametrize(
    "front", [SAFE_FRONT, legacy(calling(__name__, "ran"))], ids=["safe front", "hostile front"]
)
async def test_a_polyglot_is_never_equal_to_its_archive(tmp_path: Path, front: bytes) -> None:
    """``zipfile`` skips bytes before an archive; torch reads them. A dump that is the clean
    archive in one run and a polyglot of it in the other differs."""
    clean = saved(ZIPPED)
    data = shifted(clean, front)
    assert not same_apart_from_serialization_id(data, clean)
    assert not same_apart_from_serialization_id(clean, data)
    for run, content in (("a", data), ("b", clean)):
        (tmp_path / run).mkdir()
        (tmp_path / run / "x.pth").write_bytes(content)
    async with open_run(tmp_path / "a") as run_a, open_run(tmp_path / "b") as run_b:
        (found,) = (await diff_runs(run_a, run_b)).comparisons
    assert found.status != "equal", found
