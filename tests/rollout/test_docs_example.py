"""The worked example in docs/rollout.md runs and its assertions hold."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "rollout.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.DOTALL)


def test_worked_example_runs(tmp_path: Path) -> None:
    example = python_blocks()[0]
    assert "rollouter" in example and "MetricsAggregator" in example
    code = example.replace("/tmp/trajtrack-rollout-demo", str(tmp_path))
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(code, str(DOC), "exec"), namespace)
    assert len(list(tmp_path.glob("v0/sample*.pth"))) == 4


def test_rules_example_runs() -> None:
    exec(compile(python_blocks()[-1], str(DOC), "exec"), {"__name__": "docs_rules"})
