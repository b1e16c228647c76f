"""Starting child scenarios (``_child.py``) with deadlines everywhere, and reading their dumps."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from trajtrack.layouts.names import is_internal_path, parse_temp_path
from trajtrack.layouts.records import RECORDS_PREFIX, DumpRecord, decode_segment

CHILD = Path(__file__).with_name("_child.py")
#: Generous: a child that has not answered by then is hung, which is a failure.
CHILD_TIMEOUT = 120.0


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a child: this one, minus tracker settings, plus *extra*."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TRAJTRACK_", "VERL_")) and key not in ("RANK", "LOCAL_RANK")
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


class Child:
    """A running ``_child.py MODE ARGS``; its stdout lines are collected by a thread."""

    def __init__(self, mode: str, *args: object, env: Mapping[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), mode, *map(str, args)],
            env=dict(env) if env is not None else child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []
        self.stderr = ""
        self._errors: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        # stderr is drained all along too: a chatty child must never block on a full pipe
        self._err_reader = threading.Thread(target=self._read_stderr, daemon=True)
        self._err_reader.start()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._errors.append(line)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout.append(line.rstrip("\n"))
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_line(self, prefix: str, timeout: float = CHILD_TIMEOUT) -> str:
        """The next stdout line starting with *prefix*; fails if the child ends or stalls."""
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                self.kill()
                raise AssertionError(f"child said no {prefix!r} within {timeout} s") from None
            if line is None:
                self.finish()
                raise AssertionError(f"child ended without {prefix!r}: {self.stderr[-3000:]}")
            if line.startswith(prefix):
                return line[len(prefix) :].strip()

    def send(self, line: str) -> None:
        """Write one line to the child's stdin (the zygote's commands)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()

    def finish(self, timeout: float = CHILD_TIMEOUT) -> int:
        """Wait for the exit (killing the child past *timeout*, which fails); the exit code."""
        try:
            if self.proc.stdin is not None and not self.proc.stdin.closed:
                self.proc.stdin.close()
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise AssertionError(f"child did not exit within {timeout} s") from None
        self._reader.join(timeout=10)
        self._err_reader.join(timeout=10)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        self.stderr = "".join(self._errors)
        return self.proc.returncode

    def result(self) -> dict[str, Any]:
        """The child's ``RESULT`` JSON line."""
        return json.loads(self.wait_line("RESULT"))  # type: ignore[no-any-return]


def run_child(mode: str, *args: object, env: Mapping[str, str] | None = None) -> Child:
    """Run a child to completion; the finished :class:`Child` (code in ``proc.returncode``)."""
    child = Child(mode, *args, env=env)
    child.finish()
    return child


def sigkill(child: Child) -> None:
    child.signal(signal.SIGKILL)
    assert child.finish() == -signal.SIGKILL


# --------------------------------------------------------------------------- reading a local dir


def final_files(root: Path) -> dict[str, Path]:
    """``{dump name: file}`` of every dump under its final name (what a reader may list)."""
    found = {}
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and not is_internal_path(rel):
            assert rel.endswith(".pth"), rel
            found[rel.removesuffix(".pth")] = path
    return found


def temp_files(root: Path) -> Iterator[tuple[str, tuple[str, int]]]:
    """``(path, (host, pid))`` of every temporary file below *root*."""
    for path in root.rglob("*"):
        rel = path.relative_to(root).as_posix()
        owner = parse_temp_path(rel)
        if path.is_file() and owner is not None:
            yield rel, owner


def records(root: Path) -> list[DumpRecord]:
    """Every record line of every segment below *root*."""
    found: list[DumpRecord] = []
    folder = root / RECORDS_PREFIX
    for segment in sorted(folder.glob("*.jsonl")) if folder.exists() else []:
        parsed, bad = decode_segment(segment.read_bytes())
        assert bad == 0, segment
        found.extend(parsed)
    return found
