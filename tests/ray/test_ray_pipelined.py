"""The pipelined mode's batching sender, against the real local Ray cluster (see conftest.py).

Most tests use the real tracker actor. Where dumps must stay unacknowledged for as long as a
test needs (backpressure, fork), a gate actor from ``_ray_tasks`` stands in for the tracker
under the tracker's name: the real actor cannot be stalled on demand.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from trajtrack.layouts.records import decode_segment

RAY_TIMEOUT = 90  # seconds for any single wait on the cluster

pytestmark = pytest.mark.ray


def _load(path: Path) -> Any:
    return torch.load(path, weights_only=True)


def _recorded_names(dest: Path) -> list[str]:
    """Names in the tracker's record, in commit order (one writer, one upload worker)."""
    names = []
    for segment in sorted((dest / ".trajtrack" / "records").glob("*.jsonl")):
        records, bad = decode_segment(segment.read_bytes())
        assert bad == 0, segment
        names += [record.name for record in records]
    return names


@pytest.fixture
def gate(ray_cluster: Any, tracker_env: dict[str, Any]) -> Iterator[Any]:
    """A gate actor registered under this test's tracker name; opened at teardown."""
    import ray
    from _ray_tasks import start_gate

    import trajtrack.ray as tr

    actor = start_gate(tracker_env["name"], str(tracker_env["dest"]))
    yield actor
    ray.get(actor.open.remote(), timeout=RAY_TIMEOUT)
    tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)  # leave nothing in flight for the next test


def test_many_dumps_from_several_threads_all_land_in_order(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import trajtrack.ray as tr

    # One upload worker: the record lists the dumps in the order the actor admitted them.
    tr.get_trajectory_tracker(workers=1)
    threads, per_thread = 4, 60
    errors: list[BaseException] = []

    def writer(t: int) -> None:
        try:
            for i in range(per_thread):
                tr.dump_data({"t": t, "i": torch.tensor([i])}, f"t{t}/{i}", wait=False)
                tr.dump_data({"t": t, "i": torch.tensor([i])}, f"t{t}/latest", wait=False)
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=writer, args=(t,)) for t in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join(RAY_TIMEOUT)
    assert not errors
    assert not any(thread.is_alive() for thread in workers)

    tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)
    assert tr.own_dumps_in_flight() == 0
    tr.flush(timeout=RAY_TIMEOUT)

    dest = tracker_env["dest"]
    for t in range(threads):
        for i in range(per_thread):
            stored = _load(dest / f"t{t}" / f"{i}.pth")
            assert (stored["t"], stored["i"].item()) == (t, i)
        # The same name dumped over and over: the last dump made is the one stored.
        assert _load(dest / f"t{t}" / "latest.pth")["i"].item() == per_thread - 1
    recorded = _recorded_names(dest)
    assert len(recorded) == threads * per_thread * 2
    for t in range(threads):
        mine = [name for name in recorded if name.startswith(f"t{t}/") and "latest" not in name]
        assert mine == [f"t{t}/{i}" for i in range(per_thread)]


def test_a_dump_too_big_to_copy_is_sent_at_once_after_the_earlier_ones(
    ray_cluster: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over ``SEND_NOW_MIN_BYTES`` a pipelined dump is not copied: it is sent before
    ``dump_data`` returns (so changing it afterwards changes nothing), and only after the
    process's earlier pipelined dumps, so the order is kept."""
    import trajtrack.ray as tr
    from trajtrack.ray import _client

    monkeypatch.setattr(_client, "SEND_NOW_MIN_BYTES", 10_000)
    tr.get_trajectory_tracker(workers=1)  # one upload worker: the record keeps the order
    big = torch.arange(5000, dtype=torch.float32)  # 20 KB
    names = []
    for step in range(3):
        for kind, data in (("small", {"x": torch.ones(2) * step}), ("big", {"x": big})):
            names.append(f"s{step}/{kind}")
            tr.dump_data(data, names[-1], wait=False)
            if kind == "big":
                assert tr.own_dumps_in_flight() == 0  # it went out with everything before it
                big.add_(1)  # after the return: not in the stored dump
    tr.flush(timeout=RAY_TIMEOUT)

    dest = tracker_env["dest"]
    for step in range(3):
        stored = _load(dest / f"s{step}" / "big.pth")["x"]
        assert torch.equal(stored, torch.arange(5000, dtype=torch.float32) + step)
        assert torch.equal(_load(dest / f"s{step}" / "small.pth")["x"], torch.ones(2) * step)
    assert _recorded_names(dest) == names


def test_backpressure_bounds_what_is_unacknowledged_and_times_out(
    gate: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    import trajtrack.ray as tr

    monkeypatch.setenv("TRAJTRACK_RAY_MAX_IN_FLIGHT", "5")
    monkeypatch.setenv("TRAJTRACK_RAY_FULL_TIMEOUT", "0.5")
    for i in range(5):
        tr.dump_data({"i": i}, f"held/{i}", wait=False)  # returns: there is room
    assert tr.own_dumps_in_flight() == 5

    with pytest.raises(TimeoutError, match="TRAJTRACK_RAY_FULL_TIMEOUT") as full:
        tr.dump_data({"i": 5}, "held/5", wait=False)
    assert "'held/5' was not sent" in str(full.value)
    assert tr.own_dumps_in_flight() == 5
    # Some are sent and held by the gate, the rest still buffered: the wait covers both.
    with pytest.raises(TimeoutError, match="5 pipelined dumps"):
        tr.wait_for_own_dumps(timeout=0.3)

    ray.get(gate.open.remote(), timeout=RAY_TIMEOUT)
    tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)
    assert tr.own_dumps_in_flight() == 0
    assert ray.get(gate.received.remote(), timeout=RAY_TIMEOUT) == [f"held/{i}" for i in range(5)]

    tr.dump_data({"i": 6}, "held/6", wait=False)  # room again
    tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)
    assert ray.get(gate.received.remote(), timeout=RAY_TIMEOUT)[-1] == "held/6"


def test_a_pipelined_dump_goes_to_the_actor_configured_when_it_was_made(
    gate: Any, tracker_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import ray

    import trajtrack.ray as tr

    first = tracker_env["name"]  # the gate holds the first batch: the rest stays buffered
    for i in range(4):
        tr.dump_data({"i": i}, f"gated/{i}", wait=False)
    other = f"{first}-other"
    monkeypatch.setenv("TRAJTRACK_RAY_ACTOR", other)  # e.g. a library that switches actors
    monkeypatch.setenv("VERL_TRACKER_HDFS_DIR", str(tmp_path / "other"))
    try:
        tr.dump_data({"i": 9}, "elsewhere", wait=False)
        ray.get(gate.open.remote(), timeout=RAY_TIMEOUT)
        tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)
        received = ray.get(gate.received.remote(), timeout=RAY_TIMEOUT)
        assert received == [f"gated/{i}" for i in range(4)]  # none went to the other actor
        tr.flush(timeout=RAY_TIMEOUT)
        assert (tmp_path / "other" / "elsewhere.pth").exists()
        assert not (tmp_path / "other" / "gated").exists()
    finally:
        tr.shutdown(timeout=RAY_TIMEOUT, name=other)


def test_errors_of_many_pipelined_dumps_surface_once(
    ray_cluster: Any, tracker_env: dict[str, Any]
) -> None:
    import ray

    import trajtrack
    import trajtrack.ray as tr

    tr.dump_data({"x": 0}, "before")
    ray.get(tr.get_trajectory_tracker().close.remote(RAY_TIMEOUT), timeout=RAY_TIMEOUT)
    for i in range(6):
        tr.dump_data({"x": i}, f"refused/{i}", wait=False)  # no error here: it is pipelined

    with pytest.raises(trajtrack.TrackerClosedError) as failure:
        tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)
    assert "5 more pipelined dumps failed" in "\n".join(getattr(failure.value, "__notes__", []))
    tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)  # reported once
    assert (tracker_env["dest"] / "before.pth").exists()
    assert not (tracker_env["dest"] / "refused").exists()


def test_a_forked_child_does_not_inherit_the_sender(gate: Any, tracker_env: dict[str, Any]) -> None:
    import ray

    import trajtrack.ray as tr
    from trajtrack.ray import _sender

    for i in range(3):
        tr.dump_data({"i": i}, f"parent/{i}", wait=False)
    assert _sender.sender()._thread is not None
    assert tr.own_dumps_in_flight() == 3

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only look at the state, touch no Ray, leave without cleanup
        code = 1
        try:
            os.close(read_end)
            state = {
                "thread": _sender.sender()._thread is not None,
                "in_flight": tr.own_dumps_in_flight(),
                "parent_thread_alive": any(
                    t.name == "trajtrack-ray-sender" for t in threading.enumerate()
                ),
            }
            tr.wait_for_own_dumps(timeout=0)  # nothing of the parent's to wait for
            os.write(write_end, json.dumps(state).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        seen = json.loads(pipe.read() or "null")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert seen == {"thread": False, "in_flight": 0, "parent_thread_alive": False}

    # The parent's dumps are still its own, and still delivered.
    assert tr.own_dumps_in_flight() == 3
    ray.get(gate.open.remote(), timeout=RAY_TIMEOUT)
    tr.wait_for_own_dumps(timeout=RAY_TIMEOUT)
    assert ray.get(gate.received.remote(), timeout=RAY_TIMEOUT) == [f"parent/{i}" for i in range(3)]
