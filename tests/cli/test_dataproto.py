"""A dump of verl's ``DataProto`` is refused with advice: export a ``RolloutBatch`` instead.

verl 0.9.1's ``DataProto.__setstate__`` calls ``torch.load(weights_only=False)`` on the
TensorDict inside it, so allow-listing ``DataProto`` would make the load unrestricted. verl is
not installed here: a stand-in ``verl.protocol.DataProto`` is made for the test.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import trajtrack
from trajtrack.reader import load_dump_file

from ._runs import run_cli, write_run


@pytest.fixture
def dataproto_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    verl = types.ModuleType("verl")
    protocol = types.ModuleType("verl.protocol")

    class DataProto:
        def __init__(self, batch: dict[str, Any]) -> None:
            self.batch = batch
            self.non_tensor_batch: dict[str, Any] = {}
            self.meta_info: dict[str, Any] = {}

    DataProto.__module__ = "verl.protocol"
    DataProto.__qualname__ = "DataProto"
    protocol.DataProto = DataProto  # type: ignore[attr-defined]
    verl.protocol = protocol  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "verl", verl)
    monkeypatch.setitem(sys.modules, "verl.protocol", protocol)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_run(a, {"batch": DataProto({"x": torch.ones(2)})})
    write_run(b, {"batch": DataProto({"x": torch.zeros(2)})})
    return a, b


ADVICE = (
    "verl.protocol.DataProto",
    "torch.load(weights_only=False)",
    "RolloutBatch(batch=dict(proto.batch.items()), non_tensor_batch=proto.non_tensor_batch, "
    "meta_info=proto.meta_info)",
    "--unsafe only if you trust its source",
)


def test_show_refuses_a_dataproto_and_says_what_to_do(
    dataproto_run: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, "show", dataproto_run[0], "batch")
    assert code == 2 and out == ""
    for part in ADVICE:
        assert part in err


def test_diff_refuses_a_dataproto_and_says_what_to_do(
    dataproto_run: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = run_cli(capsys, "diff", *dataproto_run)
    assert code == 2
    for part in ADVICE:
        assert part in out


def test_the_library_refuses_it_too(dataproto_run: tuple[str, str]) -> None:
    with pytest.raises(trajtrack.UnsafeLoadError, match=r"Dump the batch as a .*RolloutBatch"):
        load_dump_file(Path(dataproto_run[0]) / "batch.pth")
