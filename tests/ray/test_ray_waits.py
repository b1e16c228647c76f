"""Every wait of a caller on the tracker actor is bounded, and a killed actor's name is let go of.

Against the real local Ray cluster (see conftest.py). ``ray.kill`` only sends the kill to Ray's
control store; until the store has carried it out, ``ray.get_actor`` still gives the dead
actor. That window cannot be opened on demand, so :class:`KillNotYetCarriedOut` keeps it open:
after a real kill, and once the actor's process is really gone, the name gives the dead handle
for a few more lookups, as the control store would. Where an actor must not answer, a gate
actor from ``_ray_tasks`` stands in for the tracker under its name.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

RAY_TIMEOUT = 90  # seconds for any single wait on the cluster

pytestmark = pytest.mark.ray


class KillNotYetCarriedOut:
    """``ray.get_actor`` for one name as the control store answers before a kill is done.

    :meth:`kill` kills for real and waits until the actor's process (*pid*) is gone; after it,
    the next *stale_lookups* lookups of the name give the killed handle (``None``: all).
    """

    def __init__(self, name: str, pid: int, stale_lookups: int | None) -> None:
        import ray

        self._real_get_actor: Callable[..., Any] = ray.get_actor
        self._real_kill: Callable[..., Any] = ray.kill
        self._name = name
        self._pid = pid
        self._stale_lookups = stale_lookups
        self.killed: Any = None
        self.left: int | None = 0
        self.stale_given = 0

    def kill(self, actor: Any, *, no_restart: bool = True) -> None:
        from _ray_tasks import wait_until_gone

        self._real_kill(actor, no_restart=no_restart)
        wait_until_gone(self._pid)
        self.killed, self.left = actor, self._stale_lookups

    def get_actor(self, name: str, namespace: str | None = None) -> Any:
        if name == self._name and self.killed is not None and (self.left is None or self.left):
            if self.left is not None:
                self.left -= 1
            self.stale_given += 1
            return self.killed
        return self._real_get_actor(name, namespace=namespace)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import ray

        monkeypatch.setattr(ray, "kill", self.kill)
        monkeypatch.setattr(ray, "get_actor", self.get_actor)


def _ready(tr: Any) -> dict[str, Any]:
    import ray

    info: dict[str, Any] = ray.get(tr.get_trajectory_tracker().ready.remote(), timeout=RAY_TIMEOUT)
    return info


def _dumped_then_stale(
    tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, stale_lookups: int | None
) -> tuple[dict[str, Any], KillNotYetCarriedOut]:
    """One dump made (the actor exists), then the stand-in for kills installed."""
    import trajtrack.ray as tr

    tr.dump_data({"x": torch.ones(1)}, "before")
    first = _ready(tr)
    stale = KillNotYetCarriedOut(tracker_env["name"], first["pid"], stale_lookups)
    stale.install(monkeypatch)
    return first, stale


def _a_new_actor_writes(tracker_env: dict[str, Any], first: dict[str, Any], value: float) -> None:
    """A dump now goes to a new actor (not the dead *first*) and is written as made."""
    import trajtrack.ray as tr

    tr.dump_data({"x": torch.ones(1) * value}, "after")
    tr.flush(timeout=RAY_TIMEOUT)
    assert _ready(tr)["token"] != first["token"]
    stored = torch.load(tracker_env["dest"] / "after.pth", weights_only=True)
    assert torch.equal(stored["x"], torch.ones(1) * value)


def test_shutdown_returns_once_the_name_is_let_go_of(
    ray_cluster: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import trajtrack.ray as tr

    first, stale = _dumped_then_stale(tracker_env, monkeypatch, stale_lookups=3)
    tr.shutdown(timeout=RAY_TIMEOUT)
    assert stale.stale_given == 3  # shutdown waited through the window
    _a_new_actor_writes(tracker_env, first, 2.0)
    assert stale.stale_given == 3  # and the dump did not meet the dead actor


def test_a_dump_that_finds_a_killed_actor_by_name_waits_and_gets_a_new_one(
    ray_cluster: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    import trajtrack.ray as tr

    first, stale = _dumped_then_stale(tracker_env, monkeypatch, stale_lookups=3)
    ray.kill(tr.get_trajectory_tracker())  # behind trajtrack's back: its cached handle is dead
    _a_new_actor_writes(tracker_env, first, 3.0)
    assert stale.stale_given == 3 and stale.left == 0  # the dead one was found, then waited out


def test_a_name_never_let_go_of_is_a_timeout_not_a_hang(
    ray_cluster: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    import trajtrack.ray as tr

    _dumped_then_stale(tracker_env, monkeypatch, stale_lookups=None)
    monkeypatch.setenv("TRAJTRACK_RAY_FULL_TIMEOUT", "1")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"still gives the killed .*TRAJTRACK_RAY_FULL_TIMEOUT"):
        tr.shutdown(timeout=RAY_TIMEOUT)
    assert time.monotonic() - started < 30  # the 1 s bound, plus the real kill
    with pytest.raises(TimeoutError, match="still gives the killed"):
        tr.dump_data({"x": torch.ones(1)}, "after")
    monkeypatch.undo()  # the name is free for real: the fixture's shutdown finds nothing
    with pytest.raises(ValueError, match="Failed to look up actor"):
        ray.get_actor(tracker_env["name"], namespace=tr.DEFAULT_NAMESPACE)


def test_an_acknowledged_dump_as_a_ray_call_times_out(
    ray_cluster: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray
    from _ray_tasks import start_gate

    import trajtrack.ray as tr

    gate = start_gate(tracker_env["name"], str(tracker_env["dest"]))  # no channel: Ray calls
    monkeypatch.setenv("TRAJTRACK_RAY_FULL_TIMEOUT", "0.5")
    with pytest.raises(TimeoutError, match=r"'held' within 0.5 s .*TRAJTRACK_RAY_FULL_TIMEOUT"):
        tr.dump_data({"x": torch.ones(1)}, "held")
    ray.get(gate.open.remote(), timeout=RAY_TIMEOUT)
    tr.dump_data({"x": torch.ones(1)}, "open")
    # "held" was still admitted (as the message says it may be), and after it "open".
    assert ray.get(gate.received.remote(), timeout=RAY_TIMEOUT) == ["held", "open"]


def test_an_actor_that_never_gets_ready_is_a_timeout_on_the_first_dump(
    ray_cluster: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray
    from _ray_tasks import start_gate

    import trajtrack.ray as tr

    gate = start_gate(tracker_env["name"], str(tracker_env["dest"]), hold_ready=True)
    monkeypatch.setenv("TRAJTRACK_RAY_FULL_TIMEOUT", "0.5")
    with pytest.raises(TimeoutError, match=r"ready\(\) within 0.5 s"):
        tr.dump_data({"x": torch.ones(1)}, "first")
    ray.get(gate.open.remote(), timeout=RAY_TIMEOUT)
    tr.dump_data({"x": torch.ones(1)}, "second")  # nothing was cached: looked up again
    assert ray.get(gate.received.remote(), timeout=RAY_TIMEOUT) == ["second"]
