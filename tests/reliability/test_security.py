"""Case 7, security: no shell, no escape from the destination, stated file modes, safe loading,
and logs that never contain what was dumped. ``SECURITY.md`` describes each check."""

from __future__ import annotations

import ast
import logging
import os
import stat
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import trajtrack
from trajtrack import DumpExistsError, StoragePermissionError
from trajtrack.backends.local import LocalStorage
from trajtrack.reader import SyncRun

SRC = Path(__file__).resolve().parents[2] / "src" / "trajtrack"

#: Calls that run a shell or another program. The original passed dump names to os.system.
FORBIDDEN_CALLS = {
    "os.system",
    "os.popen",
    "os.execl",
    "os.execlp",
    "os.execv",
    "os.execvp",
    "os.execve",
    "os.spawnl",
    "os.spawnv",
    "os.posix_spawn",
    "os.posix_spawnp",
    "pty.spawn",
    "commands.getoutput",
}
FORBIDDEN_MODULES = {"subprocess", "pty", "commands"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def test_no_shell_and_no_subprocess_anywhere_in_the_package() -> None:
    sources = sorted(SRC.rglob("*.py"))
    assert len(sources) > 10
    found = []
    for source in sources:
        tree = ast.parse(source.read_text(), str(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [
                    f"{source}: import {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] in FORBIDDEN_MODULES
                ]
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[0] in FORBIDDEN_MODULES or any(
                    f"{node.module}.{a.name}" in FORBIDDEN_CALLS for a in node.names
                ):
                    found.append(f"{source}: from {node.module} import ...")
            elif isinstance(node, ast.Call):
                name = _dotted(node.func)
                if name in FORBIDDEN_CALLS:
                    found.append(f"{source}:{node.lineno}: {name}()")
                if any(k.arg == "shell" for k in node.keywords):
                    found.append(f"{source}:{node.lineno}: shell= argument")
    assert found == []


async def test_symlinked_directory_cannot_lead_outside(tmp_path: Path) -> None:
    dest, outside = tmp_path / "dest", tmp_path / "outside"
    dest.mkdir()
    outside.mkdir()
    (dest / "step1").symlink_to(outside, target_is_directory=True)
    async with trajtrack.Tracker(dest) as tracker:
        handle = await tracker.dump({"x": torch.ones(2)}, "step1/obs")
        with anyio.fail_after(30), pytest.raises(StoragePermissionError, match="symbolic link"):
            await handle
        with pytest.raises(StoragePermissionError):
            await tracker.flush(timeout=30)
        await (await tracker.dump({"x": 1}, "fine")).wait(30)
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("on_exists", ["overwrite", "error"])
async def test_symlinked_file_is_never_written_through(tmp_path: Path, on_exists: str) -> None:
    dest, victim = tmp_path / "dest", tmp_path / "victim.txt"
    dest.mkdir()
    victim.write_bytes(b"do not touch")
    (dest / "obs.pth").symlink_to(victim)
    async with trajtrack.Tracker(dest, on_exists=on_exists) as tracker:  # type: ignore[arg-type]
        handle = await tracker.dump({"x": torch.ones(2)}, "obs")
        if on_exists == "error":
            with anyio.fail_after(30), pytest.raises(DumpExistsError):
                await handle
        else:
            await handle.wait(30)  # the link itself is replaced by the new file
            assert not (dest / "obs.pth").is_symlink()
        if on_exists == "error":
            with pytest.raises(DumpExistsError):
                await tracker.flush(timeout=30)
    assert victim.read_bytes() == b"do not touch"


@pytest.mark.parametrize(
    ("options", "file_mode", "dir_mode"),
    [({}, 0o644, 0o755), ({"file_mode": 0o600, "dir_mode": 0o700}, 0o600, 0o700)],
    ids=["default", "private"],
)
async def test_file_permission_modes(
    tmp_path: Path, options: dict[str, int], file_mode: int, dir_mode: int
) -> None:
    old = os.umask(0o022)
    try:
        async with trajtrack.Tracker(tmp_path / "dest", storage_options=options) as tracker:
            await (await tracker.dump({"x": 1}, "step1/obs")).wait(30)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "dest" / "step1" / "obs.pth").stat().st_mode) == file_mode
    assert stat.S_IMODE((tmp_path / "dest" / "step1").stat().st_mode) == dir_mode


SECRET = "SECRET-7c1e-payload-do-not-log"


class _Unpicklable:
    def __repr__(self) -> str:
        return SECRET  # even an object's repr is content

    def __reduce__(self) -> Any:
        raise ValueError("cannot pickle this")


class _Failing(LocalStorage):
    def _write_temp(self, directory: int, temp: str, payload: Any) -> Any:
        raise OSError(28, "No space left on device", temp)


async def test_logs_never_contain_dump_contents(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    secret_tensor = torch.tensor(list(SECRET.encode()), dtype=torch.uint8)
    payloads = {
        "ok/plain": {"text": SECRET, "t": secret_tensor},
        "ok/object": {"nested": [SECRET, {"k": SECRET}], "lock_free": threading.get_ident()},
    }
    async with trajtrack.Tracker(tmp_path / "dest", record_interval=0.05) as tracker:
        for name, obj in payloads.items():
            await (await tracker.dump(obj, name)).wait(30)
        with pytest.raises(trajtrack.SerializationError):
            await tracker.dump({"bad": _Unpicklable(), "text": SECRET}, "bad/unpicklable")
        with pytest.raises(trajtrack.SerializationError):
            await tracker.dump({"fn": lambda: SECRET, "text": SECRET}, "bad/lambda")
        await tracker.flush(timeout=30)
    failing = _Failing(str(tmp_path / "full"))
    async with trajtrack.Tracker(tmp_path / "full", storage=failing) as tracker:
        handle = await tracker.dump({"text": SECRET}, "fails/enospc")
        with pytest.raises(trajtrack.StorageError):
            await handle.wait(30)
        with pytest.raises(trajtrack.StorageError):
            await tracker.flush(timeout=30)
    logged = "\n".join(f"{r.getMessage()}\n{r.exc_text or ''}" for r in caplog.records)
    assert "fails/enospc" in logged  # the failure is logged, by name
    assert SECRET not in logged
    assert SECRET.encode().hex() not in logged


def test_the_reader_refuses_code_in_an_untrusted_dump(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    dest = tmp_path / "dest"
    dest.mkdir()

    class Payload:
        def __reduce__(self) -> Any:
            return (Path.touch, (marker,))  # what an attacker's dump would run on load

    torch.save({"obs": Payload()}, dest / "evil.pth")
    with SyncRun(dest) as run, pytest.raises(trajtrack.UnsafeLoadError):
        run.load("evil")
    assert not marker.exists()
