"""Case 1, crash safety: writers SIGKILLed at random moments never leave a partial dump visible.

A zygote process (torch imported once) forks one writer per trial; the writer streams dumps of
mixed sizes (1 KB to 2 MB) from 6 tasks through 4 upload workers to the local backend throttled
to a slow disk's pace (20 ms per 256 KB, 10 ms per flush, so that many kills land while files
are being written), and the test kills it with SIGKILL at a random moment after its first
commit. After every kill:

* every file under a final name loads (``weights_only=True``) and equals its source, which the
  test recomputes from the name;
* every record line describes a file that exists with the recorded size and checksum;
* temporary files are never under a final name, never listed by the reader;
* the next writer on the directory has swept the temporary files of every earlier, dead writer.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import zlib
from pathlib import Path

import anyio
import pytest

import trajtrack
from trajtrack.layouts.names import WriterIdentity, temp_path_for
from trajtrack.reader import SyncRun

from ._payloads import KIB, MIB, check_file
from ._proc import Child, final_files, records, temp_files

HIGH = 2 * MIB
TASKS = 6


def _trials(request: pytest.FixtureRequest) -> int:
    return 100 if request.config.getoption("--long") else 20


def _check_after_kill(dest: Path, prefix: str, dead: set[int]) -> tuple[int, int]:
    """The invariants after one kill; returns (dumps checked, temp files left by the kill)."""
    files = final_files(dest)
    mine = {name: path for name, path in files.items() if name.startswith(prefix + "/")}
    for name, path in mine.items():
        check_file(path, name, KIB, HIGH)
    for record in records(dest):
        stored = dest / record.path
        assert stored.is_file(), f"recorded but missing: {record.path}"
        data = stored.read_bytes()
        assert len(data) == record.size, record.path
        assert f"crc32:{zlib.crc32(data):08x}" == record.checksum, record.path
    left = 0
    for path, (_host, pid) in temp_files(dest):
        assert path.rpartition("/")[2].startswith("."), path
        # swept by the writer that started after `pid` died; only the last one's may remain
        assert pid not in dead, f"temp file of an earlier dead writer not swept: {path}"
        left += 1
    return len(mine), left


def _reader_lists_no_temp(dest: Path) -> None:
    with SyncRun(dest) as run:
        listed = run.list(refresh=True)
    files = final_files(dest)
    assert {info.path for info in listed} == {f"{name}.pth" for name in files}
    for info in listed:
        assert ".tmp~" not in info.path
        assert not any(part.startswith(".") for part in info.path.split("/"))


def test_sigkill_at_random_moments_local(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    seed = int(os.environ.get("TRAJTRACK_CRASH_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    dest = tmp_path / "run"
    zygote = Child("zygote")
    zygote.wait_line("ZYGOTE")
    dead: set[int] = set()
    checked = leftovers = 0
    try:
        for trial in range(_trials(request)):
            # slowdisk: the local backend at a slow device's pace, so kills often land mid-write
            zygote.send(f"crash slowdisk://{dest} k{trial} {TASKS} {HIGH}")
            pid = int(zygote.wait_line("PID"))
            zygote.wait_line("READY")
            time.sleep(rng.uniform(0.0, 0.5))
            os.kill(pid, 9)
            assert zygote.wait_line("EXIT") == f"{pid} -9", f"seed {seed}"
            count, left = _check_after_kill(dest, f"k{trial}", dead)
            assert count >= 1, f"trial {trial} (seed {seed}) committed nothing before READY?"
            checked += count
            leftovers += left
            dead.add(pid)
    finally:
        zygote.finish()
    sys.stderr.write(f"crash trials: seed {seed}, {checked} dumps verified, {leftovers} temps\n")
    _reader_lists_no_temp(dest)


async def test_next_tracker_sweeps_dead_writers_temp_files_never_live_ones(
    tmp_path: Path,
) -> None:
    # the helper processes are started before the event loop matters (blocking on purpose)
    dest = tmp_path / "run"
    dest.mkdir()
    host = WriterIdentity.current().host
    dead_pid = _dead_pid()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # noqa: ASYNC220
    try:
        planted = {}
        for label, pid in (("dead", dead_pid), ("live", live.pid)):
            who = WriterIdentity(host=host, pid=pid, rank=0, local_rank=0, world_size=1)
            path = temp_path_for(f"step1/{label}.pth", who)
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            (dest / path).write_bytes(b"half a dump")
            planted[label] = dest / path
        other_host = temp_path_for(
            "step1/remote.pth", WriterIdentity("another-host", dead_pid, 0, 0, 1)
        )
        (dest / other_host).write_bytes(b"not ours to judge")
        async with trajtrack.Tracker(dest) as tracker:
            await tracker.dump({"x": 1}, "step1/new")
        assert not planted["dead"].exists()
        assert planted["live"].exists()  # a live writer's upload in progress is never touched
        assert (dest / other_host).exists()  # a pid of another host says nothing about liveness
    finally:
        live.kill()
        live.wait(timeout=30)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


@pytest.mark.hdfs
async def test_sigkill_at_random_moments_hdfs(
    hdfs_url: str, request: pytest.FixtureRequest
) -> None:
    """The same trials against the real HDFS test cluster, read back through the storage."""
    from trajtrack.backends import open_storage

    seed = time.time_ns() % 100_000
    rng = random.Random(seed)
    zygote = Child("zygote")
    zygote.wait_line("ZYGOTE")
    killed: list[int] = []  # in the order they were killed (pids wrap around: not sorted)
    try:
        for trial in range(_trials(request)):
            zygote.send(f"crash {hdfs_url} k{trial} {TASKS} {HIGH}")
            pid = int(zygote.wait_line("PID"))
            zygote.wait_line("READY")
            await anyio.sleep(rng.uniform(0.0, 0.5))
            os.kill(pid, 9)
            assert zygote.wait_line("EXIT") == f"{pid} -9", f"seed {seed}"
            killed.append(pid)
    finally:
        zygote.finish()
    storage = open_storage(hdfs_url)
    await storage.prepare()
    try:
        await _check_storage(storage, killed)
        await _a_later_tracker_sweeps_every_dead_writers_temps(hdfs_url, storage, set(killed))
    finally:
        await storage.aclose()


async def _a_later_tracker_sweeps_every_dead_writers_temps(
    url: str, storage: trajtrack.backends.Storage, dead: set[int]
) -> None:
    """After the trials, a new tracker's start removes every dead writer's temporary file.

    With WebHDFS a killed writer's last CREATE can still be carried out by the DataNode after
    the writer is gone (it acts for the client once the request reached it), possibly after
    the next trial's tracker swept: so a temp file of the second-to-last writer may appear
    late. A tracker started afterwards must remove it; one that keeps reappearing across
    several starts (bounded: 10 tries, 0.5 s apart) would be a bug.
    """
    from trajtrack.layouts.names import parse_temp_path

    left: list[str] = []
    for _ in range(10):
        async with trajtrack.Tracker(url, record=False):
            pass  # start sweeps stale temporary files of dead writers of this host
        files = await storage.list()
        left = [f.path for f in files if (parse_temp_path(f.path) or ("", -1))[1] in dead]
        if not left:
            return
        await anyio.sleep(0.5)
    raise AssertionError(f"temporary files of dead writers survive later trackers: {left}")


async def _check_storage(storage: trajtrack.backends.Storage, killed: list[int]) -> None:
    import io

    import torch

    from trajtrack.layouts.names import is_internal_path, parse_temp_path

    from ._payloads import payload_for

    files = await storage.list()
    finals = [f for f in files if not is_internal_path(f.path)]
    assert finals
    for info in finals:
        name = info.path.removesuffix(".pth")
        loaded = torch.load(io.BytesIO(await storage.read(info.path)), weights_only=True)
        expected = payload_for(name, KIB, HIGH)
        assert loaded["name"] == name
        assert torch.equal(loaded["data"], expected["data"]), info.path
    # Only the last writers may have left temporary files here: the last one (no tracker ran
    # after it) and, on WebHDFS, the one before (see the function below); neither for long.
    dead, recent = set(killed), set(killed[-2:])  # the last two killed, not the largest pids
    for info in files:
        owner = parse_temp_path(info.path)
        if owner is not None:
            assert owner[1] not in dead - recent, info.path


# --------------------------------------------------------------------------- shards layout


def _check_shards_after_kill(dest: Path, dead: set[int]) -> int:
    """Every committed shard is a whole tar whose members load and equal their source."""
    import io
    import tarfile

    import torch

    from trajtrack.layouts.shards import SHARDS_DIR

    from ._payloads import payload_for

    checked = 0
    for shard in sorted((dest / SHARDS_DIR).glob("*.tar")):
        data = shard.read_bytes()
        assert data.endswith(bytes(1024)), f"{shard.name}: no end-of-archive blocks"
        with tarfile.open(fileobj=io.BytesIO(data)) as archive:  # a truncated one raises
            for member in archive.getmembers():
                body = archive.extractfile(member).read()  # type: ignore[union-attr]
                name = member.name.removesuffix(".pth")
                loaded = torch.load(io.BytesIO(body), weights_only=True)
                assert loaded["name"] == name
                assert torch.equal(loaded["data"], payload_for(name, KIB, HIGH)["data"])
                checked += 1
    for record in records(dest):
        if record.shard is None:
            continue
        raw = (dest / record.shard).read_bytes()  # recorded: the shard is there, whole
        body = raw[record.offset : record.offset + record.size]  # type: ignore[operator]
        assert f"crc32:{zlib.crc32(body):08x}" == record.checksum, record.path
    for path, (_host, pid) in temp_files(dest):
        assert pid not in dead, f"temp file or spool of an earlier dead writer left: {path}"
    return checked


def test_sigkill_at_random_moments_shards_local(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    seed = int(os.environ.get("TRAJTRACK_CRASH_SEED", time.time_ns() % 100_000))
    rng = random.Random(seed)
    dest = tmp_path / "run"
    zygote = Child("zygote")
    zygote.wait_line("ZYGOTE")
    dead: set[int] = set()
    checked = 0
    try:
        for trial in range(_trials(request)):
            zygote.send(f"crash slowdisk://{dest} k{trial} {TASKS} {HIGH} shards")
            pid = int(zygote.wait_line("PID"))
            zygote.wait_line("READY")
            time.sleep(rng.uniform(0.0, 0.5))
            os.kill(pid, 9)
            assert zygote.wait_line("EXIT") == f"{pid} -9", f"seed {seed}"
            checked += _check_shards_after_kill(dest, dead)
            dead.add(pid)
    finally:
        zygote.finish()
    assert checked >= 1, f"seed {seed}: no shard was ever committed"
    with SyncRun(dest) as run:  # what the reader lists loads, and is the source
        for info in run.list(refresh=True):
            assert info.shard is not None and info.problem is None
            assert run.load(info)["name"] == info.name


@pytest.mark.hdfs
async def test_sigkill_at_random_moments_shards_hdfs(
    hdfs_url: str, request: pytest.FixtureRequest
) -> None:
    from trajtrack.backends import open_storage
    from trajtrack.reader import open_run

    from ._payloads import payload_for

    seed = time.time_ns() % 100_000
    rng = random.Random(seed)
    zygote = Child("zygote")
    zygote.wait_line("ZYGOTE")
    dead: set[int] = set()
    try:
        for trial in range(_trials(request) // 2):
            zygote.send(f"crash {hdfs_url} k{trial} {TASKS} {HIGH} shards")
            pid = int(zygote.wait_line("PID"))
            zygote.wait_line("READY")
            await anyio.sleep(rng.uniform(0.0, 0.8))
            os.kill(pid, 9)
            assert zygote.wait_line("EXIT") == f"{pid} -9", f"seed {seed}"
            dead.add(pid)
    finally:
        zygote.finish()
    async with open_run(hdfs_url) as run:
        listing = await run.list()
        assert listing, f"seed {seed}: nothing committed"
        for info in listing:  # members of committed shards, one ranged read each
            assert info.shard is not None and info.present and info.problem is None
            loaded = await run.load(info)
            assert torch_equal(loaded["data"], payload_for(info.name, KIB, HIGH)["data"])
    storage = open_storage(hdfs_url)
    await storage.prepare()
    try:
        await _a_later_tracker_sweeps_every_dead_writers_temps(hdfs_url, storage, dead)
    finally:
        await storage.aclose()


def torch_equal(a: object, b: object) -> bool:
    import torch

    return bool(torch.equal(a, b))  # type: ignore[arg-type]
