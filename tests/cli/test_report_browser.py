"""The diff report in a real browser: it loads without errors and draws something.

Headless Chromium over the DevTools protocol (``tests/_support/browser.py``): the page must
load with no console error, uncaught exception or refused load (the page's
Content-Security-Policy forbids every fetch, so an external resource shows up here as an
error), its two plots must be laid out at a real size, and a screenshot of it must not be
blank. Skipped without Chromium unless ``TRAJTRACK_REQUIRE_BROWSER=1``.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from _support.browser import Browser, chromium_or_skip

from ._runs import run_cli, write_run

pytestmark = pytest.mark.browser

WIDTH = 1200


def _dumps(bump: float = 0.0) -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    out: dict[str, object] = {
        f"step{i}/batch": {
            "logp": torch.randn(8, 16, generator=gen),
            "uid": [f"s{j}" for j in range(8)],
        }
        for i in range(6)
    }
    if bump:
        out["step2/batch"]["logp"][3, 4] += bump  # type: ignore[index]
        out["step4/batch"]["logp"] += bump / 10  # type: ignore[operator]
    return out


@pytest.fixture
def report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    pytest.importorskip("matplotlib", reason="the report extra: pip install 'trajtrack[report]'")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_run(a, {**_dumps(), "only/a": {"x": torch.zeros(1)}})
    write_run(b, {**_dumps(bump=0.01), "<script>alert(1)</script>": {"x": torch.ones(1)}})
    path = tmp_path / "report.html"
    code, _, err = run_cli(capsys, "diff", a, b, "--html", str(path))
    assert code == 1, err
    return path


def test_report_renders_in_chromium_without_errors(report: Path, tmp_path: Path) -> None:
    executable = chromium_or_skip()
    with Browser(executable, tmp_path / "profile") as browser:
        browser.open(report.as_uri(), width=WIDTH)
        page = browser.evaluate(
            "({title: document.title,"
            " plots: [...document.querySelectorAll('svg.plot')].map(s => ["
            "   s.getAttribute('class'), s.getBoundingClientRect().width,"
            "   s.getBoundingClientRect().height]),"
            " first: document.getElementById('first-divergence').textContent,"
            " rows: document.querySelectorAll('#differing-dumps tr.dump').length,"
            " samples: [...document.querySelectorAll('#differing-dumps td.rows')].map("
            "   td => td.textContent),"
            " scripts: document.scripts.length,"
            " height: document.documentElement.scrollHeight})"
        )
        png = browser.screenshot(WIDTH, min(int(page["height"]), 2400))
    assert browser.errors == []
    assert page["title"].startswith("trajtrack diff: ")
    assert page["first"] == "step2/batch"
    assert page["rows"] == 4  # 2 different, 1 only in A, 1 only in B
    every_row = ", ".join(f"{j} (uid s{j})" for j in range(8))
    assert page["samples"] == ["3 (uid s3)", every_row]  # each differing row, with its uid
    assert page["scripts"] == 0  # the hostile dump name stayed text
    kinds = {cls: (w, h) for cls, w, h in page["plots"]}
    assert set(kinds) == {"plot divergence", "plot histogram"}
    for width, height in kinds.values():
        assert width > 500 and height > 150
    _assert_not_blank(png)


def _assert_not_blank(png: bytes) -> None:
    from matplotlib.image import imread

    pixels = imread(io.BytesIO(png), format="png")[..., :3]  # floats in [0, 1], RGB
    assert pixels.shape[1] == WIDTH and pixels.shape[0] > 1000
    ink = (pixels < 0.9).any(axis=-1)  # anything that is not (near) white
    assert ink.mean() > 0.01, f"only {ink.mean():.2%} of the page is drawn"
    assert float(pixels.std()) > 0.05
    red = (pixels[..., 0] > 0.6) & (pixels[..., 1] < 0.45) & (pixels[..., 2] < 0.45)
    assert red.sum() > 200, "no red markers or bars: the plots are not drawn"
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50


def test_show_report_renders_in_chromium_without_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="the report extra: pip install 'trajtrack[report]'")
    executable = chromium_or_skip()
    run = str(tmp_path / "run")
    write_run(run, {"step0/batch": {"logp": torch.randn(8, 16), "<b>ids</b>": torch.arange(9)}})
    path = tmp_path / "show.html"
    assert run_cli(capsys, "show", run, "step0/batch", "--html", str(path))[0] == 0
    with Browser(executable, tmp_path / "profile") as browser:
        browser.open(path.as_uri(), width=WIDTH)
        page = browser.evaluate(
            "({plots: [...document.querySelectorAll('svg.histogram')].map("
            "   s => s.getBoundingClientRect().width),"
            " keys: [...document.querySelectorAll('#tensors a')].map(a => a.textContent),"
            " bold: document.querySelectorAll('b').length,"
            " height: document.documentElement.scrollHeight})"
        )
        png = browser.screenshot(WIDTH, min(int(page["height"]), 2400))
    assert browser.errors == []
    assert page["keys"] == ["['logp']", "['<b>ids</b>']"] and page["bold"] == 0
    assert len(page["plots"]) == 2 and all(width > 500 for width in page["plots"])
    _assert_not_blank(png)
