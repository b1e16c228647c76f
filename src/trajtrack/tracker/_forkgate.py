"""Keeps ``fork()`` from happening while one of trajtrack's threads is inside torch."""

from __future__ import annotations

import os
import threading
import time
from typing import Final

__all__ = ["FORK_GATE", "FORK_WAIT"]

FORK_WAIT: Final = 2.0  # seconds fork() waits for our threads to leave torch


class _ForkGate:
    """Keeps ``fork()`` from happening while one of our threads is inside torch.

    A child inherits every lock held at the moment of the fork, but none of the threads that
    would release them: if an upload thread is inside ``torch.save`` (or a snapshot's ``clone``;
    a copy through numpy takes no torch lock) when the user's code forks, torch locks it held
    stay locked in the child. Before a fork, this gate stops new torch work by trajtrack's
    threads and waits for the current work to end, at most :data:`FORK_WAIT` seconds (never a
    long block for the fork).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._forking = False
        self._work = _TorchWork(self)

    def torch_work(self) -> _TorchWork:
        """``with FORK_GATE.torch_work():`` around torch work in one of our threads."""
        return self._work

    def enter(self) -> None:
        with self._cond:
            while self._forking:
                self._cond.wait()
            self._active += 1

    def leave(self) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def before_fork(self) -> None:
        self._cond.acquire()  # held across the fork: no torch work starts meanwhile
        self._forking = True
        deadline = time.monotonic() + FORK_WAIT
        while self._active:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._cond.wait(remaining)

    def after_fork_in_parent(self) -> None:
        self._forking = False
        self._cond.notify_all()
        self._cond.release()

    def after_fork_in_child(self) -> None:
        self.__init__()  # type: ignore[misc]  # the child has none of the parent's threads


class _TorchWork:
    """The gate's context manager: a class, not a generator (it runs on every small dump)."""

    __slots__ = ("_gate",)

    def __init__(self, gate: _ForkGate) -> None:
        self._gate = gate

    def __enter__(self) -> None:
        self._gate.enter()

    def __exit__(self, *exc_info: object) -> None:
        self._gate.leave()


FORK_GATE = _ForkGate()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=FORK_GATE.before_fork,
        after_in_parent=FORK_GATE.after_fork_in_parent,
        after_in_child=FORK_GATE.after_fork_in_child,
    )
