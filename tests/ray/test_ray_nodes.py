"""What listens, and who uses the channel, on the real local Ray cluster (issue #36).

The actor's only listener of its own is its Unix socket: with the defaults it holds exactly the
TCP listeners Ray gives any actor (counted from ``/proc`` next to an actor created with the
channel off). A task on another Ray node (a second node on this machine) has no channel: its
dumps go as Ray calls, and they land.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

RAY_TIMEOUT = 90  # seconds for any single wait on the cluster

pytestmark = pytest.mark.ray


def _tcp_listeners(pid: int) -> int:
    """How many listening TCP sockets (IPv4 and IPv6) process *pid* holds, from ``/proc``."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    count = 0
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: TCP_LISTEN
                count += 1
    return count


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts sockets in /proc")
def test_the_actor_adds_no_tcp_listener_to_rays_own(
    ray_cluster: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    import trajtrack.ray as tr

    with_channel = tr.get_trajectory_tracker()  # the defaults
    info = ray.get(with_channel.ready.remote(), timeout=RAY_TIMEOUT)
    assert Path(info["channel"]["unix_path"]).is_socket()  # its channel is open
    assert "tcp" not in info["channel"]

    off_name = f"{tracker_env['name']}-off"
    monkeypatch.setenv("TRAJTRACK_RAY_CHANNEL", "off")
    try:
        without = tr.get_trajectory_tracker(name=off_name)
        bare = ray.get(without.ready.remote(), timeout=RAY_TIMEOUT)
        assert bare["channel"] is None
        assert _tcp_listeners(info["pid"]) == _tcp_listeners(bare["pid"])  # Ray's own only
    finally:
        tr.shutdown(timeout=RAY_TIMEOUT, name=off_name)


def test_a_task_on_another_node_sends_ray_calls_that_land(
    ray_cluster: Any, second_node: str, tracker_env: dict[str, Any]
) -> None:
    import ray
    from _ray_tasks import dump_and_tell_the_channel
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    import trajtrack.ray as tr

    actor = tr.get_trajectory_tracker()
    actor_node = ray.get(actor.ready.remote(), timeout=RAY_TIMEOUT)["channel"]["node_id"]
    (other_node,) = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - {actor_node}

    def on(node: str, i: int) -> Any:
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        task = ray.remote(dump_and_tell_the_channel).options(
            scheduling_strategy=strategy, runtime_env={"env_vars": tracker_env["env"]}
        )
        return task.remote(i)

    there, here = ray.get([on(other_node, 1), on(actor_node, 2)], timeout=RAY_TIMEOUT * 2)
    tr.flush(timeout=RAY_TIMEOUT)

    assert there == (other_node, False)  # the other node: no channel, Ray calls
    assert here == (actor_node, True)  # the actor's node: its Unix socket
    dest = tracker_env["dest"]
    for i in (1, 2):
        assert torch.equal(torch.load(dest / f"node/ack{i}.pth")["i"], torch.tensor(i))
        assert torch.equal(torch.load(dest / f"node/pipe{i}.pth")["i"], torch.tensor(100 + i))
    channel = ray.get(actor.channel_statistics.remote(), timeout=RAY_TIMEOUT)
    assert channel["dumps"] == 2  # only the two of the task on the actor's node
