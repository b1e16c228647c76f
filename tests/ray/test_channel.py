"""The direct channel's protocol: a real server on a real asyncio loop, a real client.

No Ray cluster here (the channel's modules have no Ray import; the package needs Ray): the server
admits into a list, or raises what a tracker would raise, so that every reply the client can
get is exercised. The Ray end to end tests are in test_ray_channel.py.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from _support.require import require_module

require_module("ray", required_by="TRAJTRACK_REQUIRE_RAY", hint="pip install 'trajtrack[ray]'")

from _channel_support import (  # noqa: E402  (after the Ray check)
    WAIT,
    WHO,
    Loop,
    Served,
    make_event,
    reply_of,
)

from trajtrack import (  # noqa: E402  (after the Ray check)
    StorageUnavailableError,
    TrackerClosedError,
    TrajtrackError,
)
from trajtrack.ray import _protocol  # noqa: E402  (after the Ray check)
from trajtrack.ray._bounds import ChannelLimits  # noqa: E402  (after the Ray check)
from trajtrack.ray._connection import ChannelClient  # noqa: E402  (after the Ray check)
from trajtrack.ray._protocol import (  # noqa: E402  (after the Ray check)
    MAX_ERROR_BYTES,
    ChannelBrokenError,
    Endpoints,
    decode_error,
    encode_error,
)
from trajtrack.ray._wire_decode import decode  # noqa: E402  (after the Ray check)
from trajtrack.ray._wire_encode import encode  # noqa: E402  (after the Ray check)


def test_dumps_arrive_in_order_with_name_bytes_and_writer(served: Served) -> None:
    client = served.client()
    payloads = [os.urandom(n) for n in (0, 1, 4096, 300_000, 3 << 20)]  # inline and streamed
    for index, data in enumerate(payloads):
        client.dump(data, f"step{index}/obs")
    assert [d[1] for d in served.admitted.dumps] == [f"step{i}/obs" for i in range(5)]
    assert [d[0] for d in served.admitted.dumps] == payloads
    assert {d[2] for d in served.admitted.dumps} == {WHO}
    assert served.server.counters.as_dict() == {
        "connections": 1,
        "refused": 0,
        "busy": 0,
        "dumps": 5,
        "errors": 0,
    }


def test_plain_data_travels_as_its_own_kind_and_decodes_equal(served: Served) -> None:
    obj = {"obs": torch.randn(64, 33), "step": 7, "mask": torch.ones(5, dtype=torch.bool)}
    served.client().dump(encode(obj), "plain")
    served.client().dump(b"serialized", "bytes")
    assert served.admitted.kinds == [_protocol.KIND_PLAIN, _protocol.KIND_DUMP]
    decoded, _ = decode(bytearray(served.admitted.dumps[0][0]))
    assert decoded.keys() == obj.keys() and decoded["step"] == 7
    assert torch.equal(decoded["obs"], obj["obs"]) and torch.equal(decoded["mask"], obj["mask"])


def test_a_large_plain_payload_streams_part_by_part(served: Served) -> None:
    big = torch.arange(1 << 20, dtype=torch.float64)  # 8 MB: sent in parts, not joined
    served.client().dump(encode({"big": big}), "big")
    decoded, nbytes = decode(bytearray(served.admitted.dumps[0][0]))
    assert torch.equal(decoded["big"], big)
    assert nbytes >= big.numel() * 8


def test_the_unix_socket_is_private_to_the_actors_user(served: Served) -> None:
    mode = Path(served.endpoints.unix_path).parent.stat().st_mode & 0o777
    assert mode == 0o700


def test_a_wrong_secret_is_refused_and_nothing_is_admitted(served: Served) -> None:
    wrong = dataclasses.replace(served.endpoints, secret=bytes(32))
    client = ChannelClient(wrong, WHO)
    with pytest.raises(ChannelBrokenError, match="refused"):
        client.dump(b"x", "sneaky")
    assert served.admitted.dumps == []
    assert served.server.counters.refused == 1
    assert served.server.counters.connections == 0


@pytest.mark.parametrize(
    "hello",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(20),  # not our protocol
        b"TTRK\x63" + bytes(34),  # a future protocol version
    ],
    ids=["http", "version"],
)
def test_a_foreign_hello_is_refused(served: Served, hello: bytes) -> None:
    with served.connect() as sock:
        sock.sendall(hello)
        assert reply_of(sock) == (_protocol.REFUSED, b"")
        assert sock.recv(1) == b""  # and the server hangs up
    assert served.server.counters.refused == 1


def test_a_silent_connection_is_closed_after_the_hello_timeout(serve: Any) -> None:
    served = serve(ChannelLimits(hello_timeout=0.2))
    with served.connect() as sock:
        assert reply_of(sock) == (_protocol.REFUSED, b"")  # sent nothing: refused on timeout
        assert sock.recv(1) == b""
    assert served.server.counters.refused == 1


def test_the_actors_errors_come_back_typed_and_the_connection_goes_on(served: Served) -> None:
    served.admitted.fail["closed"] = TrackerClosedError("the tracker is closed")
    served.admitted.fail["down"] = StorageUnavailableError("namenode is in safe mode")
    served.admitted.fail["odd"] = ZeroDivisionError("odd one")
    client = served.client()
    with pytest.raises(TrackerClosedError, match="the tracker is closed"):
        client.dump(b"1", "closed")
    with pytest.raises(StorageUnavailableError, match="safe mode"):
        client.dump(b"2", "down")
    with pytest.raises(TrajtrackError, match="ZeroDivisionError: odd one"):
        client.dump(b"3", "odd")
    client.dump(b"4", "fine")  # same connection: the errors did not break it
    assert served.admitted.dumps == [(b"4", "fine", WHO)]
    assert served.server.counters.connections == 1
    assert served.server.counters.errors == 3


@pytest.mark.parametrize(
    "unit", ["x", '"', "\u00e9", "\U0001f600"], ids=["ascii", "quote", "e", "emoji"]
)
def test_a_one_megabyte_error_message_comes_back_readable(served: Served, unit: str) -> None:
    # The reply is bounded; what is cut is the message, not its JSON encoding.
    message = unit * (1 << 20)
    served.admitted.fail["long"] = StorageUnavailableError(message)
    client = served.client()
    with pytest.raises(StorageUnavailableError) as raised:
        client.dump(b"1", "long")
    text = str(raised.value)
    assert text.startswith(unit * 100)
    assert "characters cut" in text
    assert len(encode_error(StorageUnavailableError(message))) <= MAX_ERROR_BYTES
    client.dump(b"2", "after")  # the channel survived the reply
    assert served.admitted.dumps == [(b"2", "after", WHO)]


def test_a_short_error_message_is_not_cut() -> None:
    raw = encode_error(ValueError("small"))
    assert str(decode_error(raw)) == "small"


def test_a_batch_gets_one_reply_per_dump_in_order(served: Served) -> None:
    served.admitted.fail["b2"] = TrackerClosedError("no")
    client = served.client()
    failures = client.dump_many([(b"%d" % i, f"b{i}") for i in range(5)])
    assert [(index, type(error)) for index, error in failures] == [(2, TrackerClosedError)]
    assert [d[1] for d in served.admitted.dumps] == ["b0", "b1", "b3", "b4"]


def test_an_oversized_request_is_refused_and_the_server_keeps_serving(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(served.hello() + _protocol.REQUEST.pack(1, _protocol.MAX_NAME_BYTES + 1, 0))
        assert reply_of(sock) == (_protocol.OK, b"")  # the hello
        status, error = reply_of(sock)
        assert status == _protocol.FATAL  # an error after which the server hangs up
        assert b"bad request" in error
        assert sock.recv(1) == b""  # the stream cannot be resynchronized: closed
    served.client().dump(b"ok", "after")
    assert served.admitted.dumps == [(b"ok", "after", WHO)]


def test_many_threads_share_the_pool_and_keep_their_own_order(served: Served) -> None:
    client = served.client()
    errors: list[BaseException] = []

    def writer(thread: int) -> None:
        try:
            for i in range(40):
                client.dump(b"%d/%d" % (thread, i), f"t{thread}/{i}")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert errors == []
    names = [d[1] for d in served.admitted.dumps]
    assert len(names) == 240
    for t in range(6):
        assert [n for n in names if n.startswith(f"t{t}/")] == [f"t{t}/{i}" for i in range(40)]
    assert served.server.counters.connections <= 6  # pooled, not one per dump


def test_a_reply_that_does_not_come_times_out(served: Served, loop: Loop) -> None:
    event = loop.run(make_event)
    served.admitted.hold["stuck"] = event
    client = served.client(reply_timeout=0.3)
    with pytest.raises(TimeoutError, match="did not acknowledge"):
        client.dump(b"x", "stuck")
    loop.loop.call_soon_threadsafe(event.set)
    served.client().dump(b"y", "next")  # the server goes on (default reply timeout here)
    assert "next" in [d[1] for d in served.admitted.dumps]


def test_a_closed_server_breaks_the_channel(served: Served, loop: Loop) -> None:
    client = served.client()
    client.dump(b"1", "before")
    loop.run(served.server.aclose)
    with pytest.raises(ChannelBrokenError):
        client.dump(b"2", "after")
    with pytest.raises(ChannelBrokenError, match="cannot open"):
        client.dump(b"3", "again")  # nothing listens any more
    assert [d[1] for d in served.admitted.dumps] == ["before"]
    assert not Path(served.endpoints.unix_path).parent.exists()  # the socket's folder is gone


def test_a_broken_batch_says_how_many_replies_came(served: Served, loop: Loop) -> None:
    client = served.client()
    client.dump(b"0", "warm")  # an idle pooled connection, then the server goes away
    loop.run(served.server.aclose)
    with pytest.raises(ChannelBrokenError) as caught:
        client.dump_many([(b"1", "a"), (b"2", "b")])
    assert caught.value.replies == 0
    assert caught.value.failures == []


def test_a_forked_child_closes_its_inherited_idle_sockets(served: Served) -> None:
    client = served.client()
    client.dump(b"1", "parent")
    (connection,) = client._idle
    client.abandon_after_fork()  # what the child does
    assert connection.sock.fileno() == -1
    assert client._idle == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_never_uses_the_parents_connection(served: Served) -> None:
    """Even without ``abandon_after_fork``, a connection opened before a fork stays the
    parent's: the child opens its own (two processes on one socket would mix their frames)."""
    client = served.client()
    client.dump(b"1", "parent/before")
    (inherited,) = client._idle
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        code = 1
        try:
            connection = client._acquire()
            mine = connection is not inherited and connection.sock is not inherited.sock
            client._release(connection)
            client.dump(b"2", "child")
            code = 0 if mine and inherited not in client._idle else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    client.dump(b"3", "parent/after")  # the parent's pooled connection still works
    assert client._idle == [inherited]
    assert [d[1] for d in served.admitted.dumps] == ["parent/before", "child", "parent/after"]


def test_endpoints_survive_their_trip_through_a_dict(served: Served) -> None:
    assert Endpoints.from_dict(served.endpoints.as_dict()) == served.endpoints


def test_a_payload_over_the_servers_limit_is_refused_with_a_clear_error(serve: Any) -> None:
    served = serve(ChannelLimits(max_payload_bytes=1000, budget_bytes=1000))
    client = served.client()
    assert client.carries(1000) and not client.carries(1001)  # callers send it as a Ray call
    with pytest.raises(ValueError, match="payload 2000 bytes"):
        client.dump(bytes(2000), "too/big")  # a client that sends it anyway
    client.dump(bytes(1000), "fits")  # a new connection; the server goes on
    assert [d[1] for d in served.admitted.dumps] == ["fits"]
