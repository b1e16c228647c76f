"""The channel's bounds (issue #36), with crafted requests against a real server, no Ray.

Connections and unfinished hellos are capped (one more is answered ``BUSY`` at once), a hello
that goes wrong in any way ends that connection only, a request's bytes come out of a budget
shared by all connections before anything is allocated, a stalled request and an idle
connection are closed, the secret is in no ``repr``, and a killed actor's socket directory is
removed by the next actor.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from _support.require import require_module

require_module("ray", required_by="TRAJTRACK_REQUIRE_RAY", hint="pip install 'trajtrack[ray]'")

from _channel_support import WAIT, Served, reply_of  # noqa: E402  (after the Ray check)

from trajtrack.ray import _connection, _protocol  # noqa: E402  (after the Ray check)
from trajtrack.ray._bounds import ChannelLimits  # noqa: E402  (after the Ray check)
from trajtrack.ray._protocol import REQUEST, ChannelBrokenError  # noqa: E402
from trajtrack.ray._server import ChannelServer  # noqa: E402  (after the Ray check)
from trajtrack.ray._socket_dir import remove_stale_socket_dirs  # noqa: E402


def _until(condition: Callable[[], bool], what: str) -> None:
    """Wait for something the server does on its own loop (a bound, not a measurement)."""
    deadline = time.monotonic() + WAIT
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT} s: {what}")
        time.sleep(0.01)


def test_connections_over_the_cap_are_answered_busy_at_once(serve: Any) -> None:
    served = serve(ChannelLimits(max_connections=2))
    first, second = served.client(), served.client()
    first.dump(b"1", "one")  # each keeps its connection open in its pool
    second.dump(b"2", "two")
    with pytest.raises(ChannelBrokenError, match="full"):
        served.client().dump(b"3", "three")
    assert served.server.counters.busy == 1
    assert [d[1] for d in served.admitted.dumps] == ["one", "two"]
    first.dump(b"4", "four")  # the connections it holds go on
    assert served.server.counters.connections == 2


def test_unfinished_hellos_over_the_cap_are_answered_busy_at_once(serve: Any) -> None:
    # A long hello timeout: a third silent connection refused only after it would mean the
    # cap is not there (the reply would then be REFUSED, not BUSY).
    served = serve(ChannelLimits(max_pending_hellos=2, hello_timeout=3 * WAIT))
    silent = [served.connect(), served.connect()]
    try:
        _until(lambda: served.server._hellos == 2, "two hellos pending")
        with served.connect() as third:
            assert reply_of(third) == (_protocol.BUSY, b"")
            assert third.recv(1) == b""  # and closed
        with pytest.raises(ChannelBrokenError, match="full"):
            served.client().dump(b"x", "meanwhile")
    finally:
        for sock in silent:
            sock.close()
    _until(lambda: served.server._hellos == 0, "the silent ones gone")
    served.client().dump(b"y", "after")
    assert [d[1] for d in served.admitted.dumps] == ["after"]
    assert served.server.counters.busy == 2


class _SocketsThatHelloLate:
    """``_connection``'s view of the socket module, whose sockets send the hello only once the
    server has closed them: the order that made the client report a broken pipe, not ``BUSY``."""

    class socket(socket.socket):  # the name the module looks up
        def connect(self, address: Any) -> None:
            super().connect(address)
            poller = select.poll()
            poller.register(self, select.POLLIN)
            deadline = time.monotonic() + WAIT
            while not any(event & select.POLLHUP for _, event in poller.poll(10)):
                if time.monotonic() > deadline:
                    raise AssertionError(f"the server did not close within {WAIT} s")

    def __getattr__(self, name: str) -> Any:
        return getattr(socket, name)


def test_busy_is_reported_when_the_server_closes_before_the_hello_is_sent(
    serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve(ChannelLimits(max_connections=1))
    served.client().dump(b"1", "one")  # holds the one connection in its pool
    monkeypatch.setattr(_connection, "socket", _SocketsThatHelloLate())
    with pytest.raises(ChannelBrokenError, match="full"):
        served.client().dump(b"2", "two")
    assert served.server.counters.busy == 1


BAD_IDENTITIES = {
    "nested": b"[" * 3000,  # RecursionError inside json
    "object": b'{"host": "h"}',
    "number": b"5",  # TypeError when unpacked
    "four-fields": b'["h", 1, 2, 3]',
    "bool-pid": b'["h", true, 0, 0, 1]',
    "huge-int": b'["h", 1' + b"0" * 400 + b", 0, 0, 1]",
    "float": b'["h", 1e400, 0, 0, 1]',
    "not-utf8": b"\xff\xfe\x00",
    "short": b"",
}


@pytest.mark.parametrize("who", BAD_IDENTITIES.values(), ids=BAD_IDENTITIES.keys())
def test_any_error_in_the_hello_ends_that_connection_only(served: Served, who: bytes) -> None:
    with served.connect() as sock:
        sock.sendall(served.hello(who=who))
        assert reply_of(sock) == (_protocol.REFUSED, b"")
        assert sock.recv(1) == b""
    served.client().dump(b"ok", "after")  # the server goes on
    assert served.admitted.dumps == [(b"ok", "after", ("host-a", 1234, 3, 1, 8))]
    assert served.server.counters.refused == 1


def test_a_request_waits_for_its_share_of_the_budget(serve: Any) -> None:
    served = serve(ChannelLimits(max_payload_bytes=1000, budget_bytes=1000))
    budget = served.server._budget
    with served.connect() as holder:
        holder.sendall(served.hello() + REQUEST.pack(1, 1, 1000) + b"a" + bytes(10))
        assert reply_of(holder) == (_protocol.OK, b"")
        _until(lambda: budget.used == 1000, "the first request's bytes reserved")
        done = threading.Event()
        later = threading.Thread(
            target=lambda: (served.client().dump(bytes(600), "b"), done.set()), daemon=True
        )
        later.start()  # sends its whole request, then waits for its share
        _until(lambda: len(budget._waiters) == 1, "the second request waiting for room")
        assert not done.is_set() and served.admitted.dumps == []
        holder.sendall(bytes(990))  # the rest of the first request
        assert reply_of(holder) == (_protocol.OK, b"")
        later.join(WAIT)
    assert done.is_set()
    assert [d[1] for d in served.admitted.dumps] == ["a", "b"]
    _until(lambda: budget.used == 0, "every byte given back")  # just after the reply


def test_a_header_alone_allocates_nothing(serve: Any) -> None:
    size = 256 << 20
    served = serve(ChannelLimits(max_payload_bytes=size, budget_bytes=size))
    tracemalloc.start()
    try:
        with served.connect() as sock:
            sock.sendall(served.hello() + REQUEST.pack(1, 1, size) + b"n")
            assert reply_of(sock) == (_protocol.OK, b"")
            _until(lambda: served.server._budget.used == size, "the request's bytes reserved")
            _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < size // 8  # reserved, not allocated: no byte of the payload has come


def test_a_stalled_request_is_answered_fatal_and_closed(serve: Any) -> None:
    served = serve(ChannelLimits(progress_timeout=0.2, min_rate=1 << 30))
    with served.connect() as sock:
        sock.sendall(served.hello() + REQUEST.pack(1, 1, 100) + b"n" + bytes(10))
        assert reply_of(sock) == (_protocol.OK, b"")
        status, error = reply_of(sock)  # nothing more is sent
        assert status == _protocol.FATAL and b"TimeoutError" in error
        assert b"did not arrive" in error
        assert sock.recv(1) == b""
    _until(lambda: served.server._budget.used == 0, "the reserved bytes given back")
    served.client().dump(b"ok", "after")
    assert [d[1] for d in served.admitted.dumps] == ["after"]


def test_an_idle_connection_is_closed_and_never_reused_by_a_client(serve: Any) -> None:
    served = serve(ChannelLimits(idle_timeout=0.4))
    with served.connect() as sock:
        sock.sendall(served.hello())
        assert reply_of(sock) == (_protocol.OK, b"")
        assert sock.recv(1) == b""  # closed by the server, no request having come
    client = served.client()
    client.dump(b"1", "first")
    time.sleep(0.25)  # over half the idle timeout, under all of it: reusing would still work
    client.dump(b"2", "second")
    assert served.server.counters.connections == 3  # the raw one, and a fresh one per dump
    assert [d[1] for d in served.admitted.dumps] == ["first", "second"]


def test_the_secret_is_in_no_repr(served: Served) -> None:
    secret = served.server.secret
    client = served.client()
    for thing in (served.endpoints, served.server, client):
        for text in (repr(thing), str(thing)):
            assert secret.hex() not in text and repr(secret) not in text
            assert secret.hex().upper() not in text


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path (a Unix socket's path is limited to ~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="tt-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(WAIT)
    return child.pid


def test_the_socket_dirs_of_dead_actors_are_removed_and_nothing_else(short_tmp: Path) -> None:
    dead = _dead_pid()
    stale = short_tmp / f"trajtrack-ch-{dead}-abc"
    (stale / "sub").mkdir(parents=True)
    (stale / "s").write_bytes(b"")  # a socket file nobody listens on any more
    alive = short_tmp / f"trajtrack-ch-{os.getpid()}-abc"
    alive.mkdir()
    listening = short_tmp / f"trajtrack-ch-{dead}-lst"  # dead pid, but something listens
    listening.mkdir()
    target = short_tmp / "elsewhere"
    target.mkdir()
    (short_tmp / f"trajtrack-ch-{dead}-lnk").symlink_to(target)
    (short_tmp / "unrelated").mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(listening / "s"))
        server.listen()
        removed = remove_stale_socket_dirs(str(short_tmp))
    assert removed == [str(stale)]
    assert sorted(p.name for p in short_tmp.iterdir()) == sorted(
        [alive.name, listening.name, "elsewhere", f"trajtrack-ch-{dead}-lnk", "unrelated"]
    )


def test_a_new_server_removes_a_killed_ones_dir(
    loop: Any, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    stale = short_tmp / f"trajtrack-ch-{_dead_pid()}-xyz"
    stale.mkdir()

    async def admit(*_: Any) -> None:
        return None

    server = ChannelServer(admit)
    endpoints = loop.run(server.start)
    try:
        assert endpoints is not None
        assert not stale.exists()
        assert Path(endpoints.unix_path).parent.name.startswith(f"trajtrack-ch-{os.getpid()}-")
    finally:
        loop.run(server.aclose)
    assert list(short_tmp.iterdir()) == []
