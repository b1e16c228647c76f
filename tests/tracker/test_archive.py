"""The archive writer: torch's zip format for tensor data, checked against torch.save itself."""

from __future__ import annotations

import dataclasses
import io
import struct
import threading
import zipfile
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from _support.archive import (
    BASE,
    DTYPES,
    OBJECTS,
    archive_bytes,
    assert_loads_like_torch_save,
    assert_same,
    assert_same_as_torch_save,
    load,
    tensor_of,
    torch_bytes,
)
from trajtrack.tracker import _archive, _torchzip
from trajtrack.tracker._archive import NotArchivable, archive_plan, write_archive
from trajtrack.tracker._serialize import serialize_plain, torch_save


@pytest.mark.parametrize("name", list(OBJECTS))
def test_objects_load_exactly_like_torch_save(name: str) -> None:
    assert_loads_like_torch_save(OBJECTS[name])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(dtype: torch.dtype) -> None:
    tensor = tensor_of(dtype, 12)
    obj = {"t": tensor, "view": tensor.view(3, 4)[1:, ::2], "scalar": tensor[5]}
    assert_loads_like_torch_save(obj)


def test_the_dtype_tables_are_torchs() -> None:
    # Private torch facts the writer mirrors (see _archive._V3_DTYPES): pinned here.
    mapping = torch.storage._dtype_to_storage_type_map()
    quantized = {torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4}
    plain = {dtype: name for dtype, name in mapping.items() if dtype not in quantized}
    assert {dtype: cls.__name__ for dtype, cls in _archive._V2_STORAGES.items()} == plain
    assert torch.storage._new_dtypes() == _archive._V3_DTYPES
    assert torch.serialization.DEFAULT_PROTOCOL == _archive._PROTOCOL
    alignment = getattr(torch.serialization, "_get_storage_alignment", lambda: 64)()  # 2.4: none
    assert alignment == _torchzip._ALIGNMENT


# --------------------------------------------------------------------------- zip and CRC


def test_the_layout_is_torchs() -> None:
    ours, _, _ = archive_bytes(OBJECTS["sliced_views"])
    infos = zipfile.ZipFile(io.BytesIO(ours)).infolist()
    names = [info.filename for info in infos]
    assert names == [
        "archive/data.pkl",
        "archive/.format_version",
        "archive/.storage_alignment",
        "archive/byteorder",
        "archive/data/0",
        "archive/version",
        "archive/.data/serialization_id",
    ]
    for info in infos:
        name_len, extra_len = struct.unpack_from("<HH", ours, info.header_offset + 26)
        assert (info.header_offset + 30 + name_len + extra_len) % 64 == 0
        assert info.flag_bits == 0x808  # data descriptor, UTF-8


def test_serialization_id_is_deterministic_and_content_derived() -> None:
    obj = OBJECTS["sliced_views"]
    plan = archive_plan(obj)
    first, second = io.BytesIO(), io.BytesIO()
    assert plan.write_to(first) == plan.write_to(second)
    assert first.getvalue() == second.getvalue() == archive_bytes(obj)[0]
    archive = zipfile.ZipFile(first)
    identifier = archive.read("archive/.data/serialization_id")
    assert len(identifier) == 40 and identifier.isdigit()
    other = zipfile.ZipFile(io.BytesIO(archive_bytes({"x": torch.ones(3)})[0]))
    assert other.read("archive/.data/serialization_id") != identifier


def test_given_serialization_id() -> None:
    buffer = io.BytesIO()
    size, checksum = write_archive({"x": torch.ones(2)}, buffer, serialization_id="42" * 20)
    archive = zipfile.ZipFile(buffer)
    assert archive.read("archive/.data/serialization_id") == b"42" * 20
    assert archive.testzip() is None
    assert (size, checksum) == (
        len(buffer.getvalue()),
        f"crc32:{zlib.crc32(buffer.getvalue()):08x}",
    )


def test_an_empty_serialization_id() -> None:
    buffer = io.BytesIO()
    size, _ = write_archive({"x": torch.ones(2)}, buffer, serialization_id="")
    archive = zipfile.ZipFile(buffer)
    assert archive.read("archive/.data/serialization_id") == b""
    assert archive.testzip() is None and size == len(buffer.getvalue())


def test_mmap_load_and_file_output(tmp_path: Path) -> None:
    obj = {"big": torch.randn(3, 5000), "small": torch.arange(7), "view": torch.ones(9)[2:]}
    path = tmp_path / "dump.pt"
    with open(path, "wb") as handle:
        size, checksum = write_archive(obj, handle)
    data = path.read_bytes()
    assert (size, checksum) == (len(data), f"crc32:{zlib.crc32(data):08x}")
    assert_same(load(path, mmap=True), load(torch_bytes(obj)), {}, {})


class _Trickle:
    """A non-seekable writer with only write(), taking at most a few bytes per call."""

    def __init__(self, most: int) -> None:
        self.chunks: list[bytes] = []
        self.most = most

    def write(self, data: bytes | memoryview) -> int:
        taken = bytes(memoryview(data)[: self.most])
        self.chunks.append(taken)
        return len(taken)


class _Silent:
    """A writer that returns None (does not count)."""

    def __init__(self) -> None:
        self.buffer = io.BytesIO()

    def write(self, data: bytes | memoryview) -> None:
        self.buffer.write(data)


def test_partial_and_uncounted_writes() -> None:
    obj = OBJECTS["bigger"]
    expected, size, checksum = archive_bytes(obj)
    trickle = _Trickle(1000)
    assert write_archive(obj, trickle) == (size, checksum)
    assert b"".join(trickle.chunks) == expected
    silent = _Silent()
    assert write_archive(obj, silent) == (size, checksum)
    assert silent.buffer.getvalue() == expected


def test_a_writer_that_stops_taking_bytes() -> None:
    class Full:
        def write(self, data: bytes | memoryview) -> int:
            return 0

    with pytest.raises(OSError, match="no more bytes"):
        write_archive({"x": torch.ones(3)}, Full())


def test_big_storages_use_the_crc_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    threads: list[str] = []
    real = _torchzip._Crc32Worker

    class Recording(real):  # type: ignore[misc, valid-type]
        def __init__(self, views: list[memoryview | bytes]) -> None:
            threads.append(f"{len(views)}")
            super().__init__(views)

    monkeypatch.setattr(_torchzip, "_Crc32Worker", Recording)
    big = _torchzip.PARALLEL_CRC_MIN // 4  # float32 elements
    obj = {"a": torch.randn(big + 10), "b": torch.ones(5), "c": torch.randn(big + 20), "d": 1}
    small = {"e": torch.randn(big - 10)}  # just under the threshold: no thread
    assert_loads_like_torch_save(small)
    assert threads == []
    assert_loads_like_torch_save(obj)
    assert threads == ["2"]  # one thread for both big storages, none for the small one
    monkeypatch.setattr(_torchzip, "PARALLEL_CRC_MIN", 100)
    monkeypatch.setattr(_torchzip, "_JOIN_MAX", 10)
    assert_loads_like_torch_save({"x": torch.arange(30.0), "y": torch.ones(2), "z": torch.ones(40)})


def test_a_failed_write_stops_the_crc_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    started, release = threading.Event(), threading.Event()
    computed: list[int] = []

    def slow_crc32(view: memoryview | bytes) -> int:
        started.set()
        release.wait(timeout=30)
        computed.append(len(view))
        return zlib.crc32(view)

    class Broken:
        def write(self, data: bytes | memoryview) -> int:
            started.wait(timeout=30)  # the thread is inside its first CRC
            raise OSError("disk full")

    monkeypatch.setattr(_torchzip, "crc32_big", slow_crc32)
    monkeypatch.setattr(_torchzip, "PARALLEL_CRC_MIN", 1 << 20)  # four 1.2 MB storages
    obj = {f"t{i}": torch.randn(300_000) for i in range(4)}
    with pytest.raises(OSError, match="disk full"):
        write_archive(obj, Broken())
    release.set()
    for thread in threading.enumerate():
        if thread.name == "trajtrack-crc32":
            thread.join(timeout=30)
    assert len(computed) == 1  # it stopped after the CRC it was computing


def test_a_failing_crc_reaches_the_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_crc32(view: memoryview | bytes) -> int:
        raise MemoryError("no memory")

    monkeypatch.setattr(_torchzip, "crc32_big", broken_crc32)
    with pytest.raises(MemoryError, match="no memory"):
        write_archive({"t": torch.randn(300_000)}, io.BytesIO())


def test_four_gib_is_refused() -> None:
    class Huge:
        def __len__(self) -> int:
            return 4 << 30

    with pytest.raises(NotArchivable, match="4 GiB"):
        _torchzip.ArchivePlan(b"\x80\x02N.", [Huge()], None)  # type: ignore[list-item]


# --------------------------------------------------------------------------- fallback


class _Sub(torch.Tensor):
    pass


def _with_attribute() -> torch.Tensor:
    tensor = torch.ones(2)
    tensor.note = "x"  # type: ignore[attr-defined]
    return tensor


_NOT_PLAIN = "not a plain CPU strided one"
REFUSED: dict[str, tuple[Any, str]] = {  # made in the test (some warn when made); the reason
    "meta": (lambda: torch.ones(2, device="meta"), _NOT_PLAIN),
    "sparse": (lambda: torch.ones(2, 2).to_sparse(), _NOT_PLAIN),
    "sparse_csr": (lambda: torch.eye(3).to_sparse_csr(), _NOT_PLAIN),
    "quantized": (
        lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
        _NOT_PLAIN,
    ),
    "nested": (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), _NOT_PLAIN),
    "parameter": (lambda: torch.nn.Parameter(torch.ones(2)), "a Parameter"),
    "subclass": (lambda: torch.ones(2).as_subclass(_Sub), "a _Sub"),
    "python_attribute": (_with_attribute, _NOT_PLAIN),
    "typed_storage": (lambda: torch.ones(2).storage(), "a TypedStorage"),
    "untyped_storage": (lambda: torch.ones(2).untyped_storage(), "a UntypedStorage"),
    "zero_tensor": (lambda: torch._efficientzerotensor(3), "data pointer"),
    "two_dtypes_one_memory": (lambda: [BASE, BASE.view(torch.int32)], "two dtypes"),
    "module": (lambda: torch.nn.Linear(2, 2), "a Parameter"),
    "lambda": (lambda: {"f": lambda: 0}, "pickle"),
    "lock": (threading.Lock, "TypeError"),
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # beta sparse CSR, prototype nested, ...
@pytest.mark.parametrize("name", list(REFUSED))
def test_what_only_torch_save_writes_is_refused_before_writing(name: str) -> None:
    make, reason = REFUSED[name]
    bad = make()
    out = _Trickle(1 << 30)
    with pytest.raises(NotArchivable, match=reason):
        write_archive({"ok": torch.ones(2), "bad": [bad]}, out)
    assert out.chunks == []
    assert serialize_plain({"bad": bad}, out) is None
    assert out.chunks == []


def test_the_layout_cache_stays_small() -> None:
    for length in range(_torchzip._LAYOUTS_KEPT + 10):
        archive_plan({"x": torch.ones(length)})
    assert 0 < len(_torchzip._layouts) <= _torchzip._LAYOUTS_KEPT


@dataclasses.dataclass
class _Record:
    values: torch.Tensor
    label: str


def test_other_objects_are_pickled_as_torch_save_pickles_them() -> None:
    # Not plain data, but nothing in it needs torch.save's handling: identical bytes.
    obj = {"record": _Record(torch.ones(3), "x"), "set": {1, 2}, "bytearray": bytearray(b"ab")}
    ours, _, _ = archive_bytes(obj)
    assert_same_as_torch_save(ours, torch_bytes(obj))


def test_serialize_plain() -> None:
    obj = OBJECTS["int_and_floats"]
    buffer = io.BytesIO()
    result = serialize_plain(obj, buffer)
    assert result == (len(buffer.getvalue()), f"crc32:{zlib.crc32(buffer.getvalue()):08x}")
    reference = io.BytesIO()
    torch_save(obj, reference)
    assert_same_as_torch_save(buffer.getvalue(), reference.getvalue())


def _fresh_bytes(obj: Any) -> bytes:
    """The archive as the pickler makes it, with no kept pickle to use."""
    _archive._PICKLES.clear()
    try:
        return archive_bytes(obj)[0]
    finally:
        _archive._PICKLES.clear()


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """Another tensor like *tensor*: its own storage, the same strides, data, requires_grad."""
    copy = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype)
    copy.copy_(tensor.detach())
    return copy.requires_grad_(tensor.requires_grad)


def _flat_layouts() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    dtypes = [d for d in _archive.V2_STORAGES if d not in (torch.complex64, torch.complex128)]
    layouts: list[dict[str, torch.Tensor]] = []
    for case in range(40):
        count = 1 + case % 5
        obj: dict[str, torch.Tensor] = {}
        for i in range(count):
            dtype = dtypes[(case + i) % len(dtypes)]
            shape = [(case * 7 + i * 3) % 9 + 1 for _ in range(1 + (case + i) % 3)]
            tensor = (torch.rand(shape, generator=generator) * 100).to(dtype)
            if case % 4 == 1 and tensor.dim() > 1:
                tensor = tensor.transpose(0, 1)  # whole storage, other strides
            if case % 6 == 2 and dtype.is_floating_point:
                tensor.requires_grad_(True)
            obj[f"k{case}_{i}" if case % 3 else f"obs{i}"] = tensor
        layouts.append(obj)
    layouts.append({"scalar": torch.tensor(3.5), "empty_name_ok": torch.ones(1, dtype=torch.int8)})
    return layouts


@pytest.mark.parametrize("index", range(41))
def test_a_kept_pickle_gives_the_bytes_of_a_fresh_one(index: int) -> None:
    obj = _flat_layouts()[index]
    expected = _fresh_bytes(obj)
    archive_bytes(obj)  # keeps the pickle of this layout
    assert _archive._flat_tensors(obj) is not None
    again = {name: _copy(tensor) for name, tensor in obj.items()}
    kept = archive_bytes(again)[0]  # another dict, other tensors, the same layout
    assert kept == _fresh_bytes(again)
    assert kept == expected  # same data, so the same file
    assert_same_as_torch_save(kept, torch_bytes(again))


def test_layouts_the_pickler_must_see_are_not_kept() -> None:
    base = torch.arange(12, dtype=torch.float32)
    conj = torch.tensor([1 + 2j], dtype=torch.complex64).conj()
    shared = torch.ones(3)
    refused = {
        "a view of part": {"x": base[2:5]},
        "an offset": {"x": base.view(3, 4)[1]},
        "an offset, and as many bytes as the storage": {"x": torch.ones(2)[1:].expand(2)},
        "one storage twice": {"x": shared, "y": shared.view(3)},
        "a conjugate": {"x": conj},
        "a key that is not a str": {1: torch.ones(2)},
        "a value that is not a tensor": {"x": torch.ones(2), "n": 3},
        "a subclass": {"p": torch.nn.Parameter(torch.ones(2))},
        "no tensors": {},
    }
    for why, obj in refused.items():
        assert _archive._flat_tensors(obj) is None, why
    for why, obj in refused.items():
        if why in ("a subclass", "a value that is not a tensor", "no tensors"):
            continue
        assert archive_bytes(obj)[0] == _fresh_bytes(obj), why
        assert_same_as_torch_save(archive_bytes(obj)[0], torch_bytes(obj))


def test_the_kept_pickles_stay_few() -> None:
    _archive._PICKLES.clear()
    for n in range(_archive._PICKLES_KEPT + 10):
        archive_plan({"x": torch.zeros(n + 1)})
    assert 0 < len(_archive._PICKLES) <= _archive._PICKLES_KEPT
    _archive._PICKLES.clear()


def test_layouts_that_differ_in_one_attribute_get_their_own_pickle() -> None:
    square = torch.arange(16, dtype=torch.float32).view(4, 4)
    variants = {
        "base": {"a": square, "b": torch.ones(4)},
        "strides": {"a": square.t(), "b": torch.ones(4)},
        "requires_grad": {"a": square.clone().requires_grad_(True), "b": torch.ones(4)},
        "dtype": {"a": square.double(), "b": torch.ones(4)},
        "order": {"b": torch.ones(4), "a": square},
        "names": {"a": square, "c": torch.ones(4)},
        "shape": {"a": square.reshape(2, 8), "b": torch.ones(4)},
    }
    _archive._PICKLES.clear()
    for why, obj in variants.items():  # each after all the others were kept
        fresh = _fresh_bytes(obj)
        for other in variants.values():
            archive_bytes(other)
        assert archive_bytes(obj)[0] == fresh, why
    _archive._PICKLES.clear()
