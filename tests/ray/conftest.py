"""A real local Ray cluster for the adapter tests, shared by the whole session.

``ray start --head --block`` runs as our child process, bound to 127.0.0.1, with its temp dir
under pytest's; the test process connects as the first driver, subprocesses connect as further
drivers. ``--block`` makes that child kill everything it started when we terminate it, so the
teardown ends only our own processes. Without Ray the tests skip, or fail when
``TRAJTRACK_REQUIRE_RAY=1``.

This folder has no ``__init__.py`` on purpose: a package named ``ray`` under ``tests/`` would
shadow the real one.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
START_TIMEOUT = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Ray >= 2.5x turns token authentication on for a new cluster whenever ~/.ray/auth_token exists
# (anything on the machine may have made one), while a driver that connects by address does
# not, and then cannot connect. The test cluster uses a token of its own, set for the head,
# this process and every driver, so that nothing outside the tests decides.
# Ray reads them when it is imported, and test modules here import it at collection time:
# set them now, before any of that.
_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
os.environ.update(_AUTH)
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


def _ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.update(_AUTH)
    # Workers and extra drivers import the helpers next to this file by name.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
    return env


def _require_ray() -> None:
    if importlib.util.find_spec("ray") is None:
        if os.environ.get("TRAJTRACK_REQUIRE_RAY") == "1":
            pytest.fail("Ray is not installed and TRAJTRACK_REQUIRE_RAY=1")
        pytest.skip("Ray is not installed (pip install 'trajtrack[ray]')")


class RayCluster:
    """The running head node: its address and a way to run extra drivers."""

    def __init__(self, address: str, env: dict[str, str]) -> None:
        self.address = address
        self.env = env

    def driver(self, *args: str, timeout: float = 90.0) -> str:
        """Run ``_ray_driver.py`` as a separate driver of this cluster; return its stdout."""
        env = dict(self.env, TRAJTRACK_TEST_RAY_ADDRESS=self.address)
        done = subprocess.run(
            [sys.executable, str(HERE / "_ray_driver.py"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(
                f"driver {args} exited {done.returncode}\n--- stdout\n{done.stdout}"
                f"\n--- stderr\n{done.stderr[-4000:]}"
            )
        return done.stdout


def _start_head(temp_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    port = _free_port()
    command = [
        "ray",
        "start",
        "--head",
        "--block",
        f"--port={port}",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp_dir}",
    ]
    return _start_node(command, env), f"127.0.0.1:{port}"


def _start_node(command: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """``ray start ... --block`` as our child; returns once Ray says the node is up."""
    node = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    started = threading.Event()
    lines: list[str] = []

    def read() -> None:
        assert node.stdout is not None
        for line in node.stdout:
            lines.append(line)
            if "Ray runtime started" in line:
                started.set()
        started.set()  # the process ended: stop waiting

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    node.reader = reader  # type: ignore[attr-defined]  # joined by _stop_head
    if not started.wait(START_TIMEOUT) or node.poll() is not None:
        _stop_head(node)
        pytest.fail(f"{' '.join(command[:3])} did not come up:\n" + "".join(lines[-40:]))
    return node


def _stop_head(head: subprocess.Popen[str]) -> None:
    if head.poll() is None:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(timeout=10)
    head.reader.join(timeout=10)  # type: ignore[attr-defined]  # ends at the pipe's EOF
    assert head.stdout is not None
    head.stdout.close()


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """Start the head node, connect this process as a driver; stop both at session end."""
    _require_ray()
    import ray

    env = _ray_env()
    # Unix socket paths live below the temp dir and are limited to ~107 bytes: keep it short.
    temp_dir = tmp_path_factory.mktemp("ray", numbered=True)
    head, address = _start_head(temp_dir, env)
    try:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        yield RayCluster(address, env)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        _stop_head(head)


SECOND_NODE_RESOURCE = "trajtrack_second_node"
"""A custom resource only the second node has: a task asking for it runs there."""


@pytest.fixture(scope="module")
def second_node(ray_cluster: RayCluster) -> Iterator[str]:
    """A second Ray node on this machine, joined to the head; yields its resource's name.

    Module-scoped: the other modules' tests expect one node (tasks on the actor's node).
    """
    import ray

    command = [
        "ray",
        "start",
        f"--address={ray_cluster.address}",
        "--block",
        "--node-ip-address=127.0.0.1",
        "--num-cpus=1",
        f'--resources={{"{SECOND_NODE_RESOURCE}": 1}}',
        "--disable-usage-stats",
    ]
    node = _start_node(command, ray_cluster.env)
    try:
        deadline = START_TIMEOUT
        while ray.cluster_resources().get(SECOND_NODE_RESOURCE) != 1 and deadline > 0:
            threading.Event().wait(0.5)  # the head learns of the node a little later
            deadline -= 0.5
        yield SECOND_NODE_RESOURCE
    finally:
        _stop_head(node)


@pytest.fixture
def actor_name(ray_cluster: RayCluster) -> Iterator[str]:
    """A fresh tracker actor name for one test; the actor is shut down afterwards."""
    import trajtrack.ray as tr

    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        tr.shutdown(timeout=30, name=name)
    except Exception as exc:  # the test already reported what mattered
        print(f"shutting down actor {name}: {exc!r}")


@pytest.fixture
def tracker_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, actor_name: str) -> dict[str, Any]:
    """Enable the tracker for this process, pointing at *tmp_path* and this test's actor."""
    dest = tmp_path / "dumps"
    values = {
        "VERL_ENABLE_TRACKER": "1",
        "VERL_TRACKER_HDFS_DIR": str(dest),
        "TRAJTRACK_RAY_ACTOR": actor_name,
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return {"dest": dest, "name": actor_name, "env": values}


# ----------------------------------------------------------------- the channel without Ray


@pytest.fixture
def loop() -> Iterator[Any]:
    """An asyncio loop in a thread, like the actor's (``_channel_support.Loop``)."""
    from _channel_support import Loop

    running = Loop()
    yield running
    running.close()


@pytest.fixture
def serve(loop: Any) -> Iterator[Callable[..., Any]]:
    """``serve(limits=None)``: a started channel server on *loop* (closed afterwards)."""
    from _channel_support import start_served, stop_served

    started: list[Any] = []

    def factory(limits: Any = None) -> Any:
        started.append(start_served(loop, limits))
        return started[-1]

    yield factory
    for served in started:
        stop_served(loop, served)


@pytest.fixture
def served(serve: Callable[..., Any]) -> Any:
    """A channel server with the default limits (``_channel_support.Served``)."""
    return serve()
