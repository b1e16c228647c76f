"""A rollout record's pickled state is untrusted: only its class's own fields are rebuilt.

``rebuild_sample(state)`` / ``rebuild_metrics(state)`` used to copy any dict of str keys into
the new object. A state missing ``full_batch`` crashed ``show`` and ``diff`` with a raw
traceback; a ``__dataclass_fields__`` key shadowed the class's field list, and an empty one hid
every field, so ``diff`` called two samples with different tensors equal.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import re
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import trajtrack.reader._load_worker as load_worker
from cli._runs import run_cli, run_json, write_run
from trajtrack import DumpLoadError
from trajtrack.reader import load_dump_bytes, open_run
from trajtrack.reader._fast_load import DECLINED, fast_load
from trajtrack.reader._safe_load import allowed_globals
from trajtrack.rollout import BatchTypeError, RolloutBatch, RolloutSample, ValidateMetrics
from trajtrack.rollout._pickling import rebuild_metrics, rebuild_sample


class Crafted:
    """Pickles as the rebuild call a hostile run directory can hold: any state at all."""

    def __init__(self, rebuild: Any, state: dict[str, Any]) -> None:
        self.rebuild, self.state = rebuild, state

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.rebuild, (self.state,))


def sample_state(value: float, **extra: Any) -> dict[str, Any]:
    state = dict(vars(RolloutSample(full_batch=torch.full((2,), value), sample_id="s")))
    state.update(extra)
    return state


MISSING = {k: v for k, v in sample_state(1.0).items() if k != "full_batch"}
SHADOWED = sample_state(1.0, __dataclass_fields__=5)
# (rebuild, state, what the message says)
BAD = {
    "missing": (rebuild_sample, MISSING, "missing field(s) 'full_batch'"),
    "shadowed": (rebuild_sample, SHADOWED, "unknown field(s) '__dataclass_fields__'"),
    "hidden": (rebuild_sample, sample_state(1.0, __dataclass_fields__={}), "unknown field"),
    "wrong type": (rebuild_sample, sample_state(1.0, epoch="one"), "'epoch' holds a str"),
    "metrics missing": (rebuild_metrics, {"metrics": None}, "missing field(s) 'timing_raw'"),
}


def loaded(run_dir: Path, name: str) -> Any:
    """``open_run(run_dir).load(name)``: the reader's public route."""

    async def go() -> Any:
        async with open_run(str(run_dir)) as run:
            return await run.load(name)

    return anyio.run(go)


def saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_state_is_a_typed_error_naming_it(case: str) -> None:
    rebuild, state, says = BAD[case]
    with pytest.raises(DumpLoadError, match=re.escape(says)) as info:
        rebuild(state)
    assert isinstance(info.value, BatchTypeError)  # what every rebuild raises for bad input
    data = saved(Crafted(rebuild, state))
    assert fast_load(data) is DECLINED  # trajtrack's fast path leaves the refusal to torch
    in_process = torch.serialization.safe_globals(list(allowed_globals()))  # torch, here
    with in_process, pytest.raises(DumpLoadError, match=re.escape(says)):
        load_dump_bytes(data, where="x")


def test_the_load_worker_refuses_a_bad_state() -> None:
    reply = load_worker.request_load(data=saved(Crafted(rebuild_sample, SHADOWED)))
    assert reply.status != "ok" and "unknown field(s) '__dataclass_fields__'" in reply.message


def test_open_run_load_raises_the_typed_error(tmp_path: Path) -> None:
    write_run(str(tmp_path), {"x": Crafted(rebuild_sample, MISSING)})
    with pytest.raises(DumpLoadError, match="missing field"):
        loaded(tmp_path, "x")


@pytest.mark.parametrize("case", ["missing", "shadowed", "hidden"])
def test_show_exits_2_with_the_message_and_no_traceback(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rebuild, state, says = BAD[case]
    write_run(str(tmp_path), {"x": Crafted(rebuild, state)})
    code, out, err = run_cli(capsys, "show", str(tmp_path), "x")
    assert code == 2 and out == ""
    assert says in err and "Traceback" not in err


def test_diff_of_hidden_fields_is_not_equal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_run(a, {"x": Crafted(rebuild_sample, sample_state(1.0, __dataclass_fields__={}))})
    write_run(b, {"x": Crafted(rebuild_sample, sample_state(0.0, __dataclass_fields__={}))})
    code, report = run_json(capsys, "diff", a, b)
    assert code != 0 and report["errors"] == ["x"] and report["counts"]["equal"] == 0


def test_diff_with_a_missing_field_exits_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_run(a, {"x": Crafted(rebuild_sample, MISSING)})
    write_run(b, {"x": Crafted(rebuild_sample, sample_state(1.0))})
    code, out, err = run_cli(capsys, "diff", a, b)
    assert code == 2 and "missing field(s) 'full_batch'" in out
    assert "Traceback" not in out + err


def test_correct_records_still_round_trip(tmp_path: Path) -> None:
    batch = RolloutBatch({"r": torch.arange(6.0).reshape(2, 3)})
    sample = RolloutSample(full_batch=batch, sample_id="s", epoch=2, processing_times=[0.5])
    metrics = ValidateMetrics(timing_raw={"t": torch.tensor(1.5)}, global_steps=3)
    write_run(str(tmp_path), {"sample": sample, "metrics": metrics})
    got, got_metrics = loaded(tmp_path, "sample"), loaded(tmp_path, "metrics")
    assert type(got) is RolloutSample and vars(got).keys() == vars(sample).keys()
    assert torch.equal(got.full_batch.batch["r"], batch.batch["r"])
    assert (got.sample_id, got.epoch, got.processing_times) == ("s", 2, [0.5])
    assert torch.equal(got_metrics.timing_raw["t"], metrics.timing_raw["t"])
    assert got_metrics.global_steps == 3 and got_metrics.metrics is None
    assert fast_load(saved(sample)) is not DECLINED  # still the fast path, no worker


def test_a_field_with_a_default_may_be_absent() -> None:
    got = rebuild_sample({"full_batch": torch.ones(1), "sample_id": "s"})
    assert got.epoch == 0 and got.processing_times == []
    assert torch.equal(got.full_batch, torch.ones(1))


# ------------------------------------------------------------------ dumps of the old form

OLD_STATE: dict[str, Any] = {}


class _OldFormPickler(pickle.Pickler):
    """Pickles a record as dumps written before the rebuild form did: ``NEWOBJ`` of its class
    and ``BUILD`` of a state (``OLD_STATE`` when set, else its attributes)."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in (RolloutSample, ValidateMetrics):
            return copyreg.__newobj__, (type(obj),), OLD_STATE or dict(vars(obj))
        return NotImplemented


class _OldForm:  # the pickle_module torch.save takes: only Pickler is used
    Pickler = _OldFormPickler


def old_form(obj: Any, state: dict[str, Any] | None = None) -> bytes:
    OLD_STATE.clear()
    OLD_STATE.update(state or {})
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_module=_OldForm)
    OLD_STATE.clear()
    assert pickle.NEWOBJ in buffer.getvalue() and pickle.BUILD in buffer.getvalue()
    return buffer.getvalue()


def in_this_process() -> Any:
    return torch.serialization.safe_globals(list(allowed_globals()))


@pytest.mark.parametrize("case", ["missing", "shadowed", "hidden", "wrong type"])
def test_an_old_form_dump_with_a_bad_state_is_refused_both_ways(case: str) -> None:
    _, state, says = BAD[case]
    data = old_form(RolloutSample(full_batch=torch.ones(2)), state)
    with in_this_process(), pytest.raises(DumpLoadError, match=re.escape(says)):
        load_dump_bytes(data, where="x")  # torch's BUILD, in this process
    with pytest.raises(DumpLoadError, match=re.escape(says)):
        load_dump_bytes(data, where="x")  # the load worker's, passed back


def test_an_old_form_dump_still_loads_both_ways() -> None:
    data = old_form(RolloutSample(full_batch=torch.arange(3.0), sample_id="s", epoch=4))
    with in_this_process():
        here = load_dump_bytes(data, where="x")
    for got in (here, load_dump_bytes(data, where="x")):
        assert type(got) is RolloutSample and (got.sample_id, got.epoch) == ("s", 4)
        assert torch.equal(got.full_batch, torch.arange(3.0)) and got.processing_times == []
