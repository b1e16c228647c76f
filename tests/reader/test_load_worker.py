"""trajtrack's load worker: reused, restarted after a crash, never trusted, never re-runs main."""

from __future__ import annotations

import io
import os
import signal
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trajtrack.reader._load_worker as load_worker
from trajtrack import DumpLoadError, UnsafeLoadError
from trajtrack.reader import load_dump_bytes
from trajtrack.reader._main_module import main_module_problem
from trajtrack.rollout import RolloutBatch, RolloutSample


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# A numpy array as a value pickles with numpy's reconstructors: only torch with trajtrack's
# allow-list loads it (the fast path declines them), in the worker.
SAMPLE = RolloutSample(
    full_batch=RolloutBatch({"r": torch.ones(2, 2)}, {"u": np.array(["a", "b"], dtype=object)}),
    sample_id="s",
    rollout_status={"scores": np.arange(3.0)},
)


def worker_pid() -> int | None:
    worker = load_worker._state.worker
    return None if worker is None else worker._process.pid


def test_the_worker_is_reused_and_replaced_when_it_died() -> None:
    assert load_dump_bytes(saved(SAMPLE)) == SAMPLE
    first = worker_pid()
    assert first is not None and first != os.getpid()
    assert load_dump_bytes(saved(SAMPLE)) == SAMPLE
    assert worker_pid() == first
    os.kill(first, signal.SIGKILL)
    load_worker._state.worker._process.join(30)  # type: ignore[union-attr]
    assert load_dump_bytes(saved(SAMPLE)) == SAMPLE
    assert worker_pid() not in (None, first)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_starts_its_own_worker_and_the_parent_keeps_its_own() -> None:
    """A child shares the parent's pipe to its worker after a fork: it must start its own (two
    processes on one pipe would mix their frames; the worker is not the child's to manage)."""
    assert load_dump_bytes(saved(SAMPLE)) == SAMPLE
    parents = worker_pid()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its answer through the pipe, nothing else
        try:
            loaded = load_dump_bytes(saved(SAMPLE))
            answer = f"{int(loaded == SAMPLE)} {worker_pid()}"
        except BaseException as exc:
            answer = f"error {exc!r}"
        finally:
            os.write(write_end, answer.encode())
            os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    answer = os.read(read_end, 1000).decode()
    os.close(read_end)
    loaded_ok, childs = answer.split(" ", 1)
    assert loaded_ok == "1", answer
    assert childs not in ("None", str(parents))
    assert load_dump_bytes(saved(SAMPLE)) == SAMPLE
    assert worker_pid() == parents


def test_a_worker_dying_during_a_load_fails_that_load_only(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_dump_bytes(saved(SAMPLE)) == SAMPLE  # a worker is running
    exchange = load_worker._Worker.exchange

    def crash_first(self: Any, header: dict[str, Any], payload: bytes) -> tuple[bytes, bytes]:
        monkeypatch.setattr(load_worker._Worker, "exchange", exchange)
        os.kill(self._process.pid, signal.SIGKILL)  # as a hostile file crashing torch would
        self._process.join(30)
        return exchange(self, header, payload)

    monkeypatch.setattr(load_worker._Worker, "exchange", crash_first)
    with pytest.raises(DumpLoadError, match=r"load worker exited \(killed by signal 9\)"):
        load_dump_bytes(saved(SAMPLE), where="d")
    assert load_dump_bytes(saved(SAMPLE)) == SAMPLE


class RunsShell:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch '{self.marker}'",))


def test_the_callers_side_loads_the_reply_with_torchs_defaults_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Even a worker gone bad cannot make the caller run code: its reply is loaded weights-only.
    marker = tmp_path / "pwned"
    hostile = saved({"payload": RunsShell(str(marker))})

    def compromised(self: Any, header: dict[str, Any], payload: bytes) -> tuple[bytes, bytes]:
        return b'{"status": "ok"}', hostile

    assert load_dump_bytes(saved(SAMPLE)) == SAMPLE  # a worker is running
    monkeypatch.setattr(load_worker._Worker, "exchange", compromised)
    with pytest.raises(DumpLoadError, match=r"Weights only load failed|posix\.system"):
        load_dump_bytes(saved(SAMPLE))
    for reply in (b"[]", b'{"status": "what"}'):
        monkeypatch.setattr(load_worker._Worker, "exchange", lambda *_, r=reply: (r, b""))
        with pytest.raises(DumpLoadError, match="malformed reply"):
            load_dump_bytes(saved(SAMPLE))
    assert not marker.exists()


@pytest.fixture
def main_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """Pretend this process runs a script of the test's making (``set(source)``)."""
    script = tmp_path / "script.py"
    fake = types.ModuleType("__main__")
    fake.__file__ = str(script)
    fake.__spec__ = None
    monkeypatch.setitem(sys.modules, "__main__", fake)

    def set_source(source: str) -> None:
        script.write_text(source)

    return set_source


def test_no_worker_is_started_that_would_rerun_the_main_module(
    monkeypatch: pytest.MonkeyPatch, main_module: Any
) -> None:
    main_module("import shutil\nshutil.rmtree('/tmp/precious')\n")
    monkeypatch.setattr(load_worker._state, "worker", None)

    def never(*_: object) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(load_worker._Worker, "__init__", never)
    with pytest.raises(UnsafeLoadError, match=r"script\.py runs code at import \(line 2\)") as info:
        load_dump_bytes(saved(SAMPLE))
    assert "allow_in_this_process()" in str(info.value)
    assert "rebuild_sample" in str(info.value)


GUARDED = '''"""A script."""
from __future__ import annotations

import logging
try:
    import numpy
except ImportError:
    numpy = None
if False:
    import typing
logger = logging.getLogger(__name__)
LIMIT: int = 3


def main() -> None:
    print("work")


class Thing:
    pass


if __name__ == "__main__":
    main()
'''


@pytest.mark.parametrize(
    ("source", "problem"),
    [
        (GUARDED, None),
        ("print('hello')\n", "line 1"),
        (GUARDED.replace("if __name__", "main()\nif __name__"), "runs code at import"),
        ("for i in range(3):\n    pass\n", "line 1"),
        ("with open('x') as f:\n    pass\n", "line 1"),
        ("if setup():\n    import x\n", "line 1"),
        ("try:\n    run()\nexcept Exception:\n    pass\n", "line 1"),
        ("if __name__ == '__main__':\n    main()\nelse:\n    main()\n", "line 1"),
        ("def broken(:\n", "cannot be checked"),
    ],
)
def test_what_counts_as_running_code_at_import(
    main_module: Any, source: str, problem: str | None
) -> None:
    main_module(source)
    found = main_module_problem()
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem in found


def test_main_modules_spawn_does_not_rerun(monkeypatch: pytest.MonkeyPatch) -> None:
    for file, spec in ((None, None), ("/x/pkg/__main__.py", "pkg.__main__")):
        fake = types.ModuleType("__main__")
        if file is not None:
            fake.__file__ = file
        fake.__spec__ = types.SimpleNamespace(name=spec) if spec else None  # type: ignore[assignment]
        monkeypatch.setitem(sys.modules, "__main__", fake)
        assert main_module_problem() is None
