"""The synchronous shim: ``dump_data(obj, name)``, a drop-in for verl's tracker.

One process-global tracker runs on its own event loop in a daemon thread (an anyio
``BlockingPortal``), started eagerly on first use, so it works from plain threads, from sync
code and from inside a running event loop (the caller's loop is never used, so it cannot
deadlock). Dumps hand their snapshot to the queue without a round trip to that loop.

At interpreter exit (also at the end of a ``multiprocessing`` child, and on ``SIGTERM`` when
nobody else handles it) the pending dumps are drained under a time budget, with a progress bar
on a terminal; what could not be written is logged. After ``fork()`` the child starts with no
tracker and builds its own on first use: it never inherits the parent's queue, locks or
connections.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing.util
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from anyio.from_thread import BlockingPortal

from trajtrack._exceptions import TrackerClosedError, TrackerStateError
from trajtrack._loop_thread import LoopThread
from trajtrack._progress import Progress
from trajtrack.tracker._environment import (
    DEFAULT_EXIT_TIMEOUT,
    destination_from_env,
    exit_timeout_from_env,
    is_enabled,
    tracker_options_from_env,
)
from trajtrack.tracker._handle import DumpHandle
from trajtrack.tracker._stats import TrackerStatistics
from trajtrack.tracker._tracker import Tracker

__all__ = ["DisabledTracker", "SyncTracker", "dump_data", "get_tracker", "is_enabled"]

logger = logging.getLogger(__name__)

_PROGRESS_AFTER = 1.0  # seconds of silent waiting before a progress bar appears
_CLOSE_GRACE = 5.0  # seconds past the close budget before the shim stops waiting for the tracker


class SyncTracker:
    """A :class:`Tracker` driven from synchronous code through its own event-loop thread.

    Args:
        destination: Where to dump (see :class:`Tracker`).
        exit_timeout: Seconds the drain at interpreter exit may take.
        **options: Passed to :class:`Tracker`.
    """

    enabled = True

    def __init__(
        self,
        destination: str | os.PathLike[str],
        *,
        exit_timeout: float = DEFAULT_EXIT_TIMEOUT,
        **options: Any,
    ) -> None:
        self._pid = os.getpid()
        self._exit_timeout = exit_timeout
        self._closed = False
        self._close_lock = threading.Lock()
        self._tracker = Tracker(destination, **options)
        self._loop = LoopThread("trajtrack")
        self._portal: BlockingPortal = self._loop.portal
        try:
            self._portal.call(self._tracker._admit_early)
        except BaseException:
            self._loop.stop(10)
            raise
        # The storage starts in the background (a dead WebHDFS retries for its whole
        # deadline): dumps queue meanwhile; a failed start fails them, and later ones at once.
        self._starting = self._portal.start_task_soon(self._tracker.start)

    @property
    def tracker(self) -> Tracker:
        """The underlying async tracker (lives on the shim's event loop)."""
        return self._tracker

    def dump(self, obj: Any, name: str, *, timeout: float | None = None) -> DumpHandle:
        """Snapshot *obj* on this thread and queue it; see :meth:`Tracker.dump_threadsafe`."""
        self._check_owner()
        return self._tracker.dump_threadsafe(obj, name, timeout=timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Wait for every dump so far (the original ``wait_for_hdfs``); re-raise a failure."""
        self._check_owner()
        if self._closed:
            raise TrackerClosedError("cannot flush: the tracker is closed")
        self._check_not_own_thread("flush")
        self._portal.call(self._tracker.flush, timeout)

    def statistics(self) -> TrackerStatistics:
        """See :meth:`Tracker.statistics`."""
        return self._tracker.statistics()

    def close(self, timeout: float | None = None, *, progress: bool | None = None) -> None:
        """Drain under *timeout*, stop the event-loop thread; idempotent.

        Args:
            timeout: Seconds to wait for pending dumps (``None``: no limit).
            progress: Show a progress bar on stderr while waiting (default: when stderr is a
                terminal and the wait lasts over a second).
        """
        self._check_not_own_thread("close")
        with self._close_lock:
            if self._closed or os.getpid() != self._pid:
                return
            self._closed = True
        # The tracker bounds its own close, but this thread must not depend on that: past the
        # budget (plus the tracker's grace) give up, so that a process always gets to exit.
        deadline = None if timeout is None else time.monotonic() + timeout + _CLOSE_GRACE
        finished = False
        try:
            future = self._portal.start_task_soon(self._tracker.aclose, timeout)
            self._wait_with_progress(future, progress, deadline)
            if not future.done():
                raise TimeoutError(
                    f"closing {self._tracker.destination}: gave up after {timeout} s; "
                    f"{self.statistics().pending_items} dumps were not written"
                )
            finished = True
            future.result()
        finally:
            self._loop.stop(10 if finished else 1)

    def _wait_with_progress(
        self, future: Any, progress: bool | None, deadline: float | None = None
    ) -> None:
        total = self.statistics().pending_items
        bar: Progress | None = None
        began = time.monotonic()
        try:
            while not future.done() and (deadline is None or time.monotonic() < deadline):
                with contextlib.suppress(TimeoutError):
                    future.exception(timeout=0.2)
                if bar is None and time.monotonic() - began >= _PROGRESS_AFTER and total:
                    bar = Progress(total, "trajtrack: writing pending dumps", enabled=progress)
                if bar is not None:
                    bar.update(total - self.statistics().pending_items)
        finally:
            if bar is not None:
                bar.close()

    def _check_not_own_thread(self, what: str) -> None:
        # Dump callbacks run on the tracker's own thread: waiting there for the tracker would
        # wait for itself.
        if self._loop.on_own_thread():
            raise TrackerStateError(
                f"{what}() cannot be called from the tracker's own thread (e.g. inside a dump "
                "callback); call it from your code's thread"
            )

    def _check_owner(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError("this SyncTracker belongs to the parent process")  # not reached

    def _drain_at_exit(self) -> None:
        if self._closed or os.getpid() != self._pid:
            return
        pending = self.statistics().pending_items
        try:
            self.close(self._exit_timeout)
        except TimeoutError as exc:
            logger.error("trajtrack: %s", exc)
            return
        except Exception as exc:
            logger.error("trajtrack: dumps failed before exit: %s", exc)
            return
        if pending:
            logger.info("trajtrack: wrote %d pending dumps at exit", pending)


# --------------------------------------------------------------------------- the global tracker

_global: SyncTracker | None = None
_global_lock = threading.Lock()
_hooks_installed = False


class DisabledTracker:
    """What :func:`get_tracker` returns while tracking is off: every call does nothing.

    So that the lines around ``dump_data`` (``get_tracker().flush(timeout=60)`` at the end of
    a step) run unchanged in a run that tracks nothing, like ``dump_data`` itself.
    """

    enabled = False

    def dump(self, obj: Any, name: str, *, timeout: float | None = None) -> None:
        """Nothing is dumped (returns ``None``, like :func:`dump_data`)."""

    def flush(self, timeout: float | None = None) -> None:
        """Nothing to wait for; says so once on the ``trajtrack`` logger (info)."""
        global _said_off
        if not _said_off:
            _said_off = True
            logger.info(
                "trajtrack: tracking is off (set VERL_ENABLE_TRACKER=1 or TRAJTRACK_ENABLE=1): "
                "nothing to flush"
            )

    def close(self, timeout: float | None = None, *, progress: bool | None = None) -> None:
        """Nothing to close."""

    def statistics(self) -> TrackerStatistics:
        """All zero: nothing was dumped."""
        return TrackerStatistics(0, 0, 0, 0, 0, 0, {}, 0, 0, 0, None, None, state="disabled")


_said_off = False
_DISABLED = DisabledTracker()


def get_tracker() -> SyncTracker | DisabledTracker:
    """The process-global tracker, created on first use from the environment.

    Destination: ``TRAJTRACK_DIR`` or ``VERL_TRACKER_HDFS_DIR``; exit drain budget:
    ``TRAJTRACK_EXIT_TIMEOUT`` seconds (default 120). While tracking is off (neither
    ``VERL_ENABLE_TRACKER`` nor ``TRAJTRACK_ENABLE`` is ``1``), a :class:`DisabledTracker`
    whose every call does nothing: code written for a tracked run runs as it is.

    Raises:
        ConfigurationError: Tracking is on and no destination is configured.
    """
    if not is_enabled():
        return _DISABLED
    return _enabled_tracker()


def _enabled_tracker() -> SyncTracker:
    global _global
    tracker = _global
    if tracker is not None:
        return tracker
    with _global_lock:
        if _global is None:
            _install_hooks()
            _global = SyncTracker(
                destination_from_env(),
                exit_timeout=exit_timeout_from_env(),
                **tracker_options_from_env(),
            )
            _register_exit(_global)
        return _global


def dump_data(obj: Any, name: str) -> DumpHandle | None:
    """Dump *obj* as *name* through the global tracker; a no-op unless enabled.

    Enabled by ``VERL_ENABLE_TRACKER=1`` (as verl's original) or ``TRAJTRACK_ENABLE=1``.
    Returns the :class:`DumpHandle`, or ``None`` when disabled.
    """
    if not is_enabled():
        return None
    return _enabled_tracker().dump(obj, name)


def _register_exit(tracker: SyncTracker) -> None:
    atexit.register(tracker._drain_at_exit)
    # multiprocessing children end with os._exit(), skipping atexit; their finalizers run.
    multiprocessing.util.Finalize(tracker, tracker._drain_at_exit, exitpriority=100)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    _hooks_installed = True
    os.register_at_fork(after_in_child=_forget_after_fork)
    if (
        os.environ.get("TRAJTRACK_HANDLE_SIGTERM", "1") != "0"
        and threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    ):
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    # Turn SIGTERM into a normal exit, so that the exit drain runs (the default action kills
    # the process without running atexit handlers).
    logger.info("trajtrack: SIGTERM received; draining pending dumps before exiting")
    sys.exit(128 + signum)


def _forget_after_fork() -> None:
    # The child has none of the parent's threads: drop the object without touching its locks.
    global _global, _global_lock
    _global = None
    _global_lock = threading.Lock()


@contextlib.contextmanager
def _reset_for_tests() -> Iterator[None]:
    """Close and forget the global tracker around a test."""
    global _global
    try:
        yield
    finally:
        tracker, _global = _global, None
        if tracker is not None:
            with contextlib.suppress(Exception):
                tracker.close(timeout=30)
