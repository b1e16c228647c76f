"""fork() waits for trajtrack's threads to leave torch, so a child never inherits held locks."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from trajtrack.tracker._forkgate import FORK_GATE
from trajtrack.tracker._snapshot import snapshot_plain

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _fork_and_reap() -> None:
    pid = os.fork()
    if pid == 0:
        with FORK_GATE.torch_work():  # the child's gate is fresh and usable
            pass
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_fork_waits_for_torch_work_in_other_threads() -> None:
    entered, release, left = threading.Event(), threading.Event(), threading.Event()

    def worker() -> None:
        with FORK_GATE.torch_work():
            entered.set()
            release.wait(30)
            left.set()  # the last thing before leaving the gate

    thread = threading.Thread(target=worker)
    thread.start()
    assert entered.wait(30)
    releaser = threading.Timer(0.2, release.set)
    releaser.start()
    _fork_and_reap()
    # fork() returned only after the worker had left its torch work (it was inside at the
    # moment fork() was called, and nothing else could have let it out).
    assert left.is_set()
    thread.join(30)
    releaser.join(30)


def test_a_stuck_thread_cannot_block_fork_forever() -> None:
    entered, release = threading.Event(), threading.Event()

    def worker() -> None:
        with FORK_GATE.torch_work():
            entered.set()
            release.wait(60)

    thread = threading.Thread(target=worker)
    thread.start()
    assert entered.wait(30)
    _fork_and_reap()  # returns after the gate's bounded wait although the worker is inside
    assert thread.is_alive()
    release.set()
    thread.join(30)
    with FORK_GATE.torch_work():  # and the gate works normally afterwards
        pass


def _snapshot_during_a_fork(tensor: torch.Tensor) -> bool:
    """Whether ``snapshot_plain`` of *tensor* finishes on another thread while a fork is
    under way (the gate closed); the copy is checked against the source either way."""
    copies: list[dict[str, torch.Tensor]] = []
    FORK_GATE.before_fork()  # what os.fork() runs first: no torch work may start now
    try:
        thread = threading.Thread(
            target=lambda: copies.append(snapshot_plain({"t": tensor}).materialize())
        )
        thread.start()
        thread.join(0.5)
        finished_during_fork = not thread.is_alive()
    finally:
        FORK_GATE.after_fork_in_parent()
    thread.join(30)
    assert torch.equal(copies[0]["t"], tensor)
    assert copies[0]["t"].data_ptr() != tensor.data_ptr()
    return finished_during_fork


def test_a_copy_by_a_torch_op_waits_for_a_fork() -> None:
    # Not contiguous: copied by clone, inside torch (where a fork could catch a held lock).
    assert not _snapshot_during_a_fork(torch.arange(64.0).reshape(8, 8).t())


def test_a_numpy_copy_does_not_wait_for_a_fork() -> None:
    # Small, contiguous, on the CPU: copied through numpy, which takes no torch lock.
    assert _snapshot_during_a_fork(torch.arange(64.0))
