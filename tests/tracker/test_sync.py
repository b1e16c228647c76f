"""The sync shim: dump_data / get_tracker, from threads, inside loops, at exit, after fork."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import trajtrack
from trajtrack import ConfigurationError, SyncTracker
from trajtrack.layouts.records import decode_segment


@pytest.fixture
def enabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    dest = tmp_path / "dumps"
    monkeypatch.setenv("VERL_ENABLE_TRACKER", "1")
    monkeypatch.setenv("VERL_TRACKER_HDFS_DIR", str(dest))
    return dest


def run_child(
    code: str, env: dict[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize("value", ["0", "true", "yes", "01", ""])
def test_disabled_shim_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("VERL_ENABLE_TRACKER", value)
    monkeypatch.setenv("VERL_TRACKER_HDFS_DIR", str(tmp_path / "d"))
    assert trajtrack.dump_data({"x": torch.ones(1)}, "nothing") is None
    assert not (tmp_path / "d").exists()


def test_missing_destination_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VERL_ENABLE_TRACKER", "1")
    with pytest.raises(ConfigurationError, match="VERL_TRACKER_HDFS_DIR"):
        trajtrack.dump_data({"x": torch.ones(1)}, "x")


def test_trajtrack_own_switch_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAJTRACK_ENABLE", "1")
    monkeypatch.setenv("TRAJTRACK_DIR", str(tmp_path / "own"))
    handle = trajtrack.dump_data({"x": torch.ones(1)}, "own")
    assert handle is not None
    assert handle.result(timeout=30).path == "own.pth"
    assert (tmp_path / "own" / "own.pth").exists()


def test_the_environment_chooses_the_shards_layout(
    enabled: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRAJTRACK_LAYOUT", "shards")
    monkeypatch.setenv("TRAJTRACK_SHARD_MAX_BYTES", "30000")
    monkeypatch.setenv("TRAJTRACK_SHARD_MAX_AGE", "600")
    handles = [
        trajtrack.dump_data({"i": i, "x": torch.full((500,), float(i))}, f"s{i}") for i in range(10)
    ]
    trajtrack.get_tracker().flush(timeout=60)
    records = [h.result(timeout=30) for h in handles if h is not None]
    assert trajtrack.get_tracker().tracker.layout == "shards"
    assert all(r.shard is not None for r in records)
    assert len({r.shard for r in records}) >= 2  # sealed by the configured size
    assert not list(enabled.glob("*.pth"))  # nothing as a file of its own
    with trajtrack.SyncRun(enabled) as run:
        assert torch.equal(run.load("s7")["x"], torch.full((500,), 7.0))


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("TRAJTRACK_LAYOUT", "zip", "TRAJTRACK_LAYOUT"),
        ("TRAJTRACK_SHARD_MAX_BYTES", "lots", "TRAJTRACK_SHARD_MAX_BYTES"),
        ("TRAJTRACK_SHARD_MAX_AGE", "0", "TRAJTRACK_SHARD_MAX_AGE"),
    ],
)
def test_a_bad_layout_setting_is_a_clear_error(
    enabled: Path, monkeypatch: pytest.MonkeyPatch, var: str, value: str, message: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigurationError, match=message):
        trajtrack.dump_data({"x": torch.ones(1)}, "x")


def test_dump_data_from_many_threads(enabled: Path) -> None:
    def worker(rank: int) -> None:
        for i in range(25):
            trajtrack.dump_data({"rank": torch.tensor(rank), "i": torch.tensor(i)}, f"t{rank}/{i}")

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    tracker = trajtrack.get_tracker()
    tracker.flush(timeout=60)
    stats = tracker.statistics()
    assert stats.committed == 200
    assert len(list(enabled.glob("t*/*.pth"))) == 200
    assert torch.load(enabled / "t5" / "7.pth")["i"].item() == 7


def test_mutation_after_dump_data_is_harmless(enabled: Path) -> None:
    obs = torch.zeros(3)
    handle = trajtrack.dump_data({"obs": obs}, "obs")
    obs.fill_(9)
    assert handle is not None
    record = handle.result(timeout=30)
    assert torch.equal(torch.load(enabled / record.path)["obs"], torch.zeros(3))


def test_dump_data_and_flush_inside_a_running_event_loop(enabled: Path) -> None:
    async def coroutine() -> None:
        # Sync API called from a coroutine: the shim's own loop does the work, no deadlock.
        for i in range(10):
            trajtrack.dump_data({"i": torch.tensor(i)}, f"loop/{i}")
        trajtrack.get_tracker().flush(timeout=30)

    asyncio.run(coroutine())
    assert len(list((enabled / "loop").glob("*.pth"))) == 10


def test_flush_reraises_a_failure(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    tracker = SyncTracker(str(tmp_path / "d"))
    try:
        tracker.flush(timeout=30)  # the storage starts in the background: now it has
        (tmp_path / "d" / "sub").write_text("a file where a directory is needed")
        handle = tracker.dump({"x": torch.ones(1)}, "sub/x")
        with pytest.raises(trajtrack.StorageError):
            handle.result(timeout=30)
        with pytest.raises(trajtrack.StorageError):
            tracker.flush(timeout=30)
        tracker.dump({"x": torch.ones(1)}, "ok").result(timeout=30)  # still usable
    finally:
        tracker.close(timeout=30)
    with pytest.raises(trajtrack.TrackerClosedError):
        tracker.dump({"x": torch.ones(1)}, "late")


def test_pending_dumps_are_written_at_interpreter_exit(tmp_path: Path) -> None:
    dest = tmp_path / "exit"
    result = run_child(
        """
        import torch, trajtrack
        for i in range(300):
            trajtrack.dump_data({"i": torch.full((256,), i)}, f"pending/{i}")
        print("pending", trajtrack.get_tracker().statistics().pending_items > 0)
        """,
        {"VERL_ENABLE_TRACKER": "1", "VERL_TRACKER_HDFS_DIR": str(dest)},
    )
    assert result.returncode == 0, result.stderr
    files = list((dest / "pending").glob("*.pth"))
    assert len(files) == 300
    assert torch.load(dest / "pending" / "299.pth")["i"][0].item() == 299
    records = list((dest / ".trajtrack" / "records").glob("*.jsonl"))
    assert sum(len(decode_segment(r.read_bytes())[0]) for r in records) == 300


def test_exit_budget_is_honoured_and_reported(tmp_path: Path) -> None:
    # A storage that never finishes: the process must still exit, within the budget, and say
    # how many dumps were lost.
    result = run_child(
        """
        import threading, torch, trajtrack
        from trajtrack.backends import register_backend
        from trajtrack.backends.memory import MemoryStorage
        never = threading.Event()
        def hang(op, path):
            if op == "write":
                never.wait()
        register_backend("hang", lambda url, **kw: MemoryStorage("memory://hang", fault=hang))
        for i in range(5):
            trajtrack.dump_data({"i": torch.tensor(i)}, f"x{i}")
        """,
        {
            "VERL_ENABLE_TRACKER": "1",
            "VERL_TRACKER_HDFS_DIR": "hang://nowhere",
            "TRAJTRACK_EXIT_TIMEOUT": "1",
        },
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "5 dumps were not written within 1.0 s" in result.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_starts_clean(enabled: Path) -> None:
    parent_handles = [trajtrack.dump_data({"p": torch.tensor(i)}, f"parent/{i}") for i in range(50)]
    parent = trajtrack.get_tracker()
    pid = os.fork()
    if pid == 0:  # the child: a fresh tracker of its own, none of the parent's backlog
        code = 1
        try:
            child = trajtrack.get_tracker()
            ok = child is not parent and child.statistics().enqueued == 0
            trajtrack.dump_data({"c": torch.tensor(1)}, "child/only")
            child.flush(timeout=30)
            ok = ok and child.statistics().committed == 1
            child.close(timeout=30)
            code = 0 if ok else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for handle in parent_handles:
        assert handle is not None
        handle.result(timeout=30)
    parent.flush(timeout=30)
    assert parent.statistics().committed == 50
    assert len(list((enabled / "parent").glob("*.pth"))) == 50
    assert (enabled / "child" / "only.pth").exists()


@pytest.mark.parametrize("closed", [False, True], ids=["never-closed", "with-block"])
def test_a_script_whose_syncrun_call_raises_exits(tmp_path: Path, closed: bool) -> None:
    # #31: the reader's facade left anyio's portal generator to interpreter teardown, where its
    # thread could no longer run: the process hung for ever after the traceback.
    run = tmp_path / "run"
    SyncTracker(run).close(timeout=30)  # a real, empty run
    opened = f"with trajtrack.SyncRun({str(run)!r}) as r:" if closed else "if True:"
    reader = "r" if closed else f"trajtrack.SyncRun({str(run)!r})"
    result = run_child(
        f"""
        import trajtrack
        {opened}
            {reader}.load("nope")
        """,
        {},
        timeout=60,  # the hang was for ever; importing torch takes seconds
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.rstrip().endswith("no dump named 'nope'")
    assert "StorageNotFoundError" in result.stderr


def test_a_refused_name_logs_one_line_naming_the_whole_dump(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="trajtrack")
    for attempt in range(2):
        tracker = SyncTracker(tmp_path / "run", on_exists="error")
        try:
            handle = tracker.dump({"x": torch.ones(2)}, "step0/obs.rank0")
            if attempt == 0:
                handle.result(timeout=30)
                continue
            caplog.clear()
            with pytest.raises(trajtrack.DumpExistsError, match=r"step0/obs\.rank0\.pth exists"):
                handle.result(timeout=30)
        finally:
            with contextlib.suppress(trajtrack.DumpExistsError):
                tracker.close(timeout=30)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert errors[0].exc_info is None  # no traceback: the typed error says it all
    assert "'step0/obs.rank0'" in errors[0].getMessage()
    assert "step0/obs.rank0.pth exists" in errors[0].getMessage()


def test_with_tracking_off_get_tracker_does_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # #31: flush raised "enabled but has no destination" in every untracked run.
    for var in ("VERL_ENABLE_TRACKER", "TRAJTRACK_ENABLE", "TRAJTRACK_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VERL_TRACKER_HDFS_DIR", str(tmp_path / "d"))
    tracker = trajtrack.get_tracker()
    assert not tracker.enabled
    tracker.flush(timeout=60)
    assert tracker.dump({"x": torch.ones(1)}, "x") is None
    assert tracker.statistics().enqueued == 0
    tracker.close(timeout=1)
    monkeypatch.delenv("VERL_TRACKER_HDFS_DIR")
    trajtrack.get_tracker().flush(timeout=60)  # no destination either: still nothing to do
    assert not (tmp_path / "d").exists()


def test_a_flush_that_times_out_says_what_and_how_many_are_pending() -> None:
    from trajtrack.backends.memory import MemoryStorage

    release = threading.Event()

    def hang(operation: str, path: str) -> None:
        if operation == "write":
            release.wait(30)

    storage = MemoryStorage("memory://flush-timeout/run", fault=hang)
    tracker = SyncTracker("memory://flush-timeout/run", storage=storage)
    try:
        for i in range(3):
            tracker.dump({"i": torch.tensor(i)}, f"x{i}")
        with pytest.raises(TimeoutError) as caught:
            tracker.flush(timeout=0.2)
        message = str(caught.value)
        assert "flush of memory://flush-timeout/run timed out after 0.2 s" in message
        assert "3 of the 3 dumps it waited for are still pending" in message
    finally:
        release.set()
        tracker.close(timeout=30)


def test_a_storage_that_never_starts_stalls_no_dump(caplog: pytest.LogCaptureFixture) -> None:
    # #31: each dump_data waited out the storage's whole start (~26 s on a dead WebHDFS).
    from trajtrack.backends.memory import MemoryStorage

    caplog.set_level(logging.ERROR, logger="trajtrack")
    starts: list[str] = []
    release = threading.Event()

    def dead(operation: str, path: str) -> None:
        if operation == "prepare":
            starts.append(path)
            release.wait(30)  # still starting until the test says otherwise
            raise trajtrack.StorageUnavailableError("connection refused (dead namenode)")

    tracker = SyncTracker(
        "memory://dead/run", storage=MemoryStorage("memory://dead/run", fault=dead)
    )
    try:
        # While the storage starts, dumps are queued (the constructor and each dump returned
        # with the start still blocked: nothing here waits for it).
        handles = [tracker.dump({"i": torch.tensor(i)}, f"x{i}") for i in range(3)]
        stats = tracker.statistics()
        assert (stats.state, stats.pending_items) == ("starting", 3)
        release.set()  # the start fails for good
        for handle in handles:
            with pytest.raises(trajtrack.TrackerFailedError, match="connection refused"):
                handle.result(timeout=30)
        for i in range(3):  # later dumps fail at once: no second start, typed, counted
            with pytest.raises(trajtrack.TrackerFailedError, match="connection refused"):
                tracker.dump({"i": torch.tensor(i)}, f"later{i}")
        with pytest.raises(trajtrack.TrackerFailedError):
            tracker.flush(timeout=30)
        assert len(starts) == 1
        assert tracker.statistics().failed == 6
    finally:
        release.set()
        with contextlib.suppress(trajtrack.TrackerFailedError):
            tracker.close(timeout=30)
    said = [r for r in caplog.records if "connection refused" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]  # logged once


def test_a_refused_webhdfs_port_fails_the_tracker_once(tmp_path: Path) -> None:
    pytest.importorskip("hdfs")
    import socket

    with socket.socket() as closed:  # a port that refuses: bound, never listening
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        url = f"webhdfs://127.0.0.1:{port}/user/nobody/run"
        tracker = SyncTracker(url, storage_options={"prepare_timeout": 1.0})
        try:
            handle = tracker.dump({"x": torch.ones(2)}, "step0/obs")  # queued: no wait
            with pytest.raises(trajtrack.TrackerFailedError, match="unreachable"):
                handle.result(timeout=60)
            with pytest.raises(trajtrack.TrackerFailedError, match="unreachable"):
                tracker.dump({"x": torch.ones(2)}, "step1/obs")
            assert tracker.statistics().state == "failed"
        finally:
            with contextlib.suppress(trajtrack.TrackerFailedError):
                tracker.close(timeout=30)
