"""The stale-file sweep: temporary files that dead writers of this host left behind.

A writer killed between creating its temporary file and renaming it leaves a hidden file
(``.<name>.tmp~<host>~<pid>~<id>``, see :func:`trajtrack.layouts.names.temp_path_for`). At
start a tracker deletes those whose writer runs on this host and is no longer alive; files of
live processes and of other hosts are left alone (their owners may still rename them).
"""

from __future__ import annotations

import logging
import os

from trajtrack._exceptions import StorageError
from trajtrack.backends import Storage
from trajtrack.layouts.names import WriterIdentity, parse_temp_path

__all__ = ["process_alive", "sweep_local", "sweep_stale"]

logger = logging.getLogger(__name__)


async def sweep_stale(storage: Storage, who: WriterIdentity) -> int:
    """Delete the temporary files of dead writers of *who*'s host; returns how many.

    A storage that cannot be listed is logged and skipped (the sweep is housekeeping); a
    failing delete raises.
    """
    try:
        files = await storage.list()
    except StorageError as exc:
        logger.warning("could not list %s to sweep stale temporary files: %s", storage.url, exc)
        return 0
    removed = 0
    for info in files:
        owner = parse_temp_path(info.path)
        if owner is None or owner[0] != who.host or process_alive(owner[1]):
            continue
        logger.info("removing stale temporary file %s (writer pid %d)", info.path, owner[1])
        await storage.delete(info.path)
        removed += 1
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (ours counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


def sweep_local(directory: str, who: WriterIdentity) -> int:
    """Delete this host's dead writers' spool files in a local *directory* (blocking).

    Shards in the making and large snapshots spool there when the destination is remote;
    a killed writer leaves them behind. Returns how many were removed.
    """
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        owner = parse_temp_path(name)
        if owner is None or owner[0] != who.host or process_alive(owner[1]):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except OSError as exc:
            logger.warning("could not remove the stale spool file %s: %s", name, exc)
            continue
        logger.info("removed stale spool file %s (writer pid %d)", name, owner[1])
        removed += 1
    return removed
