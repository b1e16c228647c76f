"""The direct channel end to end, on the real local Ray cluster (see conftest.py).

The protocol itself is tested in test_channel.py (its bounds in test_channel_bounds.py, other
nodes in test_ray_nodes.py); here: that a process on the actor's node uses the channel, that
``TRAJTRACK_RAY_CHANNEL=off`` really sends Ray calls, and that a process whose channel fails
still delivers its dumps (as Ray calls) and says so.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from trajtrack import ConfigurationError, TrackerClosedError

RAY_TIMEOUT = 90  # seconds for any single wait on the cluster

pytestmark = pytest.mark.ray


def _cached_channel() -> Any:
    from trajtrack.ray import _discovery

    return _discovery.current().channel


def _stored(dest: Path, name: str) -> Any:
    return torch.load(dest / f"{name}.pth", weights_only=True)


def test_the_channel_carries_acknowledged_and_pipelined_dumps(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import ray

    import trajtrack.ray as tr

    for i in range(3):
        tr.dump_data({"i": torch.tensor(i)}, f"ack{i}")
        tr.dump_data({"i": torch.tensor(10 + i)}, f"pipe{i}", wait=False)
    tr.flush(timeout=RAY_TIMEOUT)

    assert _cached_channel() is not None
    for i in range(3):
        assert int(_stored(tracker_env["dest"], f"ack{i}")["i"]) == i
        assert int(_stored(tracker_env["dest"], f"pipe{i}")["i"]) == 10 + i
    actor = tr.get_trajectory_tracker()
    counters = ray.get(actor.channel_statistics.remote(), timeout=RAY_TIMEOUT)
    assert counters["dumps"] == 6 and counters["errors"] == 0 and counters["refused"] == 0


def test_channel_off_sends_every_dump_as_a_ray_call(
    ray_cluster: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    import trajtrack.ray as tr

    monkeypatch.setenv("TRAJTRACK_RAY_CHANNEL", "off")
    tr.dump_data({"x": torch.ones(2)}, "ray/ack")
    tr.dump_data({"x": torch.ones(3)}, "ray/pipe", wait=False)
    tr.flush(timeout=RAY_TIMEOUT)

    actor = tr.get_trajectory_tracker()
    info = ray.get(actor.ready.remote(), timeout=RAY_TIMEOUT)
    assert info["channel"] is None  # the actor, created with "off", does not even listen
    assert ray.get(actor.channel_statistics.remote(), timeout=RAY_TIMEOUT) == {}
    assert _cached_channel() is None
    assert _stored(tracker_env["dest"], "ray/ack")["x"].shape == (2,)
    assert _stored(tracker_env["dest"], "ray/pipe")["x"].shape == (3,)


def test_a_failed_channel_falls_back_to_ray_calls_and_says_so(
    ray_cluster: Any, tracker_env: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    import ray

    import trajtrack.ray as tr
    from trajtrack.ray import _discovery
    from trajtrack.ray._connection import ChannelClient

    tr.dump_data({"x": torch.ones(1)}, "over/channel")
    cached = _discovery.current()
    real = cached.channel
    wrong = dataclasses.replace(real.endpoints, secret=bytes(32))
    cached.channel = ChannelClient(wrong, real.who)  # a secret the actor refuses
    real.close()

    with caplog.at_level(logging.WARNING, logger="trajtrack"):
        tr.dump_data({"x": torch.ones(2)}, "over/ray")  # acknowledged: lands anyway
    tr.flush(timeout=RAY_TIMEOUT)

    assert _stored(tracker_env["dest"], "over/ray")["x"].shape == (2,)
    assert cached.channel is None  # this process stays on Ray calls
    assert "sends its dumps to that actor as Ray calls from now on" in caplog.text
    counters = ray.get(tr.get_trajectory_tracker().channel_statistics.remote(), timeout=90)
    assert counters["refused"] == 1 and counters["dumps"] == 1


def test_a_closed_actor_refuses_dumps_with_a_typed_error(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import ray

    import trajtrack.ray as tr

    tr.dump_data({"x": torch.ones(1)}, "first")
    ray.get(tr.get_trajectory_tracker().close.remote(RAY_TIMEOUT), timeout=RAY_TIMEOUT)
    with pytest.raises(TrackerClosedError):
        tr.dump_data({"x": torch.ones(1)}, "too/late")
    assert (tracker_env["dest"] / "first.pth").exists()
    assert not (tracker_env["dest"] / "too").exists()


@pytest.mark.parametrize(
    ("mode", "says"), [("carrier-pigeon", "expected one of auto, off"), ("tcp", "TCP channel")]
)
def test_an_unknown_channel_mode_is_a_configuration_error(
    ray_cluster: Any,
    tracker_env: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    mode: str,
    says: str,
) -> None:
    import trajtrack.ray as tr

    monkeypatch.setenv("TRAJTRACK_RAY_CHANNEL", mode)
    with pytest.raises(ConfigurationError, match=says):
        tr.dump_data({"x": torch.ones(1)}, "never")
    assert not (tracker_env["dest"] / "never.pth").exists()


def test_plain_and_other_objects_both_land_equal_in_both_modes(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import collections

    import numpy as np

    import trajtrack.ray as tr

    plain = {
        "obs": torch.randn(3, 4, dtype=torch.bfloat16),
        "ids": np.arange(5, dtype=np.int32),
        "meta": {"step": 3, "tag": "x", "ratio": 0.5, "flags": (True, None)},
    }
    other = collections.OrderedDict(a=torch.ones(2), b=[1, 2])  # not plain: torch.save bytes
    for wait in (True, False):
        tr.dump_data(plain, f"plain_{wait}", wait=wait)
        tr.dump_data(other, f"other_{wait}", wait=wait)
    tr.flush(timeout=RAY_TIMEOUT)

    for wait in (True, False):
        stored = torch.load(
            tracker_env["dest"] / f"plain_{wait}.pth", weights_only=False
        )  # numpy arrays need the full unpickler; the file is our own
        assert torch.equal(stored["obs"], plain["obs"])
        np.testing.assert_array_equal(stored["ids"], plain["ids"])
        assert stored["meta"] == plain["meta"]
        again = _stored(tracker_env["dest"], f"other_{wait}")
        assert type(again) is collections.OrderedDict
        assert torch.equal(again["a"], other["a"]) and again["b"] == [1, 2]


def test_a_dump_over_the_channels_limit_goes_as_a_ray_call(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import ray

    import trajtrack.ray as tr

    # The channel's largest payload is the tracker's budget: 64 KiB here.
    actor = tr.get_trajectory_tracker(max_pending_bytes=64 << 10)
    info = ray.get(actor.ready.remote(), timeout=RAY_TIMEOUT)
    assert info["channel"]["max_payload_bytes"] == 64 << 10
    big = {"x": torch.arange(32 << 10, dtype=torch.int32)}  # 128 KiB
    small = {"x": torch.arange(4)}
    tr.dump_data(small, "small/ack")
    tr.dump_data(big, "big/ack")
    for i in range(3):  # one pipelined batch: small, big, small; order kept
        tr.dump_data(small if i != 1 else big, f"pipe/{i}", wait=False)
    tr.flush(timeout=RAY_TIMEOUT)

    assert torch.equal(_stored(tracker_env["dest"], "big/ack")["x"], big["x"])
    assert torch.equal(_stored(tracker_env["dest"], "pipe/1")["x"], big["x"])
    assert torch.equal(_stored(tracker_env["dest"], "pipe/2")["x"], small["x"])
    counters = ray.get(actor.channel_statistics.remote(), timeout=RAY_TIMEOUT)
    assert counters["errors"] == 0 and counters["dumps"] >= 2  # the small ones
    assert counters["dumps"] <= 3  # the big ones never crossed it
    assert _cached_channel() is not None  # and the channel is still in use
