"""Suite-wide fixtures. Async tests run on asyncio through anyio's pytest plugin (auto mode)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator

import pytest
import torch
from blockbuster import blockbuster_ctx

from _support.hdfs_cluster import hdfs_cluster  # noqa: F401  (a session fixture)
from trajtrack.backends.memory import MemoryStorage
from trajtrack.tracker._sync import _reset_for_tests


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long", action="store_true", default=False, help="run the long-form reliability runs"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--long"):
        return
    skip = pytest.mark.skip(reason="long form: run with --long")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# Calls trajtrack may make on the event loop although blockbuster counts them as blocking.
# Each is bounded and short by construction; keep this list short and say why for each.
BLOCKING_ALLOWED: tuple[tuple[str, str], ...] = (
    # The sweep asks whether a dead writer's pid is alive: one kill(pid, 0), no waiting.
    ("trajtrack/tracker/_sweep.py", "process_alive"),
    # A local destination is made absolute when the storage object is made: one getcwd().
    ("trajtrack/backends/local.py", "__init__"),
)


@pytest.fixture(autouse=True)
def _no_blocking_on_the_loop(request: pytest.FixtureRequest) -> Iterator[None]:
    """In every async test, a blocking call that trajtrack makes on the event loop fails it.

    Only calls from trajtrack's own modules count (tests may block as they like); the
    blocking work trajtrack does belongs in worker threads, where blockbuster allows it.
    """
    if not inspect.iscoroutinefunction(request.function):
        yield
        return
    with blockbuster_ctx("trajtrack") as buster:
        for function in buster.functions.values():
            for filename, name in BLOCKING_ALLOWED:
                function.can_block_in(filename, name)
        yield


@pytest.fixture(autouse=True)
def _isolation(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with no global tracker, no tracker environment and empty memory stores."""
    for var in (
        "VERL_ENABLE_TRACKER",
        "TRAJTRACK_ENABLE",
        "VERL_TRACKER_HDFS_DIR",
        "TRAJTRACK_DIR",
        "TRAJTRACK_EXIT_TIMEOUT",
        "TRAJTRACK_LAYOUT",
        "TRAJTRACK_SHARD_MAX_BYTES",
        "TRAJTRACK_SHARD_MAX_AGE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TRAJTRACK_HANDLE_SIGTERM", "0")
    MemoryStorage.reset()
    logging.getLogger("trajtrack").setLevel(logging.DEBUG)
    with _reset_for_tests():
        yield


@pytest.fixture(autouse=True)
def _torch_allow_list() -> Iterator[None]:
    """torch's process-wide weights-only allow-list is as it was before each test.

    ``trajtrack.cli.main`` widens it for its process (tests call it in-process), and so does
    ``trajtrack.reader.allow_in_this_process``; no test may see another's additions.
    """
    before = torch.serialization.get_safe_globals()
    yield
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(before)
