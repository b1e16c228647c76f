"""Case 7, security: no shell, no escape from the destination, stated file modes, safe loading,
and logs that never contain what was dumped. ``SECURITY.md`` describes each check."""

from __future__ import annotations

import ast
import io
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
                if name.startswith("subprocess."):
                    found.append(f"{source}:{node.lineno}: {name}()")
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
    # The run's own folders too (#31): another user lists records and reads shards of a
    # shared run exactly as far as the run's other folders allow.
    for own in (".trajtrack", ".trajtrack/spool", ".trajtrack/records"):
        assert stat.S_IMODE((tmp_path / "dest" / own).stat().st_mode) == dir_mode, own


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


class _RunsShell:
    """What an attacker's dump runs on load: ``os.system``, creating the marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch '{self.marker}'",))


def _hostile_dumps(marker: Path) -> dict[str, bytes]:
    """The payload alone, next to trajtrack's types, and in the legacy format after them (no
    static scan then: the caller hands the dump to the load worker, which must refuse it)."""
    from trajtrack.rollout import RolloutBatch, RolloutSample

    sample = RolloutSample(full_batch=RolloutBatch({"r": torch.ones(1)}), sample_id="s")
    dumps = {}
    for name, obj, zipped in (
        ("alone", {"obs": _RunsShell(marker)}, True),
        ("with_sample", [sample, _RunsShell(marker)], True),
        ("legacy_with_sample", [sample, _RunsShell(marker)], False),
    ):
        buffer = io.BytesIO()
        torch.save(obj, buffer, _use_new_zipfile_serialization=zipped)
        dumps[name] = buffer.getvalue()
    return dumps


def _plant(tmp_path: Path) -> tuple[Path, Path, Path, dict[str, bytes]]:
    """The hostile dumps in a local run (and a run whose files differ) and a memory run."""
    from trajtrack.backends.memory import MemoryStorage

    marker = tmp_path / "pwned"
    dumps = _hostile_dumps(marker)
    local, other = tmp_path / "run", tmp_path / "other"
    for dest in (local, other):
        dest.mkdir()
        for name, data in dumps.items():
            (dest / f"{name}.pth").write_bytes(data if dest == local else b"different")
    memory = MemoryStorage("memory://hostile/run")
    for name, data in dumps.items():
        memory.put_raw(f"{name}.pth", data)
    return marker, local, other, dumps


def _refused() -> Any:
    return pytest.raises(trajtrack.UnsafeLoadError, match=r"refusing to load: .*posix\.system")


async def test_an_os_system_payload_is_refused_by_every_reader_call(tmp_path: Path) -> None:
    from trajtrack.reader import diff_runs, open_run

    marker, local, other, dumps = _plant(tmp_path)
    for url in (str(local), "memory://hostile/run"):  # files loaded by path, or read as bytes
        async with open_run(url) as run:
            for name in dumps:
                with _refused():
                    await run.load(name)
            with _refused():
                async for _ in run.iter_loaded():
                    pass
    memory = "memory://hostile/run"
    for a, b, status in (
        (local, local, "equal"),
        (local, other, "error"),
        (memory, memory, "equal"),
    ):
        async with open_run(str(a)) as run_a, open_run(str(b)) as run_b:
            result = await diff_runs(run_a, run_b)  # identical (a static scan) or not (a load)
        # Identical bytes are equal without loading (issue 33), the refusal a note on the pair;
        # a pair that would have to be loaded is an error. Nothing runs either way.
        assert [c.status for c in result.comparisons] == [status] * len(dumps)
        said = [c.error or " ".join(c.notes) for c in result.comparisons]
        assert all("posix.system" in text for text in said), said
    assert not marker.exists()


def test_an_os_system_payload_is_refused_by_sync_run_and_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trajtrack.cli import main
    from trajtrack.reader import SyncRun

    marker, local, other, dumps = _plant(tmp_path)
    for url in (str(local), "memory://hostile/run"):
        with SyncRun(url) as run:
            for name in dumps:
                with _refused():
                    run.load(name)
    for name in dumps:
        assert main(["show", str(local), name]) == 2
        assert "posix.system" in capsys.readouterr().err
    assert main(["diff", str(local), str(other)]) == 2
    assert capsys.readouterr().out.count("posix.system") == len(dumps)
    assert not marker.exists()


def test_the_cli_widens_the_allow_list_once_for_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import trajtrack.reader._load_worker as load_worker
    from trajtrack.cli import main
    from trajtrack.reader._safe_load import _allowed_names, _name
    from trajtrack.rollout import RolloutBatch, RolloutSample

    def no_worker(**_: object) -> None:
        raise AssertionError("the CLI used the load worker")

    monkeypatch.setattr(load_worker, "request_load", no_worker)
    sample = RolloutSample(full_batch=RolloutBatch({"r": torch.ones(1)}), sample_id="s")
    torch.save(sample, tmp_path / "s.pth")
    before = [_name(g) for g in torch.serialization.get_safe_globals()]
    assert not _allowed_names() & set(before)
    for _ in range(2):
        assert main(["show", str(tmp_path), "s"]) == 0
        assert "RolloutSample" in capsys.readouterr().out
    after = [_name(g) for g in torch.serialization.get_safe_globals()]
    assert sorted(after) == sorted([*before, *_allowed_names()])  # each added once


# --------------------------------------------------------------------------- torch's public API

#: Private torch names the package may use, each with the reason and the test that pins it.
#: Empty: the safe loader uses torch's public API only.
ALLOWED_PRIVATE_TORCH: dict[str, str] = {}


def _private_torch_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """Uses of ``torch._x``, ``torch.serialization._y``, ``from torch._z import``, ``getattr``."""
    aliases = {"torch"}
    for node in ast.walk(tree):  # names bound to torch or one of its modules
        if isinstance(node, ast.Import):
            aliases.update(
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("torch")
            )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            aliases.update(a.asname or a.name for a in node.names)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                modules = [node.module or "", *(f"{node.module}.{a.name}" for a in node.names)]
            found += [(node.lineno, m) for m in modules if m.startswith("torch") and _private(m)]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted.split(".")[0] in aliases and _private(dotted):
                found.append((node.lineno, dotted))
        elif isinstance(node, ast.Call) and _dotted(node.func) == "getattr" and node.args:
            root = _dotted(node.args[0]).split(".")[0]
            name = node.args[1] if len(node.args) > 1 else None
            if root in aliases and isinstance(name, ast.Constant) and _private(str(name.value)):
                found.append((node.lineno, f"getattr({_dotted(node.args[0])}, {name.value!r})"))
        elif isinstance(node, ast.Constant) and "_weights_only_unpickler" in str(node.value):
            found.append((node.lineno, repr(node.value)))
    return found


def _private(dotted: str) -> bool:
    return any(p.startswith("_") and not p.startswith("__") for p in dotted.split("."))


def test_no_private_torch_api_anywhere_in_the_package() -> None:
    # The safe loader is the security boundary: it must not rest on torch internals, which any
    # release may change (see SECURITY.md section 4).
    found = []
    for source in sorted(SRC.rglob("*.py")):
        tree = ast.parse(source.read_text(), str(source))
        for line, use in _private_torch_uses(tree):
            if use not in ALLOWED_PRIVATE_TORCH:
                found.append(f"{source.relative_to(SRC)}:{line}: {use}")
    assert found == []


@pytest.mark.parametrize(
    "code",
    [
        "import torch\ntorch._C._set_x(1)",
        "import torch.serialization as s\ns._load(f)",
        "from torch import serialization\nserialization._legacy_load(f)",
        "from torch._weights_only_unpickler import Unpickler",
        "import torch._weights_only_unpickler",
        "import torch\ngetattr(torch.serialization, '_open_zipfile_reader')",
        "x = '_weights_only_unpickler'",
    ],
)
def test_the_private_api_check_sees_each_form(code: str) -> None:
    assert _private_torch_uses(ast.parse(code)) != []
    assert _private_torch_uses(ast.parse("import torch\ntorch.load(f, weights_only=True)")) == []
