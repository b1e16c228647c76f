"""The security review's findings on the safe loader (issue #32 items 2-4), one test each.

Each hostile archive is built here, opcode by opcode, and given to trajtrack's safe loader
and to ``torch.load(weights_only=True)``: trajtrack must make torch's decision (refuse where
torch refuses, return what torch returns where it accepts), except for the one case where
torch itself returns uninitialized memory, which trajtrack refuses.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from reader.test_fast_load import _replace_pickle, _with_external_attributes, saved
from trajtrack import DumpLoadError, UnsafeLoadError
from trajtrack.reader._archive_diff import compare_archives
from trajtrack.reader._compare import Tolerance
from trajtrack.reader._fast_load import DECLINED, fast_load
from trajtrack.reader._safe_load import load_dump_bytes, load_dump_file

P = pickle


def pk(*parts: bytes) -> bytes:
    """A protocol-2 pickle of *parts* (opcodes), as data.pkl."""
    return P.PROTO + b"\x02" + b"".join(parts) + P.STOP


def glob(module: str, name: str) -> bytes:
    return P.GLOBAL + f"{module}\n{name}\n".encode()


def text(value: str) -> bytes:
    raw = value.encode()
    return P.BINUNICODE + struct.pack("<I", len(raw)) + raw


def num(value: int) -> bytes:
    return P.BININT + struct.pack("<i", value)


def ints(values: tuple[int, ...]) -> bytes:
    return P.MARK + b"".join(num(v) for v in values) + P.TUPLE


def pid(numel: int, key: str = "0", storage: str = "FloatStorage") -> bytes:
    """A storage's persistent id as torch.save writes it (then BINPERSID)."""
    parts = text("storage") + glob("torch", storage) + text(key) + text("cpu") + num(numel)
    return P.MARK + parts + P.TUPLE + P.BINPERSID


def tensor(
    storage: bytes, size: tuple[int, ...], stride: tuple[int, ...], offset: int = 0
) -> bytes:
    """``_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())``."""
    hooks = glob("collections", "OrderedDict") + P.EMPTY_TUPLE + P.REDUCE
    args = storage + num(offset) + ints(size) + ints(stride) + P.NEWFALSE + hooks
    return glob("torch._utils", "_rebuild_tensor_v2") + P.MARK + args + P.TUPLE + P.REDUCE


FLOATS = saved(torch.arange(4.0))  # one storage record, data/0: four float32


def archive(pickled: bytes, base: bytes = FLOATS) -> bytes:
    return _replace_pickle(base, pickled)


def torch_outcome(data: bytes) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # any refusal
        return Refused(exc)


def trajtrack_outcome(data: bytes) -> Any:
    try:
        return load_dump_bytes(data)
    except (DumpLoadError, UnsafeLoadError) as exc:
        return Refused(exc)


class Refused:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __repr__(self) -> str:
        return f"Refused({self.exc!r:.200})"


def assert_torchs_decision(data: bytes) -> Any:
    """trajtrack refuses where torch refuses; else returns an object of torch's type."""
    want, got = torch_outcome(data), trajtrack_outcome(data)
    assert type(got) is type(want), (got, want)
    return got


def test_a_build_on_a_storage_class_does_not_change_later_loads() -> None:
    # BUILD with slot state on torch.FloatStorage: it used to set the dtype of the fast
    # loader's shared table entry, and honest float32 dumps then loaded as int32.
    state = P.NONE + P.EMPTY_DICT + text("dtype") + glob("torch", "int32") + P.SETITEM
    hostile = archive(pk(glob("torch", "FloatStorage") + state + P.TUPLE2 + P.BUILD))
    assert isinstance(assert_torchs_decision(hostile), Refused)
    honest = saved(torch.tensor([1.0, 2.0, 3.0]))
    loaded = load_dump_bytes(honest)
    assert loaded.dtype == torch.float32
    assert torch.equal(loaded, torch.load(io.BytesIO(honest), weights_only=True))


def test_a_build_on_a_storage_record_gives_torchs_values_in_load_and_diff() -> None:
    # BUILD with slot state "start" on the storage: it moved the fast loader's record, and
    # the tensor's data came from the zip header. torch sets an attribute nobody reads.
    moved = P.NONE + P.EMPTY_DICT + text("start") + num(0) + P.SETITEM + P.TUPLE2 + P.BUILD
    pickled = pk(tensor(pid(4) + moved, (4,), (1,)))
    hostile = archive(pickled)
    got = assert_torchs_decision(hostile)
    assert torch.equal(got, torch.arange(4.0))
    other = archive(pickled, saved(torch.arange(4.0)))
    assert compare_archives(hostile, other, Tolerance(), 10) is None  # loaded, by torch


@pytest.mark.parametrize(
    "target",
    [P.EMPTY_LIST, tensor(pid(4), (4,), (1,))],
    ids=["list", "tensor"],
)
def test_a_build_with_state_none_is_refused(target: bytes) -> None:
    hostile = archive(pk(target + P.NONE + P.BUILD))
    assert isinstance(assert_torchs_decision(hostile), Refused)


def test_a_build_on_codecs_encode_is_refused_and_changes_nothing() -> None:
    state = P.EMPTY_DICT + text("marker") + num(1) + P.SETITEM
    hostile = archive(pk(glob("_codecs", "encode") + state + P.BUILD))
    assert isinstance(assert_torchs_decision(hostile), Refused)
    assert load_dump_bytes(saved({"b": b"raw"})) == {"b": b"raw"}


def test_an_item_assignment_into_a_list_is_refused() -> None:
    hostile = archive(pk(P.EMPTY_LIST + P.MARK + num(1) + P.APPENDS + num(0) + num(7) + P.SETITEM))
    assert isinstance(assert_torchs_decision(hostile), Refused)


def test_a_bare_persistent_id_loads_as_torch_loads_it() -> None:
    got = assert_torchs_decision(archive(pk(pid(4))))
    assert type(got) is torch.storage.TypedStorage  # torch's own object, not a record


@pytest.mark.parametrize(
    ("module", "name"),
    [("torch", "FloatStorage"), ("_codecs", "encode"), ("torch._utils", "_rebuild_tensor_v2")],
)
def test_a_bare_global_loads_as_torch_loads_it(module: str, name: str) -> None:
    got = assert_torchs_decision(archive(pk(glob(module, name))))
    want = torch_outcome(archive(pk(glob(module, name))))
    assert got is want or type(got) is type(want)


def test_an_unreachable_tensor_is_still_validated() -> None:
    # The first value of "t" is a tensor past its storage's end, replaced before the end.
    bad = tensor(pid(4), (100,), (1,))
    hostile = archive(
        pk(P.EMPTY_DICT + text("t") + bad + P.SETITEM + text("t") + num(1) + P.SETITEM)
    )
    assert isinstance(assert_torchs_decision(hostile), Refused)


def test_an_empty_storage_record_with_a_size_gives_no_freed_memory() -> None:
    # Written by a real pickler, as torch.save writes (so only the geometry is wrong): a
    # tensor of 1,024 floats over the empty record data/0.
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return ("storage", torch.FloatStorage, "0", "cpu", 0) if obj == "S" else None

    class Call:
        def __reduce__(self) -> tuple[Any, ...]:
            rebuild = torch.ones(1).__reduce_ex__(2)[0]
            return (rebuild, ("S", 0, (1024,), (1,), False, OrderedDict()))

    buffer = io.BytesIO()
    Pickler(buffer, protocol=2).dump(Call())
    hostile = archive(buffer.getvalue(), saved(torch.zeros(0)))  # data/0 holds no bytes
    assert fast_load(hostile) is DECLINED
    assert isinstance(assert_torchs_decision(hostile), Refused)


def test_a_storage_record_marked_as_a_directory_is_refused(tmp_path: Path) -> None:
    # torch itself returns uninitialized memory here: trajtrack never hands it to torch.
    data = _with_external_attributes(saved(torch.arange(4.0)), "archive/data/0", 0x10)
    with pytest.raises(DumpLoadError, match="marked as a directory"):
        load_dump_bytes(data)
    path = tmp_path / "dump.pt"
    path.write_bytes(data)
    with pytest.raises(DumpLoadError, match="marked as a directory"):
        load_dump_file(path)


def test_a_compressed_record_is_refused_not_inflated(tmp_path: Path) -> None:
    # #32 item 6: torch inflates a compressed record in the loading process, whatever it
    # inflates to; torch.save never compresses, so trajtrack refuses such an archive.
    honest = saved(torch.zeros(1 << 18))  # 1 MiB of zeros: deflates to about a kilobyte
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(honest)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info), compress_type=zipfile.ZIP_DEFLATED)
    deflated = out.getvalue()
    assert len(deflated) < len(honest) // 100
    assert torch.equal(torch.load(io.BytesIO(deflated), weights_only=True), torch.zeros(1 << 18))
    with pytest.raises(DumpLoadError, match="is compressed"):
        load_dump_bytes(deflated)
    path = tmp_path / "dump.pt"
    path.write_bytes(deflated)
    with pytest.raises(DumpLoadError, match="is compressed"):
        load_dump_file(path)
