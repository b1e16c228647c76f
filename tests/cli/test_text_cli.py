"""``show``/``diff --tokenizer``: token ids read back as the words that made them.

The tokenizer is built here with ``tokenizers`` (a word-level vocabulary, whitespace split) and
saved as ``tokenizer.json`` in a model-like directory: nothing is downloaded. Every expected
text is the sentence the ids were made from, not the library's own decoding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from _support.browser import Browser, chromium_or_skip
from trajtrack.rollout import RolloutBatch, RolloutSample

from ._runs import run_cli, write_run

tokenizers = pytest.importorskip(
    "tokenizers", reason="the text extra: pip install 'trajtrack[text]'"
)

PROMPTS = [f"what is {a} plus {b} ?" for a, b in [("one", "two"), ("two", "two"), ("one", "one")]]
RESPONSES = ["one plus two is three .", "two plus two is four .", "one plus one is two ."]
VOCAB = ["[PAD]", "[UNK]", "what", "is", "plus", "?", ".", "one", "two", "three", "four", "five"]
PAD = 0
WIDTH = 8  # prompt and response widths: prompts left-padded, responses right-padded to it


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    tok = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]")
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    folder = tmp_path / "model"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def ids(sentence: str) -> list[int]:
    return [VOCAB.index(w) for w in sentence.split()]


def rollout(responses: list[str]) -> RolloutSample:
    """A verl-shaped sample: prompts left-padded, responses right-padded, one attention mask."""
    prompts = torch.tensor([[PAD] * (WIDTH - len(ids(p))) + ids(p) for p in PROMPTS])
    resp = torch.tensor([ids(r) + [PAD] * (WIDTH - len(ids(r))) for r in responses])
    attention = torch.cat([prompts != PAD, resp != PAD], dim=1).long()
    batch = RolloutBatch(
        {
            "prompts": prompts,
            "responses": resp,
            "input_ids": torch.cat([prompts, resp], dim=1),
            "attention_mask": attention,
            "response_mask": (resp != PAD).long(),
        },
        {"uid": np.array([f"u-{i}" for i in range(len(responses))], dtype=object)},
        {},
    )
    return RolloutSample(full_batch=batch, sample_id="sample_0_0")


def test_show_prints_each_rows_uid_prompt_and_response(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = str(tmp_path / "run")
    write_run(run, {"step1/sample0": rollout(RESPONSES)})
    code, out, err = run_cli(capsys, "show", run, "step1/sample0", "--tokenizer", str(model_dir))
    assert code == 0, err
    text = out[out.index("text:") :].splitlines()
    assert text[1] == "  .full_batch.batch row 0 (uid u-0)"
    for row in range(3):
        assert f"    prompt: {PROMPTS[row]!r}" in text
        assert f"    response: {RESPONSES[row]!r}" in text
    assert not any(line.startswith("    text:") for line in text)  # input_ids: no repeat

    code, out, _ = run_cli(
        capsys,
        "show",
        run,
        "step1/sample0",
        "--tokenizer",
        str(model_dir / "tokenizer.json"),
        "--rows",
        "2",
        "--json",
    )
    rows = json.loads(out)["text"]
    assert rows == [
        {
            "path": ".full_batch.batch",
            "row": 2,
            "uid": "u-2",
            "texts": {"prompts": PROMPTS[2], "responses": RESPONSES[2]},
        }
    ]


def test_show_bounds_the_rows_by_default_and_decodes_named_keys(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = str(tmp_path / "run")
    words = [f"{w} is {w} ." for w in ("one", "two", "three", "four", "five")] * 2
    write_run(run, {"d": {"my_ids": torch.tensor([ids(w) for w in words])}})
    code, out, _ = run_cli(
        capsys, "show", run, "d", "--tokenizer", str(model_dir), "--text-keys", "my_ids", "--json"
    )
    assert code == 0
    rows = json.loads(out)["text"]
    assert [r["row"] for r in rows] == list(range(8))  # 10 rows, the first 8 shown
    assert [r["texts"]["my_ids"] for r in rows] == words[:8]
    assert rows[0]["path"] == "" and rows[0]["uid"] is None  # the dump itself holds them


def test_diff_names_the_first_differing_token_and_both_texts(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    other = [RESPONSES[0], "two plus two is five .", RESPONSES[2]]
    write_run(a, {"step1/sample0": rollout(RESPONSES)})
    write_run(b, {"step1/sample0": rollout(other)})
    code, out, err = run_cli(capsys, "diff", a, b, "--tokenizer", str(model_dir))
    assert code == 1, err
    four, five = VOCAB.index("four"), VOCAB.index("five")
    lines = out[out.index("token text of the differing rows:") :].splitlines()
    assert lines[1] == (
        "step1/sample0 .full_batch.batch['responses'] row 1 (uid u-1): first differing token #4 "
        f"(1 rows differ): A={four} 'four'  B={five} 'five'"
    )
    assert lines[2] == "    A: 'two plus two is «four» .'"
    assert lines[3] == "    B: 'two plus two is «five» .'"
    assert len(lines) == 4  # input_ids repeat prompts + responses: not shown again

    code, out, _ = run_cli(capsys, "diff", a, b, "--tokenizer", str(model_dir), "--json")
    (found,) = json.loads(out)["text"]["step1/sample0"]
    assert found["tokens"] == [four, five] and found["position"] == 4
    assert found["contexts"] == [
        ["two plus two is ", "four", " ."],
        ["two plus two is ", "five", " ."],
    ]


def test_text_from_a_dump_is_escaped_on_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vocab = {"[UNK]": 0, "hi": 1, "\x1b[31mred": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tok.json"))
    run = str(tmp_path / "run")
    write_run(run, {"d": {"input_ids": torch.tensor([[1, 2]])}})
    code, out, _ = run_cli(capsys, "show", run, "d", "--tokenizer", str(tmp_path / "tok.json"))
    assert code == 0 and "\x1b" not in out
    assert "text: 'hi \\x1b[31mred'" in out


def test_a_missing_tokenizer_or_extra_is_a_clear_error(
    tmp_path: Path,
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run = str(tmp_path / "run")
    write_run(run, {"d": {"input_ids": torch.tensor([[1, 2]])}})
    code, _, err = run_cli(capsys, "show", run, "d", "--tokenizer", str(tmp_path))
    assert code == 2 and "no tokenizer.json there" in err
    (tmp_path / "bad.json").write_text("{}")
    code, _, err = run_cli(capsys, "diff", run, run, "--tokenizer", str(tmp_path / "bad.json"))
    assert code == 2 and "not a tokenizer file" in err
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if the extra were not installed
    code, _, err = run_cli(capsys, "show", run, "d", "--tokenizer", str(model_dir))
    assert code == 2 and "pip install 'trajtrack[text]'" in err
    code, _, err = run_cli(capsys, "show", run, "d", "--rows", "x")
    assert code == 2 and "'0-3,7'" in err


@pytest.mark.browser
def test_the_report_shows_both_texts_with_the_difference_marked(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib", reason="the report extra: pip install 'trajtrack[report]'")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_run(a, {"step1/<b>sample</b>": rollout(RESPONSES)})
    write_run(b, {"step1/<b>sample</b>": rollout([*RESPONSES[:2], "one plus one is five ."])})
    report = tmp_path / "r.html"
    code, _, err = run_cli(
        capsys, "diff", a, b, "--tokenizer", str(model_dir), "--html", str(report)
    )
    assert code == 1, err
    executable = chromium_or_skip()
    with Browser(executable, tmp_path / "profile") as browser:
        browser.open(report.as_uri(), width=1200)
        page = browser.evaluate(
            "({cells: [...document.querySelectorAll('#text table.text td')].map(td => ["
            "   td.textContent, td.querySelector('mark').textContent,"
            "   td.getBoundingClientRect().width]),"
            " marks: [...document.querySelectorAll('#text mark')].map(m =>"
            "   getComputedStyle(m).backgroundColor),"
            " heading: document.querySelector('#text h3').textContent,"
            " bold: document.querySelectorAll('#text b').length})"
        )
    assert browser.errors == []
    assert page["heading"].startswith("step1/<b>sample</b> .full_batch.batch['responses'] row 2")
    (text_a, mark_a, width_a), (text_b, mark_b, width_b) = page["cells"]
    assert (text_a, mark_a) == ("one plus one is two .", "two")
    assert (text_b, mark_b) == ("one plus one is five .", "five")
    assert width_a > 300 and width_b > 300  # side by side, each half the table
    assert all(color not in ("rgba(0, 0, 0, 0)", "") for color in page["marks"])
    assert page["bold"] == 0  # the hostile name stayed text
