"""``diff`` of local runs: pairs compared on memory maps, loaded with ``mmap``, never copied."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch

import trajtrack.reader._diff as diff_module
from trajtrack.reader import diff_runs, open_run
from trajtrack.reader._files import compare_files
from trajtrack.reader._readahead import ReadAhead


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        (b"", b"", True),
        (b"PK\x03\x04" + bytes(range(256)) * 40, b"PK\x03\x04" + bytes(range(256)) * 40, True),
        (bytes(1000) + b"x", bytes(1000) + b"y", False),  # the last, unaligned byte
        (bytes(8 << 15) + b"1" + bytes(7), bytes(8 << 15) + b"2" + bytes(7), False),  # chunk 2
        (bytes(100), bytes(101), False),
    ],
)
def test_compare_files(tmp_path: Path, a: bytes, b: bytes, equal: bool) -> None:
    (tmp_path / "a").write_bytes(a)
    (tmp_path / "b").write_bytes(b)
    found = compare_files(str(tmp_path / "a"), str(tmp_path / "b"))
    assert found.equal is equal
    assert found.zip_a is a.startswith(b"PK\x03\x04")


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every file diff loads, with whether it maps it."""
    seen: list[tuple[str, bool]] = []
    real = diff_module.load_path

    def recording(path: str, *, unsafe: bool, where: str, mmap: bool) -> Any:
        seen.append((Path(path).name, mmap))
        return real(path, unsafe=unsafe, where=where, mmap=mmap)

    monkeypatch.setattr(diff_module, "load_path", recording)
    return seen


async def test_local_pairs_are_mapped_and_identical_ones_not_loaded(
    tmp_path: Path, loads: list[tuple[str, bool]], monkeypatch: pytest.MonkeyPatch
) -> None:
    read_ahead: list[list[str]] = []
    real_run = ReadAhead.run

    async def run(self: ReadAhead) -> None:
        read_ahead.append(sorted(Path(a).name for a, _, _ in self._pairs))
        await real_run(self)

    monkeypatch.setattr(ReadAhead, "run", run)
    a, b = tmp_path / "a", tmp_path / "b"
    for run, value in ((a, 1.0), (b, 2.0)):
        run.mkdir()
        torch.save({"x": torch.ones(3)}, run / "same.pth")
        torch.save({"x": torch.full((3,), value)}, run / "zipped.pth")
        torch.save(
            {"x": torch.full((3,), value)}, run / "legacy.pth", _use_new_zipfile_serialization=False
        )
    async with open_run(a) as run_a, open_run(b) as run_b:
        result = await diff_runs(run_a, run_b)
    status = {c.name: c.status for c in result.comparisons}
    assert status == {"same": "equal", "zipped": "different", "legacy": "different"}
    assert sorted(loads) == [("legacy.pth", False)] * 2 + [("zipped.pth", True)] * 2
    assert read_ahead == [["legacy.pth", "same.pth", "zipped.pth"]]  # every local pair


async def test_runs_of_other_storages_are_read_and_loaded_from_bytes(
    loads: list[tuple[str, bool]],
) -> None:
    for url, value in (("memory://m/a", 1.0), ("memory://m/b", 2.0)):
        async with open_run(url) as run:
            storage = run.storage
            buffer = io.BytesIO()
            torch.save({"x": torch.full((3,), value)}, buffer)
            storage.put_raw("d.pth", buffer.getvalue())  # type: ignore[attr-defined]
    async with open_run("memory://m/a") as run_a, open_run("memory://m/b") as run_b:
        result = await diff_runs(run_a, run_b)
    assert [c.status for c in result.comparisons] == ["different"]
    assert loads == []
