"""The worked example in docs/rollout.md runs and its assertions hold."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from trajtrack.rollout import Aggregation, MetricsAggregator

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


def test_rules_example_does_what_the_docs_say() -> None:
    namespace: dict[str, Any] = {"__name__": "docs_rules"}
    exec(compile(python_blocks()[-1], str(DOC), "exec"), namespace)
    rules = namespace["rules"]
    assert rules.classify("training/epoch") is Aggregation.LAST  # the extended exact rule
    assert rules.classify("perf/time_per_step") is Aggregation.TIME_SUM  # defaults kept
    first = MetricsAggregator(
        total_gpus=8,
        exact_rules={"actor/lr": "last"},
        pattern_rules=[("staleness", "max"), (re.compile(r"^eval/"), "last")],
    )
    assert first.rules.classify("actor/lr") is Aggregation.LAST
    assert first.rules.classify("rollout/staleness_mean") is Aggregation.MAX  # pattern first
    assert first.rules.classify("eval/score") is Aggregation.LAST
