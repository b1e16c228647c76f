"""An event loop on a daemon thread of trajtrack's own, reached through an anyio portal.

The synchronous facades (:class:`~trajtrack.SyncTracker`, :class:`~trajtrack.SyncRun`) run
their async object here. Not anyio's ``start_blocking_portal``: its thread is joined when its
context manager ends, and a facade never closed (a script that raised) leaves that generator
to be finalized at interpreter teardown, when the loop thread can no longer run: the process
then never exits. Nor a ``ThreadPoolExecutor`` worker: the interpreter joins those *before*
atexit handlers run, which would deadlock an exit drain. A daemon thread never holds up exit.
"""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
from anyio.from_thread import BlockingPortal

__all__ = ["LoopThread"]


class LoopThread:
    """An event loop running on a daemon thread until :meth:`stop`.

    Args:
        name: The thread's name.

    Raises:
        BaseException: Whatever starting the event loop raised.
    """

    def __init__(self, name: str) -> None:
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._portal: BlockingPortal | None = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=name, daemon=True)
        self.thread.start()
        self._ready.wait()  # set on every path of _main: the loop serves, or it failed
        if self._error is not None:
            raise self._error

    @property
    def portal(self) -> BlockingPortal:
        """The portal into the loop (``call``, ``start_task_soon``)."""
        assert self._portal is not None  # set before the constructor returns
        return self._portal

    def on_own_thread(self) -> bool:
        """Whether the caller runs on the loop's thread (where waiting for it would deadlock)."""
        return threading.get_ident() == self.thread.ident

    def stop(self, join_timeout: float) -> None:
        """Let the loop end (its tasks are cancelled) and wait up to *join_timeout* seconds."""
        self._stop.set()
        if not self.on_own_thread():
            self.thread.join(timeout=join_timeout)

    def _main(self) -> None:
        try:
            anyio.run(self._serve)
        except BaseException as exc:  # reported to the constructor
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        async with BlockingPortal() as portal:
            self._portal = portal
            self._ready.set()
            await anyio.to_thread.run_sync(self._stop.wait, abandon_on_cancel=True)
