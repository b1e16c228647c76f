"""DataProto-shaped dumps: read as data, or refused with a typed error and nothing run.

verl is not needed: a DataProto-shaped pickle is written with classes and functions that pickle
under verl's and tensordict's names (modules registered in ``sys.modules`` while pickling, as
pickle requires). Real verl 0.9.1 objects are tested in ``tests/verl``. Expected values are
computed with numpy from the raw bytes, independently of trajtrack's decoder.
"""

from __future__ import annotations

import io
import subprocess
import sys
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trajtrack
from trajtrack.reader import load_dump_bytes
from trajtrack.rollout import RolloutBatch

from ._runs import WritesMarker, run_cli

ROWS = 2


class Foreign:
    """Objects that pickle as verl's DataProto and tensordict's consolidated reduction."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        modules = {
            name: types.ModuleType(name)
            for name in ("verl", "verl.protocol", "tensordict", "tensordict._reductions")
        }

        class DataProto:
            def __init__(self, state: Any) -> None:
                self.state = state

            def __getstate__(self) -> Any:
                return self.state

        def function(name: str) -> Any:
            def rebuild(*args: Any) -> Any:  # pragma: no cover - never unpickled
                raise AssertionError("tensordict's function must never run")

            rebuild.__module__ = "tensordict._reductions"
            rebuild.__qualname__ = rebuild.__name__ = name
            setattr(modules["tensordict._reductions"], name, rebuild)
            return rebuild

        DataProto.__module__, DataProto.__qualname__ = "verl.protocol", "DataProto"
        modules["verl.protocol"].DataProto = DataProto  # type: ignore[attr-defined]
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        self.DataProto = DataProto
        self.rebuild = function("_rebuild_tensordict_files_consolidated")
        self.rebuild_files = function("_rebuild_tensordict_files")

    def consolidated(self, metadata: Any, storage: Any) -> Any:
        return self.reduced(self.rebuild, metadata, storage)

    @staticmethod
    def reduced(function: Any, *args: Any) -> Any:
        class Reduced:
            def __reduce__(self) -> tuple[Any, ...]:
                return (function, args)

        return Reduced()

    def proto(self, batch_bytes: Any, non_tensor: Any = None, meta: Any = None) -> bytes:
        state = (batch_bytes, {} if non_tensor is None else non_tensor, meta or {})
        return saved(self.DataProto(state))


def saved(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def metadata(leaves: dict[str, Any], **subs: Any) -> dict[str, Any]:
    cls_metadata = {"batch_size": [ROWS], "device": None, "names": [None], "is_locked": False}
    return {
        "cls": "TensorDict",
        "non_tensors": {},
        "leaves": leaves,
        "cls_metadata": cls_metadata,
        **subs,
    }


STORAGE = torch.arange(16, dtype=torch.float32).view(torch.uint8)  # 64 bytes
RAW = STORAGE.numpy().tobytes()
GOOD_LEAVES = {
    "x": ("torch.float32", [ROWS, 4], 0, 32, False),
    "y": ("torch.int64", [ROWS, 2], 32, 64, False),
}


@pytest.fixture
def foreign(monkeypatch: pytest.MonkeyPatch) -> Foreign:
    return Foreign(monkeypatch)


def dump(tmp_path: Path, name: str, data: bytes) -> str:
    run = tmp_path / name
    run.mkdir()
    (run / "batch.pth").write_bytes(data)
    return str(run)


def test_a_consolidated_dataproto_reads_as_a_rollout_batch(
    foreign: Foreign, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sub = metadata({"z": ("torch.bfloat16", [ROWS], 8, 12, False)})
    inner = saved(foreign.consolidated(metadata(GOOD_LEAVES, n=sub), STORAGE))
    uid = np.array(["a", "b"], dtype=object)
    data = foreign.proto(inner, {"uid": uid}, {"step": 3})
    run = dump(tmp_path, "r", data)
    code, out, err = run_cli(capsys, "show", run, "batch")  # the CLI: in this process
    assert code == 0, err
    assert "['n']: dict" in out and "['z']: Tensor bfloat16 [2]" in out
    batch = load_dump_bytes(data)
    assert type(batch) is RolloutBatch
    want_x = np.frombuffer(RAW[:32], dtype=np.float32).reshape(ROWS, 4)
    want_y = np.frombuffer(RAW[32:], dtype=np.int64).reshape(ROWS, 2)
    assert np.array_equal(batch.batch["x"].numpy(), want_x)
    assert np.array_equal(batch.batch["y"].numpy(), want_y)
    bf16 = np.frombuffer(RAW[8:12], dtype=np.uint16)
    assert batch.batch["n"]["z"].view(torch.uint16).numpy().tolist() == bf16.tolist()
    assert batch.non_tensor_batch["uid"].tolist() == ["a", "b"] and batch.meta_info == {"step": 3}


def test_tensordicts_rebuild_files_form_reads_tensors_by_key_path(foreign: Foreign) -> None:
    x, z = torch.arange(4).reshape(ROWS, 2), torch.tensor([True, False])
    meta = metadata({"x": None}, n=metadata({"z": None}))
    inner = saved(foreign.reduced(foreign.rebuild_files, {("x",): x, ("n", "z"): z}, meta))
    batch = load_dump_bytes(foreign.proto(inner))
    assert batch.batch["x"].tolist() == [[0, 1], [2, 3]]
    assert batch.batch["n"]["z"].tolist() == [True, False]
    missing = saved(foreign.reduced(foreign.rebuild_files, {("x",): x}, meta))
    with pytest.raises(trajtrack.DumpLoadError, match=r"no tensor for key \('n', 'z'\)"):
        load_dump_bytes(foreign.proto(missing))


def inner_of(foreign: Foreign, leaves: dict[str, Any], **meta: Any) -> bytes:
    return saved(foreign.consolidated({**metadata(leaves), **meta}, STORAGE))


HOSTILE_LEAVES: dict[str, tuple[dict[str, Any], str]] = {
    "offsets past the storage": (
        {"x": ("torch.float32", [ROWS, 4], 32, 96, False)},
        "past its 64-byte storage",
    ),
    "inflated shape": (
        {"x": ("torch.float32", [10**6, 10**6], 0, 64, True)},
        "do not fit",
    ),
    "size larger than the slice": ({"x": ("torch.int64", [ROWS, 4], 0, 32, False)}, "do not fit"),
    "negative offset": ({"x": ("torch.uint8", [ROWS], -8, 2, False)}, "bad offsets"),
    "float offset": ({"x": ("torch.uint8", [ROWS], 0.0, 2, False)}, "bad offsets"),
    "unknown dtype": ({"x": ("torch.evil", [ROWS], 0, 2, False)}, "unknown dtype"),
    "negative size": ({"x": ("torch.uint8", [-2], 0, 2, True)}, "shape"),
    "nested jagged tensor": ({"<NJT>x": ("torch.uint8", [ROWS], 0, 2, False)}, "jagged"),
    "rows outside the batch size": ({"x": ("torch.uint8", [3], 0, 3, False)}, "batch size"),
    "leaf of the wrong shape": ({"x": ("torch.uint8", [ROWS])}, "dtype, shape, start"),
}


@pytest.mark.parametrize("case", list(HOSTILE_LEAVES))
def test_hostile_tensordict_metadata_is_refused(
    foreign: Foreign, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    leaves, message = HOSTILE_LEAVES[case]
    run = dump(tmp_path, "r", foreign.proto(inner_of(foreign, leaves)))
    code, out, err = run_cli(capsys, "show", run, "batch")
    assert code == 2 and out == ""
    assert "refusing a TensorDict pickle" in err and message in err


@pytest.mark.parametrize(
    ("meta", "message"),
    [
        ({"cls": "LazyStackedTensorDict"}, "only TensorDict"),
        ({"non_tensors": {"text": ("hello", [ROWS], None)}}, "non-tensor entries"),
        ({"sub": "not a dict"}, "metadata is not a dict"),
    ],
)
def test_unsupported_tensordict_forms_are_refused_by_name(
    foreign: Foreign, meta: dict[str, Any], message: str
) -> None:
    with pytest.raises(trajtrack.DumpLoadError, match=message):
        load_dump_bytes(foreign.proto(inner_of(foreign, {}, **meta)))


def test_storage_that_is_not_bytes_is_refused(foreign: Foreign) -> None:
    inner = saved(foreign.consolidated(metadata({}), torch.zeros(4, dtype=torch.float32)))
    with pytest.raises(trajtrack.DumpLoadError, match="1-D uint8"):
        load_dump_bytes(foreign.proto(inner))


def test_a_forbidden_global_in_the_inner_archive_is_refused_and_not_run(
    foreign: Foreign, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    run = dump(tmp_path, "r", foreign.proto(saved(WritesMarker(str(marker)))))
    code, _, err = run_cli(capsys, "show", run, "batch")
    assert code == 2 and "mkdir" in err and "refusing to load" in err
    with pytest.raises(trajtrack.TrajtrackError, match="mkdir"):
        load_dump_bytes(foreign.proto(saved(WritesMarker(str(marker)))))
    # ... also when it hides in the TensorDict's metadata
    hidden = saved(foreign.consolidated(metadata({}, size=WritesMarker(str(marker))), STORAGE))
    code, _, err = run_cli(capsys, "show", dump(tmp_path, "r2", foreign.proto(hidden)), "batch")
    assert code == 2 and "mkdir" in err
    assert not marker.exists()


def truncated_record(archive: bytes) -> bytes:
    """The archive with its storage record cut to half its size (the zip rewritten)."""
    source = zipfile.ZipFile(io.BytesIO(archive))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as target:
        for info in source.infolist():
            data = source.read(info)
            target.writestr(
                info.filename, data[: len(data) // 2] if "/data/0" in info.filename else data
            )
    return out.getvalue()


@pytest.mark.parametrize(
    "damage",
    [lambda a: a[: len(a) // 2], truncated_record],
    ids=["archive cut short", "storage record cut short"],
)
def test_a_truncated_inner_archive_is_refused(
    foreign: Foreign, damage: Callable[[bytes], bytes]
) -> None:
    inner = damage(inner_of(foreign, GOOD_LEAVES))
    with pytest.raises(trajtrack.DumpLoadError):
        load_dump_bytes(foreign.proto(inner))


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ((b"x", {}), "not a 3-tuple"),
        ({"batch": b"x"}, "not a 3-tuple"),
        ((None, [1, 2], {}), "non_tensor_batch or meta_info not a dict"),
        ((12, {}, {}), "neither a torch.save archive nor verl's numpy serialization form"),
        ((((2,), None, {"x": ("strided", [])}), {}, {}), "nested tensors in verl's numpy"),
        ((((2,), None, {"x": ("float32", (2, 2), np.zeros(3, np.uint8))}), {}, {}), "not 16 bytes"),
        ((((2,), None, {"x": ("evil", (2,), np.zeros(2, np.uint8))}), {}, {}), "bad dtype"),
    ],
    ids=["2-tuple", "dict", "list", "int batch", "numpy nested", "numpy short", "numpy dtype"],
)
def test_dataproto_state_of_the_wrong_shape_is_refused(
    foreign: Foreign, state: Any, message: str
) -> None:
    with pytest.raises(trajtrack.DumpLoadError, match=message):
        load_dump_bytes(saved(foreign.DataProto(state)))


def test_verls_numpy_serialization_form_is_decoded(foreign: Foreign) -> None:
    values = np.arange(6, dtype=np.float32).reshape(ROWS, 3)
    encoded = {"x": ("float32", torch.Size([ROWS, 3]), values.reshape(-1).view(np.uint8))}
    batch = load_dump_bytes(saved(foreign.DataProto((((ROWS,), None, encoded), {}, {}))))
    assert np.array_equal(batch.batch["x"].numpy(), values)


FLAGS_0_OBJECT_ARRAY = """
import io, sys
import numpy as np, torch

class Flags0ObjectDtype:
    def __reduce__(self):
        return (np.dtype, ("O8", False, True), (3, "|", None, None, None, -1, -1, 0))

class ObjectArrayFromBytes:
    def __reduce__(self):
        state = (1, (4,), Flags0ObjectDtype(), False, sys.argv[2].encode() * 32)
        return (np.empty(0).__reduce__()[0], (np.ndarray, (0,), b"b"), state)

torch.save({"rows": ObjectArrayFromBytes()}, sys.argv[1])
"""


def test_a_flags_0_object_array_is_refused_never_dereferenced(tmp_path: Path) -> None:
    """#32 item 1: numpy would read the file's bytes as object pointers (SIGSEGV)."""
    runs = [tmp_path / "a", tmp_path / "b"]
    for run, fill in zip(runs, "AB", strict=True):
        run.mkdir()
        subprocess.run(
            [sys.executable, "-c", FLAGS_0_OBJECT_ARRAY, str(run / "x.pth"), fill],
            check=True,
            timeout=120,
        )
    for argv in (["show", str(runs[0]), "x"], ["diff", *map(str, runs)]):
        done = subprocess.run(
            [sys.executable, "-m", "trajtrack", *argv],
            capture_output=True,
            text=True,
            timeout=240,
            check=False,
        )
        assert done.returncode == 2, (argv, done.returncode, done.stdout, done.stderr)
        assert "an object array's items are not a list" in done.stdout + done.stderr
