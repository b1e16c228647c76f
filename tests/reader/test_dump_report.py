"""The HTML report of one dump (``trajtrack show URL NAME --html``, :func:`render_dump_report`)."""

from __future__ import annotations

import html
import io
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cli._runs import write_run
from trajtrack.cli import main
from trajtrack.reader import DumpInfo, render_dump_report

pytest.importorskip("matplotlib", reason="the report extra: pip install 'trajtrack[report]'")

HOSTILE = "<script>alert(1)</script>"
INFO = DumpInfo("step/x", "step/x.pth", 10, None, "", "", None, None, 0.0, True, 10)


def show(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(["show", *argv], stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


def test_show_html_draws_each_tensor(tmp_path: Path) -> None:
    run = str(tmp_path / "run")
    obj = {
        "logp": -torch.arange(1.0, 13.0).reshape(3, 4),
        "ids": torch.arange(6),
        "nested": [{"mask": torch.tensor([True, False, True])}, "text", 3],
        "arr": np.array([1.5, np.nan, 2.5]),
        HOSTILE: torch.zeros(2),
    }
    write_run(run, {"step0/batch": obj})
    report = tmp_path / "show.html"
    code, out, err = show(run, "step0/batch", "--html", str(report))
    assert code == 0 and f"HTML report written to {report}" in err
    assert (code, out) == show(run, "step0/batch")[:2]  # the text output is unchanged
    page = report.read_text()
    keys = ["['logp']", "['ids']", "['nested'][0]['mask']", "['arr']", f"[{HOSTILE!r}]"]
    listed = re.findall(r'<td class="mono"><a href="#t\d+">([^<]*)</a></td>', page)
    assert listed == [html.escape(k) for k in keys]
    assert page.count('class="plot histogram"') == 5
    row = page[page.index("[&#x27;logp&#x27;]</a>") :].split("</tr>", 1)[0]
    assert ">-12<" in row and ">-1<" in row and ">-6.5<" in row  # min, max, mean
    arr = page[page.index("[&#x27;arr&#x27;]</a>") :].split("</tr>", 1)[0]
    assert arr.endswith('<td class="num">1</td>')  # one NaN, counted, not drawn
    assert "<script" not in page.lower() and "http://" not in page and "https://" not in page
    references = re.findall(r"""(?:src|href)\s*=\s*["']?([^"'\s>]*)""", page)
    assert all(r.startswith("#") for r in references)


def test_limits_and_empty_dumps() -> None:
    page = render_dump_report(
        {f"t{i}": torch.ones(2) for i in range(5)}, INFO, url="r", max_tensors=3
    )
    assert page.count('class="plot histogram"') == 3
    assert "Only the first 3 tensors are listed and drawn." in page
    empty = render_dump_report({"s": "text", "n": 3}, INFO, url="r")
    assert "No tensor or numeric array in this dump." in empty
    assert 'class="plot histogram"' not in empty


def test_complex_and_large_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("trajtrack.reader._tensor_path._MAX_SAMPLES", 100)
    page = render_dump_report(
        {"z": torch.tensor([3 + 4j, 0j]), "big": torch.arange(1000.0)}, INFO, url="r"
    )
    z = page[page.index('<h3 id="t0">') :].split("<h3", 2)[1]
    assert "|value|" in z
    row = page[page.index("[&#x27;z&#x27;]</a>") :].split("</tr>", 1)[0]
    assert ">5<" in row and ">0<" in row  # |3+4j| = 5
    assert "every 10th element drawn; statistics of those" in page


def test_show_html_needs_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = str(tmp_path / "run")
    write_run(run, {"x": torch.zeros(2)})
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, out, err = show(run, "x", "--html", str(tmp_path / "r.html"))
    assert code == 2 and out == "" and "pip install 'trajtrack[report]'" in err
    assert not (tmp_path / "r.html").exists()


def test_shared_and_expanded_tensors_are_bounded() -> None:
    # Issue 32: a list DAG of shared references holds one tensor, reached by 2**60 paths: it is
    # listed once; a stride-0 tensor claiming 2**34 elements is listed without statistics or
    # values computed from a materialized copy.
    dag: list[object] = [torch.arange(3.0)]
    for _ in range(60):
        dag = [dag, dag]
    page = render_dump_report({"dag": dag, "wide": torch.ones(1).expand(2**34)}, INFO, url="r")
    (table,) = re.findall(r'<table id="tensors">.*?</table>', page, re.DOTALL)
    assert table.count("<tr>") == 3  # the head, the DAG's one tensor, the expanded one
    assert "17179869184" in table
