"""The channel's socket directory: a fresh ``0700`` one per actor, and those of dead actors removed.

A killed actor (``ray.kill``, a crash) cannot remove its own directory; the next actor that
starts a channel on the node does, when it is sure the owner is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import stat
import tempfile

__all__ = ["SOCKET_DIR_PREFIX", "fresh_socket_dir", "remove_stale_socket_dirs"]

SOCKET_DIR_PREFIX = "trajtrack-ch-"
"""The socket directory is ``<tmp>/trajtrack-ch-<actor pid>-<random>``: the pid lets the next
actor on the node remove the directory of one that was killed (:func:`remove_stale_socket_dirs`)."""
_SOCKET_DIR = re.compile(re.escape(SOCKET_DIR_PREFIX) + r"(\d+)-")


def fresh_socket_dir(parent: str | None = None) -> str:
    """A new ``0700`` directory for the socket, after removing those of dead actors."""
    parent = parent or tempfile.gettempdir()
    remove_stale_socket_dirs(parent)
    return tempfile.mkdtemp(prefix=f"{SOCKET_DIR_PREFIX}{os.getpid()}-", dir=parent)


def remove_stale_socket_dirs(parent: str) -> list[str]:
    """Remove the socket directories in *parent* left by dead actors of this user.

    A directory is removed only when it is a real directory owned by this user, named for a
    process that no longer exists, and nothing listens on its socket (a process of another
    pid namespace may share the temp dir). Anything else is left alone.

    Returns:
        The directories removed.
    """
    removed = []
    with contextlib.suppress(OSError), os.scandir(parent) as entries:
        candidates = [entry for entry in entries if _SOCKET_DIR.match(entry.name)]
    for entry in candidates:
        match = _SOCKET_DIR.match(entry.name)
        assert match is not None
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            continue
        if _process_exists(int(match.group(1))) or _listening(os.path.join(entry.path, "s")):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):
        return True  # e.g. another user's process: it exists
    return True


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            return False
        except OSError:
            return True  # cannot tell: leave it
        return True
