"""A forked child forgets the parent's cached actors and channels (no Ray instance needed).

Each process keeps what it learnt of the tracker actor (handle, job, channel client) in a
module cache. A ``fork()``ed child must not use the parent's: two processes writing frames on
one socket would mix them. It abandons the inherited channel (closing its copies of the idle
sockets, never the parent's) and looks the actor up again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()"),
]

KEY = ("trajtrack-test-fork", "trajtrack-test")


class RecordingChannel:
    """Stands in for the channel client: records, through a pipe, that it was abandoned."""

    def __init__(self, write_end: int) -> None:
        self.write_end = write_end

    def abandon_after_fork(self) -> None:
        os.write(self.write_end, b"abandoned by %d\n" % os.getpid())


@pytest.fixture(autouse=True)
def _forget_the_test_entry() -> Iterator[None]:
    pytest.importorskip("ray")  # skips only without Ray, which CI installs
    yield
    from trajtrack.ray import _discovery

    _discovery._cache.pop(KEY, None)


def test_a_forked_child_forgets_the_parents_actor_and_abandons_its_channel() -> None:
    from trajtrack.ray import _discovery

    read_end, write_end = os.pipe()
    handle = object()
    _discovery._cache[KEY] = _discovery.Cached(handle, "job-1", RecordingChannel(write_end))  # type: ignore[arg-type]
    assert _discovery.cached(KEY) is not None  # the parent's own entry
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            code = 0 if _discovery.cached(KEY) is None else 2
        finally:
            os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    said = os.read(read_end, 1000).decode()
    os.close(read_end)
    assert os.waitstatus_to_exitcode(status) == 0
    assert said == f"abandoned by {pid}\n"  # by the child, once; never by the parent
    entry = _discovery.cached(KEY)
    assert entry is not None and entry.handle is handle  # the parent keeps its entry
