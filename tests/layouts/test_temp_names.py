"""Temporary names stay unique across a fork: the child salts anew (it has another pid)."""

from __future__ import annotations

import os

from trajtrack.layouts.names import WriterIdentity, temp_path_for


def test_a_forked_child_never_repeats_its_parents_temporary_names() -> None:
    who = WriterIdentity.current()
    temp_path_for("x", who)  # the parent's salt is drawn before the fork
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next names, as the parent's would be
        try:
            os.write(write, "\n".join(temp_path_for("x", who) for _ in range(3)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        child = pipe.read().split("\n")
    os.waitpid(pid, 0)
    parent = [temp_path_for("x", who) for _ in range(3)]
    # The same identity (host, pid field) on both sides: only the salt tells them apart.
    assert len(child) == 3
    assert not set(child) & set(parent)
