"""Starting, stopping and reaping writer helper processes.

The one place where trajtrack starts a program of its own besides its load worker (SECURITY.md
section 1; an AST test pins the command line below): the running interpreter, isolated
(``-I -S``), on trajtrack's own ``_writer_child.py``, with three numbers -- the socket it
inherits, the staging arena's ``memfd`` (-1 for none) and its size. Nothing from a dump's name
or data reaches the command line. :class:`~._writer_process.WriterProcess` decides when.
"""

from __future__ import annotations

import atexit
import logging
import socket
import subprocess
import sys
from typing import Final

from trajtrack.backends import _writer_child as child
from trajtrack.backends._staging import Arena

__all__ = ["Helper", "orphan", "reap_orphans", "spawn", "stop"]

logger = logging.getLogger("trajtrack")

Helper = subprocess.Popen[bytes]
"""A running helper."""

_CHILD: Final = child.__file__
_ORPHANS: Final[list[Helper]] = []  # helpers of storages dropped unclosed
_AT_EXIT_TIMEOUT: Final = 10.0


def spawn(arena: Arena | None, reply_timeout: float) -> tuple[socket.socket, Helper]:
    """Start a helper (blocking): our end of its socket (with *reply_timeout*), and it."""
    reap_orphans()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    arena_fd, arena_size = (-1, 0) if arena is None else (arena.fd, arena.size)
    inherited = [theirs.fileno()] + ([arena_fd] if arena_fd >= 0 else [])
    try:
        process = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-S",
                _CHILD,
                str(inherited[0]),
                str(arena_fd),
                str(arena_size),
            ],
            pass_fds=inherited,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # out of the terminal's process group: no Ctrl-C
        )
    except BaseException:
        ours.close()
        raise
    finally:
        theirs.close()
    ours.settimeout(reply_timeout)
    return ours, process


def stop(process: Helper, *, kill: bool, timeout: float) -> None:
    """Wait for *process* to exit (its socket closed already), killed first if *kill*, and
    killed after *timeout* seconds."""
    if kill:
        process.kill()
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        logger.warning("trajtrack: the writer process did not exit in %.0f s", timeout)
        process.kill()
        process.wait()


def orphan(process: Helper) -> None:
    """*process* is no one's any more (its socket closed): reaped later, without waiting."""
    if process.poll() is None:
        _ORPHANS.append(process)


def reap_orphans() -> None:
    for process in list(_ORPHANS):
        if process.poll() is not None:
            _ORPHANS.remove(process)


@atexit.register
def _reap_orphans_at_exit() -> None:
    for process in _ORPHANS:
        try:
            process.wait(_AT_EXIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
