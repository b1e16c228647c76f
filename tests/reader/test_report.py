"""The HTML report of a diff (``trajtrack diff --html``, :func:`write_diff_report`)."""

from __future__ import annotations

import io
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread
import numpy as np
import pytest
import torch
from blockbuster import BlockBuster, blockbuster_ctx

from cli._runs import WritesMarker, write_run
from trajtrack import MissingDependencyError
from trajtrack.cli import main
from trajtrack.reader import (
    compare,
    diff_runs,
    load_divergent_tensor,
    open_run,
    render_diff_report,
    write_diff_report,
)
from trajtrack.reader._tensor_path import MISSING, difference_values, find_at_path
from trajtrack.rollout import RolloutBatch

pytest.importorskip("matplotlib", reason="the report extra: pip install 'trajtrack[report]'")

HOSTILE = '<script>alert("dump")</script>'
HOSTILE_KEY = "<img src=x onerror=alert(1)>"


def dumps(bump: float = 0.0) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {
        f"step{i}/obs": {"x": torch.randn(4, 5, generator=gen), "ids": torch.arange(6)}
        for i in range(4)
    }
    if bump:
        out["step1/obs"]["x"][2, 3] += bump
        out["step2/obs"]["x"][0, 0] += bump * 100
    return out


def diff(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["diff", *argv, "-q"], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def ab(tmp_path: Path) -> tuple[str, str]:
    return str(tmp_path / "a"), str(tmp_path / "b")


def test_first_divergence_counts_plot_and_histogram(ab: tuple[str, str], tmp_path: Path) -> None:
    a, b = ab
    write_run(a, {**dumps(), "gone": {"y": torch.zeros(2)}})
    write_run(b, {**dumps(bump=0.5), "new": {"y": torch.ones(2)}})
    report = tmp_path / "report.html"
    code, out, err = diff(a, b, "--html", str(report))
    assert code == 1
    assert f"HTML report written to {report}" in err
    page = report.read_text()
    assert 'id="first-divergence">step1/obs</strong>' in page
    assert "1 of 20 elements differ" in page and "first at index [2, 3]" in page
    for status, count in (("equal", 2), ("different", 2), ("only_in_a", 1), ("only_in_b", 1)):
        assert f'id="count-{status}">{count}</b>' in page
    assert 'id="count-error">0</b>' in page
    # The plot of every dump, with both magnitudes and the markers of the one-run dumps.
    (plot,) = re.findall(r'<svg[^>]*class="plot divergence".*?</svg>', page, re.DOTALL)
    assert plot.count("<use ") >= 2 + 2 + 2  # abs and rel markers, the one-run dumps
    (legend,) = re.findall(r'<ul class="legend" id="legend">(.*?)</ul>', page)
    marks = ["max abs |a-b|", "max rel |a-b|/|b|", "only in A (1)", "only in B (1)"]
    for label in [*marks, "different (2)", "equal (2)"]:
        assert f"</span> {label}</li>" in legend
    # The histogram of the first divergent tensor, reloaded from the runs.
    (histogram,) = re.findall(r'<svg[^>]*class="plot histogram".*?</svg>', page, re.DOTALL)
    assert "step1/obs [&#x27;x&#x27;]: float32 [4, 5], a - b of 20 elements" in histogram
    # The table: each non-equal dump, the differing key with its figures.
    table = page[page.index('<table id="differing-dumps">') :]
    for name in ("step1/obs", "step2/obs", "gone", "new"):
        assert f'<td class="mono">{name}</td>' in table
    row = table[table.index("step1/obs") : table.index("step2/obs")]
    assert "[&#x27;x&#x27;]" in row and "1 of 20" in row and "[2, 3]" in row
    assert ">0.5<" in row  # max abs
    assert "only in run A" in table and "only in run B" in table
    # The text output is the same as without --html.
    assert diff(a, b) == (1, out, "")


def test_exit_codes_unchanged(ab: tuple[str, str], tmp_path: Path) -> None:
    a, b = ab
    write_run(a, dumps())
    write_run(b, dumps())
    code, out, _ = diff(a, b, "--html", str(tmp_path / "same.html"))
    assert code == 0 and (code, out) == diff(a, b)[:2]
    page = (tmp_path / "same.html").read_text()
    assert "equal within tolerance (exit 0)" in page
    assert 'id="count-equal">4</b>' in page and "No tensor differs in value." in page
    assert 'class="plot histogram"' not in page
    c = str(tmp_path / "c")
    write_run(c, dumps(bump=1e-3))
    assert diff(a, c, "--html", str(tmp_path / "differ.html"))[0] == 1
    assert diff(a, c, "--atol", "1", "--html", str(tmp_path / "within.html"))[0] == 0


def test_error_dumps_are_marked(ab: tuple[str, str], tmp_path: Path) -> None:
    a, b = ab
    write_run(a, {**dumps(), "evil": {"x": torch.zeros(1)}})
    write_run(b, {**dumps(), "evil": WritesMarker(str(tmp_path / "owned"))})
    code, _, _ = diff(a, b, "--html", str(tmp_path / "r.html"))
    assert code == 2 == diff(a, b)[0]
    assert not (tmp_path / "owned").exists()  # refused, by the diff and by the report
    page = (tmp_path / "r.html").read_text()
    assert 'id="count-error">1</b>' in page and "error (1)" in page
    # An error alone is not a divergence, and the runs are not said to differ (issue 33).
    assert "first-divergence" not in page and "the runs differ" not in page
    assert "1 dumps could not be compared (exit 2); no difference found" in page
    assert '<span id="errors">1 dumps (errors, not divergences): <code>evil</code>' in page
    assert "refusing to load: it references posix.mkdir" in page


def test_hostile_names_keys_and_values_are_escaped(ab: tuple[str, str], tmp_path: Path) -> None:
    a, b = ab
    names = [f"step0/{HOSTILE}", HOSTILE_KEY, "cost $x^2$ & more"]
    write_run(a, {name: {HOSTILE_KEY: torch.zeros(3), "s": HOSTILE} for name in names})
    write_run(b, {name: {HOSTILE_KEY: torch.ones(3), "s": "<b>"} for name in names})
    report = tmp_path / "r.html"
    assert diff(a, b, "--html", str(report))[0] == 1
    page = report.read_text()
    assert "<script" not in page.lower() and "<img" not in page.lower()
    assert "<b>" not in page
    assert "&lt;script&gt;alert(&quot;dump&quot;)&lt;/script&gt;" in page
    assert "&lt;img src=x onerror=alert(1)&gt;" in page
    (plot,) = re.findall(r'<svg[^>]*class="plot divergence".*?</svg>', page, re.DOTALL)
    assert ">cost $x^2$ &amp; more</text>" in plot  # a tick label drawn as text, not mathtext


def test_nothing_is_loaded_from_the_network(ab: tuple[str, str], tmp_path: Path) -> None:
    a, b = ab
    write_run(a, dumps())
    write_run(b, {**dumps(bump=0.5), "new": {"y": torch.ones(2)}})
    report = tmp_path / "r.html"
    diff(a, b, "--html", str(report))
    page = report.read_text()
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"<link|<script|<iframe|<object|<embed|@import", page, re.IGNORECASE)
    references = re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]*)""", page, re.IGNORECASE)
    assert references and all(r.startswith("#") for r in references)  # the SVG's <use> refs
    assert all(u.startswith("#") for u in re.findall(r"url\(\s*([^)]*)\)", page))
    assert "Content-Security-Policy\" content=\"default-src 'none'" in page
    assert page.count("<svg") == 2


def test_structural_difference_has_no_histogram(ab: tuple[str, str], tmp_path: Path) -> None:
    a, b = ab
    write_run(a, {"x": {"t": torch.zeros(2, 3)}})
    write_run(b, {"x": {"t": torch.zeros(3, 2)}})
    assert diff(a, b, "--html", str(tmp_path / "r.html"))[0] == 1
    page = (tmp_path / "r.html").read_text()
    assert "shape [2, 3] vs [3, 2]" in page
    assert 'class="plot histogram"' not in page and "No tensor differs in value." in page
    assert "different (no numeric magnitude) (1)" in page


def test_report_needs_the_extra(
    ab: tuple[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = ab
    write_run(a, dumps())
    write_run(b, dumps())
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    code, out, err = diff(a, b, "--html", str(tmp_path / "r.html"))
    assert code == 2 and out == ""  # refused before the diff runs
    assert "pip install 'trajtrack[report]'" in err
    assert not (tmp_path / "r.html").exists()
    with pytest.raises(MissingDependencyError, match=r"trajtrack\[report\]"):
        render_diff_report(_fake_result(a, b))


def _fake_result(a: str, b: str) -> Any:
    from trajtrack.reader import RunDiff, Tolerance

    return RunDiff(a, b, Tolerance(), ())


@pytest.fixture
def blockbuster() -> Iterator[BlockBuster]:
    with blockbuster_ctx("trajtrack") as bb:
        yield bb


async def test_write_diff_report_is_deterministic_and_off_the_loop(
    tmp_path: Path, blockbuster: BlockBuster
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    blockbuster.deactivate()
    write_dumps = {**dumps(), "big": {"w": torch.randn(300, 300)}}
    await _write_async(a, write_dumps)
    write_dumps["big"]["w"][7, 9] -= 2.0
    await _write_async(b, write_dumps)
    async with open_run(a) as run_a, open_run(b) as run_b:  # open_run resolves the path
        blockbuster.activate()
        result = await diff_runs(run_a, run_b)
        divergent = await load_divergent_tensor(result, run_a, run_b)
        await write_diff_report(result, tmp_path / "r1.html", run_a=run_a, run_b=run_b)
        await write_diff_report(result, tmp_path / "r2.html", run_a=run_a, run_b=run_b)
        blockbuster.deactivate()
    assert divergent is not None and divergent.dump == "big" and divergent.path == "['w']"
    assert divergent.shape == (300, 300) and divergent.dtype == "float32"
    assert divergent.values.size == 90_000 and np.count_nonzero(divergent.values) == 1
    assert divergent.values.max() == pytest.approx(2.0)  # a - b, b = a - 2 at [7, 9]
    assert (tmp_path / "r1.html").read_bytes() == (tmp_path / "r2.html").read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))


async def _write_async(dest: str, objs: dict[str, Any]) -> None:
    import trajtrack

    async with trajtrack.Tracker(dest, workers=1) as tracker:
        for name, obj in objs.items():
            await (await tracker.dump(obj, name))


async def test_unreadable_dump_leaves_the_histogram_out(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    await _write_async(str(a), dumps())
    await _write_async(str(b), dumps(bump=0.5))
    async with open_run(a) as run_a, open_run(b) as run_b:
        result = await diff_runs(run_a, run_b)
        (b / "step1" / "obs.pth").write_bytes(b"not a dump any more")  # gone bad since
        await write_diff_report(result, tmp_path / "r.html", run_a=run_a, run_b=run_b)
    page = (tmp_path / "r.html").read_text()
    assert "The dump could not be loaded again" in page
    assert 'class="plot histogram"' not in page and 'class="plot divergence"' in page


async def test_table_rows_are_limited(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    await _write_async(a, {f"d{i:02d}": torch.zeros(2) for i in range(12)})
    await _write_async(b, {f"d{i:02d}": torch.ones(2) for i in range(12)})
    async with open_run(a) as run_a, open_run(b) as run_b:
        result = await diff_runs(run_a, run_b)
    page = await anyio.to_thread.run_sync(lambda: render_diff_report(result, max_dumps=5))
    assert page.count('<tr class="dump">') == 5
    assert "... 7 more differing dumps not listed." in page
    assert "Not drawn: the dumps were not reloaded" in page  # no DivergentTensor given
    assert 'id="count-different">12</b>' in page and "different (12)" in page  # all plotted


# --------------------------------------------------------------------- paths and differences


@dataclass
class Step:
    batch: RolloutBatch
    extras: list[Any]


class Plain:
    def __init__(self) -> None:
        self.weights = {"w": torch.zeros(2, 2)}


def nested(bump: float = 0.0) -> Step:
    objects = np.empty(2, dtype=object)
    objects[0], objects[1] = "s", torch.zeros(3)
    step = Step(
        RolloutBatch({"logp": torch.zeros(2, 3)}, {"objs": objects}, {"k": [torch.zeros(1)]}),
        [Plain(), {"deep": (torch.zeros(4), torch.arange(3))}],
    )
    if bump:
        step.batch.batch["logp"][1, 2] += bump
        objects[1][0] += bump
        step.batch.meta_info["k"][0][0] += bump
        step.extras[0].weights["w"][0, 1] += bump
        step.extras[1]["deep"][0][3] += bump
    return step


def test_every_path_compare_reports_leads_back_to_its_tensor() -> None:
    a, b = nested(), nested(bump=1.0)
    found = compare(a, b)
    assert len(found) == 5
    for difference in found:
        x, y = find_at_path(a, difference.path), find_at_path(b, difference.path)
        assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor), difference.path
        values = difference_values(x, y)
        assert values is not None
        assert values[0].min() == -1.0 and np.count_nonzero(values[0]) == 1
    paths = {d.path for d in found}
    assert ".batch.non_tensor_batch['objs'][1]" in paths
    assert ".extras[0].weights['w']" in paths
    assert find_at_path(a, ".extras[5]") is MISSING
    assert find_at_path(a, ".nothing") is MISSING
    assert find_at_path(a, "") is a


def test_difference_values_dtypes_nan_and_sampling(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.tensor([1.0, float("nan"), 3.0, float("inf")], dtype=torch.bfloat16)
    y = torch.tensor([0.5, 1.0, 3.0, 1.0], dtype=torch.bfloat16)
    values, non_finite, step, shape, dtype = difference_values(x, y)  # type: ignore[misc]
    assert values.tolist() == [0.5, 0.0] and non_finite == 2 and step == 1
    assert shape == (4,) and dtype == "bfloat16"
    flags = difference_values(torch.tensor([True, False]), torch.tensor([False, False]))
    assert flags is not None and flags[0].tolist() == [1.0, 0.0]
    complex_ = difference_values(np.array([3 + 4j]), np.array([0j]))
    assert complex_ is not None and complex_[0].tolist() == [5.0]
    assert difference_values(torch.zeros(2), torch.zeros(3)) is None
    assert difference_values("a", "b") is None
    monkeypatch.setattr("trajtrack.reader._tensor_path._MAX_SAMPLES", 10)
    big = difference_values(torch.arange(100.0), torch.zeros(100))
    assert big is not None and big[2] == 10 and big[0].tolist() == list(range(0, 100, 10))


def test_many_differing_dumps_are_drawn_as_one_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from trajtrack.reader._plots import DumpPoint, divergence_svg

    points = [DumpPoint(f"d{i}", "different", 1e-3 * (i + 1), 1e-2) for i in range(50)]
    with_markers, _ = divergence_svg(points, 0)
    monkeypatch.setattr("trajtrack.reader._plots._MAX_MARKERS", 10)
    dashes, legend = divergence_svg(points, 0)
    assert with_markers.count("<use ") >= 100  # a marker per magnitude
    assert dashes.count("<use ") < 20  # only the axes' ticks
    assert [label for _, _, label in legend] == [
        "different (50)",
        "max abs |a-b|",
        "max rel |a-b|/|b|",
    ]


def test_ignored_keys_notes_and_rows_are_in_the_report(ab: tuple[str, str], tmp_path: Path) -> None:
    a, b = ab
    write_run(a, {"s": {"timing_s": 1.0, "x": torch.zeros(3, 2), "uid": ["p", "q", "r"]}})
    write_run(b, {"s": {"timing_s": 2.0, "x": torch.eye(3, 2), "uid": ["p", "q", "r"]}})
    code, _, _ = diff(a, b, "--ignore", "*timing*", "--html", str(tmp_path / "r.html"))
    assert code == 1
    page = (tmp_path / "r.html").read_text()
    assert '<span id="ignored"><code>*timing*</code>: 1 keys</span>' in page
    assert '<td class="mono rows">0 (uid p), 1 (uid q)</td>' in page
