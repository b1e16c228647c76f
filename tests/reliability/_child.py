"""Child processes for the reliability suite: ``python _child.py MODE ARGS...``.

Each mode is one scenario that needs a process of its own (to be killed, to exit, to fork, or to
be one of several writers). Payloads come from :mod:`_payloads`, so the parent recomputes what
should be on disk. Children say ``READY`` on stdout when the parent may act, and report results
as one JSON line starting with ``RESULT``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
from _payloads import KIB, payload_for

import trajtrack
from trajtrack.backends import register_backend
from trajtrack.backends.local import LocalStorage
from trajtrack.backends.memory import MemoryStorage


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class SlowLocalStorage(LocalStorage):
    """The local backend with a fixed delay per write, so that dumps stay pending for a while."""

    delay = 0.01

    def _write_sync(self, path: str, payload: Any, overwrite: bool, *rest: Any) -> Any:
        time.sleep(self.delay)
        return super()._write_sync(path, payload, overwrite, *rest)


class _ThrottledOut:
    """A file wrapper that pauses 20 ms per 256 KB written and 10 ms per flush: a slow disk."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self._since_pause = 0

    def write(self, data: Any) -> int:
        written: int = self._out.write(data)
        self._since_pause += written
        if self._since_pause >= 256 * KIB:
            self._since_pause = 0
            time.sleep(0.02)
        return written

    def flush(self) -> None:
        time.sleep(0.01)
        self._out.flush()


class _ThrottledPayload:
    def __init__(self, payload: Any) -> None:
        self._payload = payload
        self.nbytes = payload.nbytes

    def write_to(self, out: Any) -> None:
        self._payload.write_to(_ThrottledOut(out))


class ThrottledLocalStorage(LocalStorage):
    """The local backend writing at a slow disk's pace, so uploads are often mid-write.

    Batches of small files, and the dumps of 64 KiB to 2 MB staged in its shared memory, go to
    the writer process, unthrottled: the kills land on both paths.
    """

    def _write_temp(self, directory: int, temp: str, payload: Any) -> Any:
        return super()._write_temp(directory, temp, _ThrottledPayload(payload))


def _throttled_factory(url: str, **options: Any) -> LocalStorage:
    return ThrottledLocalStorage(url.removeprefix("slowdisk://"), **options)


def _slow_factory(url: str, **options: Any) -> LocalStorage:
    return SlowLocalStorage(url.removeprefix("slowfile://"), **options)


def _hanging_factory(url: str, **_options: Any) -> MemoryStorage:
    """``hang://<n>``: a storage that answers *n* writes, then never answers again."""
    never = threading.Event()
    answered = [int(url.removeprefix("hang://") or 0)]
    lock = threading.Lock()

    def fault(operation: str, _path: str) -> None:
        if operation != "write":
            return
        with lock:
            answered[0] -= 1
            hang = answered[0] < 0
        if hang:
            never.wait()  # no timeout on purpose: the storage is gone

    return MemoryStorage("memory://hang", fault=fault)


register_backend("slowfile", _slow_factory)
register_backend("hang", _hanging_factory)
register_backend("slowdisk", _throttled_factory)


# --------------------------------------------------------------------------- crash


async def crash(dest: str, prefix: str, tasks: int, high: int, layout: str = "files") -> None:
    """Dump a stream of mixed-size payloads until killed; READY after the first commit.

    With ``layout="shards"``: small shards sealed often (256 KiB, 0.2 s), so that kills land
    while shards are being appended to, sealed, uploaded and renamed.
    """
    options: dict[str, Any] = {}
    if layout == "shards":
        options = {"layout": "shards", "shard_max_bytes": 256 * KIB, "shard_max_age": 0.2}
    async with trajtrack.Tracker(dest, workers=4, record_interval=0.2, **options) as tracker:
        first = anyio.Event()

        async def producer(task: int) -> None:
            for i in range(1_000_000):
                name = f"{prefix}/t{task}/d{i}"
                handle = await tracker.dump(payload_for(name, KIB, high), name)
                await anyio.lowlevel.checkpoint()  # a rollouter awaits other work between dumps
                if not first.is_set():
                    await handle
                    first.set()

        async with anyio.create_task_group() as group:
            for task in range(tasks):
                group.start_soon(producer, task)
            await first.wait()
            say("READY")


# --------------------------------------------------------------------------- exit paths


def shim_dumps(count: int, prefix: str) -> None:
    for i in range(count):
        name = f"{prefix}/d{i}"
        trajtrack.dump_data(payload_for(name, KIB, 16 * KIB), name)


def exit_pending(count: int) -> None:
    """Dump through the sync shim, never flush, return: the exit drain must write them all."""
    shim_dumps(count, "exit")
    stats = trajtrack.get_tracker().statistics()
    say(f"RESULT {json.dumps({'pending_at_return': stats.pending_items})}")


def sigterm(count: int) -> None:
    """Dump through the shim, then idle until SIGTERM (which the shim turns into an exit)."""
    shim_dumps(count, "term")
    say(f"READY {trajtrack.get_tracker().statistics().pending_items}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.05)
    sys.exit(3)  # no signal came


def hang(count: int) -> None:
    """Dump to a storage that never answers, then return: the exit must still end."""
    shim_dumps(count, "hang")
    say("READY")


async def scoped(dest: str, count: int, how: str) -> None:
    """Leave a running ``async with Tracker`` by ``sys.exit`` or an exception, dumps pending."""
    async with trajtrack.Tracker(dest, storage=SlowLocalStorage(dest)) as tracker:
        for i in range(count):
            name = f"scoped/d{i}"
            await tracker.dump(payload_for(name, KIB, 16 * KIB), name)
        say(f"READY {tracker.statistics().pending_items}")
        if how == "exit":
            sys.exit(7)
        raise RuntimeError("the training loop crashed")


# --------------------------------------------------------------------------- fork


def _parent_stream(count: int, started: threading.Event) -> None:
    for i in range(count):
        name = f"parent/d{i}"
        trajtrack.dump_data(payload_for(name, KIB, 64 * KIB), name)
        if i == count // 4:
            started.set()


def _child_work(count: int) -> None:
    # A fresh global tracker: the parent's queue, loop thread and locks are not inherited.
    for i in range(count):
        name = f"child{os.getpid()}/d{i}"
        trajtrack.dump_data(payload_for(name, KIB, 64 * KIB), name)


def _child_and_flush(count: int) -> None:
    _child_work(count)
    trajtrack.get_tracker().flush(timeout=60)


def fork(method: str, parent_count: int, child_count: int) -> None:
    """Fork while the global tracker is busy; the child dumps its own data."""
    started = threading.Event()
    producer = threading.Thread(target=_parent_stream, args=(parent_count, started))
    producer.start()
    started.wait(60)
    busy = trajtrack.get_tracker().statistics().pending_items
    if method == "os":
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _child_and_flush(child_count)
                trajtrack.get_tracker().close(timeout=60)
                code = 0
            finally:
                os._exit(code)
        deadline = time.monotonic() + 90
        status = None
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
        exit_code = os.waitstatus_to_exitcode(status) if status is not None else None
        child_pid = pid
    else:
        context = multiprocessing.get_context("fork")
        # No flush in the child: the multiprocessing finalizer must drain it at exit.
        process = context.Process(target=_child_work, args=(child_count,))
        process.start()
        process.join(90)
        if process.is_alive():
            process.kill()
        exit_code, child_pid = process.exitcode, process.pid
    producer.join(90)
    result = {"busy_at_fork": busy, "child_exit": exit_code, "child_pid": child_pid}
    say(f"RESULT {json.dumps(result)}")


# --------------------------------------------------------------------------- ranks


async def ranks(dest: str, template: str, on_exists: str, tasks: int, per_task: int) -> None:
    """One of several processes writing one directory; reports what it committed."""
    rank = int(os.environ["RANK"])
    committed: list[str] = []
    exists: list[str] = []
    other: list[str] = []
    async with trajtrack.Tracker(
        dest,
        name_template=template,
        on_exists=on_exists,  # type: ignore[arg-type]
    ) as tracker:

        async def task(t: int) -> None:
            for j in range(per_task):
                name = f"s{j}/task{t}"
                handle = await tracker.dump(payload_for(f"{name}@{rank}", KIB, 64 * KIB), name)
                try:
                    record = await handle
                except trajtrack.DumpExistsError:
                    exists.append(name)
                except Exception as exc:
                    other.append(f"{name}: {exc!r}")
                else:
                    committed.append(record.path)

        async with anyio.create_task_group() as group:
            for t in range(tasks):
                group.start_soon(task, t)
        with contextlib.suppress(trajtrack.DumpExistsError):  # counted per handle above
            await tracker.flush(timeout=60)
    result = {"rank": rank, "committed": committed, "exists": exists, "other": other}
    say(f"RESULT {json.dumps(result)}")


def zygote() -> None:
    """Import everything once, then fork one scenario per stdin line (fast repeated trials).

    Each line is ``MODE ARGS...``; the forked child announces ``PID <pid>`` and runs the mode;
    the zygote reaps it and says ``EXIT <pid> <status>``. Nothing here starts a thread before
    forking, so the children are clean.
    """
    say("ZYGOTE")
    for line in sys.stdin:
        argv = line.split()
        if not argv:
            continue
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                say(f"PID {os.getpid()}")
                main(argv)
                code = 0
            finally:
                sys.stdout.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        say(f"EXIT {pid} {os.waitstatus_to_exitcode(status)}")


def main(argv: list[str]) -> None:
    mode, args = argv[0], argv[1:]
    if mode == "zygote":
        zygote()
        return
    if mode == "crash":
        anyio.run(crash, args[0], args[1], int(args[2]), int(args[3]), *args[4:])
    elif mode == "exit_pending":
        exit_pending(int(args[0]))
    elif mode == "sigterm":
        sigterm(int(args[0]))
    elif mode == "hang":
        hang(int(args[0]))
    elif mode == "scoped":
        anyio.run(scoped, args[0], int(args[1]), args[2])
    elif mode == "fork":
        fork(args[0], int(args[1]), int(args[2]))
    elif mode == "ranks":
        anyio.run(ranks, args[0], args[1], args[2], int(args[3]), int(args[4]))
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
