"""Case 5, concurrency across processes: 4 processes x 8 tasks write one directory.

With the ``{rank}`` name template nothing collides and nothing is lost. Without a template
and with the ``error`` existing-name policy, every collision is reported as
:class:`DumpExistsError` on the losing handles, each name is committed by exactly one process,
and the stored file is that process's data (nothing silently overwritten).
"""

from __future__ import annotations

from pathlib import Path

from ._payloads import KIB, check_file
from ._proc import Child, child_env, final_files, records

PROCESSES = 4
TASKS = 8
PER_TASK = 6


def _run_ranks(dest: Path, template: str, on_exists: str) -> list[dict[str, object]]:
    children = [
        Child(
            "ranks",
            dest,
            template,
            on_exists,
            TASKS,
            PER_TASK,
            env=child_env(RANK=str(rank), WORLD_SIZE=str(PROCESSES)),
        )
        for rank in range(PROCESSES)
    ]
    results = [child.result() for child in children]
    for child in children:
        assert child.finish() == 0, child.stderr
    return results


def _names() -> set[str]:
    return {f"s{j}/task{t}" for j in range(PER_TASK) for t in range(TASKS)}


def test_rank_template_keeps_processes_apart(tmp_path: Path) -> None:
    dest = tmp_path / "run"
    results = _run_ranks(dest, "{name}.rank{rank}", "error")
    for result in results:
        assert result["exists"] == [] and result["other"] == [], result
    expected = {f"{name}.rank{rank}" for name in _names() for rank in range(PROCESSES)}
    files = final_files(dest)
    assert set(files) == expected
    for stored, path in files.items():
        name, _, rank = stored.rpartition(".rank")
        check_file(path, f"{name}@{rank}", KIB, 64 * KIB)
    recorded = [r.name for r in records(dest)]
    assert sorted(recorded) == sorted(expected)


def test_collisions_without_template_are_reported_never_overwritten(tmp_path: Path) -> None:
    dest = tmp_path / "run"
    results = _run_ranks(dest, "{name}", "error")
    winner: dict[str, int] = {}
    for result in results:
        assert result["other"] == [], result
        for path in result["committed"]:  # type: ignore[attr-defined]
            name = path.removesuffix(".pth")
            assert name not in winner, f"{name} committed twice"
            winner[name] = result["rank"]  # type: ignore[assignment]
    assert set(winner) == _names()
    losses = sum(len(r["exists"]) for r in results)  # type: ignore[arg-type]
    assert losses == len(_names()) * (PROCESSES - 1)  # every collision reported
    files = final_files(dest)
    assert set(files) == _names()
    for name, path in files.items():
        check_file(path, f"{name}@{winner[name]}", KIB, 64 * KIB)  # the winner's bytes
    recorded = [r.name for r in records(dest)]
    assert sorted(recorded) == sorted(_names())
