"""The archive writer: torch's zip format for tensor data, checked against torch.save itself."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import random
import struct
import subprocess
import sys
import threading
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trajtrack.rollout import SAFE_GLOBALS
from trajtrack.tracker import _archive, _torchzip
from trajtrack.tracker._archive import NotArchivable, archive_plan, write_archive
from trajtrack.tracker._crc32 import crc32_combine, crc32_shift
from trajtrack.tracker._serialize import serialize_plain, torch_save

# --------------------------------------------------------------------------- helpers


def _torch_bytes(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _archive_bytes(obj: Any) -> tuple[bytes, int, str]:
    buffer = io.BytesIO()
    size, checksum = write_archive(obj, buffer)
    return buffer.getvalue(), size, checksum


def _mask_serialization_id(data: bytes) -> bytes:
    """*data* with the serialization id record's content and CRC-32s zeroed.

    torch.save draws the id at random; everything else must be byte-identical.
    """
    masked = bytearray(data)
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo("archive/.data/serialization_id")
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    masked[start : start + info.file_size] = bytes(info.file_size)
    masked[start + info.file_size + 4 : start + info.file_size + 8] = bytes(4)  # descriptor
    central = data.rfind(b"PK\x01\x02")  # the id's entry is the last one
    masked[central + 16 : central + 20] = bytes(4)
    return bytes(masked)


def _load(data: bytes | Path, **kwargs: Any) -> Any:
    source = data if isinstance(data, Path) else io.BytesIO(data)
    with torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        return torch.load(source, weights_only=True, **kwargs)


def _storage_bytes(tensor: torch.Tensor) -> bytes:
    storage = tensor.untyped_storage()
    return bytes(storage.tolist()) if storage.nbytes() else b""


def _assert_same(left: Any, right: Any, storages: dict[int, int], other: dict[int, int]) -> None:
    """Deep equality including tensor layout and the aliasing pattern of storages."""
    assert type(left) is type(right)
    if isinstance(left, torch.Tensor):
        assert (left.dtype, left.shape, left.stride()) == (right.dtype, right.shape, right.stride())
        assert left.storage_offset() == right.storage_offset()
        assert (left.requires_grad, left.is_conj(), left.is_neg()) == (
            right.requires_grad,
            right.is_conj(),
            right.is_neg(),
        )
        assert _storage_bytes(left) == _storage_bytes(right)
        left_key = storages.setdefault(left.untyped_storage().data_ptr(), len(storages))
        right_key = other.setdefault(right.untyped_storage().data_ptr(), len(other))
        assert left_key == right_key  # the same storages shared the same way
    elif isinstance(left, dict):
        assert list(left) == list(right)
        for key in left:
            _assert_same(left[key], right[key], storages, other)
    elif isinstance(left, list | tuple):
        assert len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            _assert_same(a, b, storages, other)
    elif isinstance(left, np.ndarray):
        assert left.dtype == right.dtype and left.shape == right.shape
        assert left.strides == right.strides and left.tobytes() == right.tobytes()
    elif isinstance(left, float) and left != left:
        assert right != right
    else:
        assert left == right


def _assert_loads_like_torch_save(obj: Any) -> None:
    ours, size, checksum = _archive_bytes(obj)
    reference = _torch_bytes(obj)
    assert _mask_serialization_id(ours) == _mask_serialization_id(reference)
    assert size == len(ours)
    assert checksum == f"crc32:{zlib.crc32(ours):08x}"
    assert zipfile.ZipFile(io.BytesIO(ours)).testzip() is None
    loaded, expected = _load(ours), _load(reference)
    _assert_same(loaded, expected, {}, {})
    ids = [id(x) for x in _flatten(loaded)]
    expected_ids = [id(x) for x in _flatten(expected)]
    assert [ids.index(i) for i in ids] == [expected_ids.index(i) for i in expected_ids]


def _flatten(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [x for value in obj.values() for x in _flatten(value)]
    if isinstance(obj, list | tuple):
        return [x for value in obj for x in _flatten(value)]
    return [obj] if isinstance(obj, torch.Tensor) else []


# --------------------------------------------------------------------------- objects


def _dtypes() -> list[torch.dtype]:
    return [*_archive._V2_STORAGES, *sorted(_archive._V3_DTYPES, key=str)]


def _tensor_of(dtype: torch.dtype, numel: int = 6) -> torch.Tensor:
    raw = torch.randint(
        0, 256, (numel * dtype.itemsize,), generator=torch.Generator().manual_seed(0)
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "ComplexHalf support is experimental"
        return raw.to(torch.uint8).view(dtype)


def _creatable(dtype: torch.dtype) -> bool:
    try:
        _tensor_of(dtype)
    except (RuntimeError, TypeError):
        return False
    return True


DTYPES = [dtype for dtype in _dtypes() if _creatable(dtype)]

_base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
_complex = torch.randn(5, dtype=torch.complex64)

OBJECTS: dict[str, Any] = {
    "int_and_floats": {"step": 1, "x": torch.randn(1000)},
    "zero_dim": torch.tensor(3.5),
    "zero_dim_int": {"a": torch.tensor(7), "b": torch.tensor(True)},
    "empty": {"e": torch.zeros(0), "e2": torch.zeros(3, 0, 2, dtype=torch.int64)},
    "transposed": _base.t(),
    "sliced_views": {"whole": _base, "row": _base[1], "col": _base[:, 2], "tail": _base[2:, 3:]},
    "expanded": torch.arange(3).expand(4, 3),
    "same_tensor_twice": [_base, _base, {"again": _base}],
    "two_storages_equal_bytes": [torch.ones(3), torch.ones(3)],
    "from_numpy": torch.from_numpy(np.arange(10, dtype=np.int32)),
    "nested": {"a": [1, (2.5, None, {"b": torch.ones(2, 2)})], "c": (b"raw", "text", True)},
    "scalars": [0, -1, 2**70, 1.5, float("inf"), float("nan"), complex(1, 2), None, False],
    "non_str_keys": {1: torch.ones(1), 2.5: "x", (1, "a"): torch.zeros(2), None: 0},
    "numpy": {
        "f": np.linspace(0, 1, 7),
        "i": np.arange(12, dtype=np.int16).reshape(3, 4),
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "b": np.array([True, False]),
        "scalar": np.float32(2.5),
        "int_scalar": np.int64(-3),
    },
    "dtypes_as_values": [torch.float32, torch.bfloat16, torch.int8],
    "requires_grad": torch.ones(3, requires_grad=True),
    "non_leaf": torch.ones(3, requires_grad=True) * 2,
    "conj": _complex.conj(),
    "neg": torch.randn(4)._neg_view(),
    "conj_neg": _complex.conj()._neg_view(),
    "strings_like_ours": {"storage": "cpu", "cpu": ["storage", "0"], "0": torch.ones(1)},
    "bigger": {"obs": torch.randn(70_000), "actions": torch.randint(0, 9, (5000,))},
    "empty_containers": {"d": {}, "l": [], "t": ()},
}


@pytest.mark.parametrize("name", list(OBJECTS))
def test_objects_load_exactly_like_torch_save(name: str) -> None:
    _assert_loads_like_torch_save(OBJECTS[name])


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype(dtype: torch.dtype) -> None:
    tensor = _tensor_of(dtype, 12)
    obj = {"t": tensor, "view": tensor.view(3, 4)[1:, ::2], "scalar": tensor[5]}
    _assert_loads_like_torch_save(obj)


def test_the_dtype_tables_are_torchs() -> None:
    # Private torch facts the writer mirrors (see _archive._V3_DTYPES): pinned here.
    mapping = torch.storage._dtype_to_storage_type_map()
    quantized = {torch.qint8, torch.qint32, torch.quint8, torch.quint4x2, torch.quint2x4}
    plain = {dtype: name for dtype, name in mapping.items() if dtype not in quantized}
    assert {dtype: cls.__name__ for dtype, cls in _archive._V2_STORAGES.items()} == plain
    assert torch.storage._new_dtypes() == _archive._V3_DTYPES
    assert torch.serialization.DEFAULT_PROTOCOL == _archive._PROTOCOL
    assert torch.serialization._get_storage_alignment() == _torchzip._ALIGNMENT


# --------------------------------------------------------------------------- zip and CRC


@pytest.mark.parametrize("length", [0, 1, 2, 3, 511, 4000, 4096, 65537, 2**20 + 3])
def test_crc32_combine_matches_zlib(length: int) -> None:
    rng = random.Random(length)
    for prefix_length in (0, 1, 7, 1000):
        prefix = rng.randbytes(prefix_length)
        data = rng.randbytes(length)
        combined = crc32_combine(zlib.crc32(prefix), zlib.crc32(data), length)
        assert combined == zlib.crc32(prefix + data)


def test_crc32_combine_of_many_pieces() -> None:
    rng = random.Random(1)
    pieces = [rng.randbytes(rng.randrange(0, 3000)) for _ in range(50)]
    crc = 0
    for piece in pieces:
        crc = crc32_combine(crc, zlib.crc32(piece), len(piece))
    assert crc == zlib.crc32(b"".join(pieces))


def test_crc32_shift_bounds() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        crc32_shift(1, -1)
    with pytest.raises(ValueError, match="2\\*\\*64"):
        crc32_shift(1, 2**64)
    assert crc32_shift(0x12345678, 0) == 0x12345678


def test_the_layout_is_torchs() -> None:
    ours, _, _ = _archive_bytes(OBJECTS["sliced_views"])
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
    assert first.getvalue() == second.getvalue() == _archive_bytes(obj)[0]
    archive = zipfile.ZipFile(first)
    identifier = archive.read("archive/.data/serialization_id")
    assert len(identifier) == 40 and identifier.isdigit()
    other = zipfile.ZipFile(io.BytesIO(_archive_bytes({"x": torch.ones(3)})[0]))
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


def test_mmap_load_and_file_output(tmp_path: Path) -> None:
    obj = {"big": torch.randn(3, 5000), "small": torch.arange(7), "np": np.arange(3)}
    path = tmp_path / "dump.pt"
    with open(path, "wb") as handle:
        size, checksum = write_archive(obj, handle)
    data = path.read_bytes()
    assert (size, checksum) == (len(data), f"crc32:{zlib.crc32(data):08x}")
    _assert_same(_load(path, mmap=True), _load(_torch_bytes(obj)), {}, {})


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
    expected, size, checksum = _archive_bytes(obj)
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
    obj = {"a": torch.randn(300_000), "b": torch.ones(5), "c": torch.randn(400_000), "d": 1}
    _assert_loads_like_torch_save(obj)
    assert threads == ["2"]  # one thread for both big storages, none for the small one
    monkeypatch.setattr(_torchzip, "PARALLEL_CRC_MIN", 100)
    monkeypatch.setattr(_torchzip, "_JOIN_MAX", 10)
    _assert_loads_like_torch_save(
        {"x": torch.arange(30.0), "y": torch.ones(2), "z": torch.ones(40)}
    )


def test_a_failed_write_stops_the_crc_thread() -> None:
    class Broken:
        def write(self, data: bytes | memoryview) -> int:
            raise OSError("disk full")

    before = threading.active_count()
    with pytest.raises(OSError, match="disk full"):
        write_archive({"a": torch.randn(300_000), "b": torch.randn(300_000)}, Broken())
    for thread in threading.enumerate():
        if thread.name == "trajtrack-crc32":
            thread.join(timeout=10)
    assert threading.active_count() == before


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


REFUSED: dict[str, Any] = {  # made in the test: some warn when made
    "meta": lambda: torch.ones(2, device="meta"),
    "sparse": lambda: torch.ones(2, 2).to_sparse(),
    "sparse_csr": lambda: torch.eye(3).to_sparse_csr(),
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "parameter": lambda: torch.nn.Parameter(torch.ones(2)),
    "subclass": lambda: torch.ones(2).as_subclass(_Sub),
    "python_attribute": _with_attribute,
    "typed_storage": lambda: torch.ones(2).storage(),
    "untyped_storage": lambda: torch.ones(2).untyped_storage(),
    "zero_tensor": lambda: torch._efficientzerotensor(3),
    "two_dtypes_one_memory": lambda: [_base, _base.view(torch.int32)],
    "module": lambda: torch.nn.Linear(2, 2),
    "lambda": lambda: {"f": lambda: 0},
    "lock": threading.Lock,
}


@pytest.mark.filterwarnings("ignore::UserWarning")  # beta sparse CSR, prototype nested, ...
@pytest.mark.parametrize("name", list(REFUSED))
def test_what_only_torch_save_writes_is_refused_before_writing(name: str) -> None:
    bad = REFUSED[name]()
    out = _Trickle(1 << 30)
    with pytest.raises(NotArchivable):
        write_archive({"ok": torch.ones(2), "bad": [bad]}, out)
    assert out.chunks == []
    assert serialize_plain({"bad": bad}, out) is None
    assert out.chunks == []


@dataclasses.dataclass
class _Record:
    values: torch.Tensor
    label: str


def test_other_objects_are_pickled_as_torch_save_pickles_them() -> None:
    # Not plain data, but nothing in it needs torch.save's handling: identical bytes.
    obj = {"record": _Record(torch.ones(3), "x"), "set": {1, 2}, "bytearray": bytearray(b"ab")}
    ours, _, _ = _archive_bytes(obj)
    assert _mask_serialization_id(ours) == _mask_serialization_id(_torch_bytes(obj))


def test_serialize_plain() -> None:
    obj = OBJECTS["int_and_floats"]
    buffer = io.BytesIO()
    result = serialize_plain(obj, buffer)
    assert result == (len(buffer.getvalue()), f"crc32:{zlib.crc32(buffer.getvalue()):08x}")
    reference = io.BytesIO()
    torch_save(obj, reference)
    assert _mask_serialization_id(buffer.getvalue()) == _mask_serialization_id(reference.getvalue())


# --------------------------------------------------------------------------- nothing global


def test_a_users_torch_save_in_other_threads_is_unchanged() -> None:
    obj = {"x": torch.randn(300_000), "y": torch.arange(10)}  # big enough for the CRC thread
    quiet = _mask_serialization_id(_torch_bytes(obj))
    config = torch.utils.serialization.config.save
    assert config.compute_crc32 is True
    stop = threading.Event()
    outputs: list[bytes] = []
    flags: list[bool] = []

    def user() -> None:
        while not stop.is_set():
            flags.append(config.compute_crc32)
            outputs.append(_torch_bytes(obj))

    threads = [threading.Thread(target=user) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        while len(outputs) < 20:
            write_archive({"a": torch.randn(400_000), "b": torch.ones(3)}, io.BytesIO())
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert all(_mask_serialization_id(output) == quiet for output in outputs)
    assert all(zipfile.ZipFile(io.BytesIO(o)).testzip() is None for o in outputs)
    assert all(flags) and config.compute_crc32 is True


# --------------------------------------------------------------------------- older torch

_OLD_TORCH = os.environ.get("TRAJTRACK_OLD_TORCH_PYTHON")

# Runs in the other interpreter: loads each file, prints a digest of what it loaded.
_DIGEST = r"""
import hashlib, json, sys, torch, numpy as np

def digest(obj, storages):
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        raw = bytes(storage.tolist()) if storage.nbytes() else b""
        key = storages.setdefault(storage.data_ptr(), len(storages))
        return ["tensor", str(obj.dtype), list(obj.shape), list(obj.stride()),
                obj.storage_offset(), obj.requires_grad, obj.is_conj(), obj.is_neg(),
                hashlib.sha256(raw).hexdigest(), key]
    if isinstance(obj, dict):
        return ["dict", [[repr(k), digest(v, storages)] for k, v in obj.items()]]
    if isinstance(obj, (list, tuple)):
        return [type(obj).__name__, [digest(v, storages) for v in obj]]
    if isinstance(obj, np.ndarray):
        return ["ndarray", str(obj.dtype), list(obj.shape), obj.tobytes().hex()]
    return ["value", repr(obj)]

def load(path, mmap):
    return torch.load(path, weights_only=True, mmap=mmap)

if __name__ == "__main__":
    out = {"torch": torch.__version__}
    for path in sys.argv[1:]:
        try:
            out[path] = [digest(load(path, m), {}) for m in (False, True)]
        except Exception as exc:
            out[path] = "error: " + type(exc).__name__ + ": " + str(exc)[:200]
    print(json.dumps(out))
"""

OLD_TORCH_OBJECTS: dict[str, Any] = {
    **{name: obj for name, obj in OBJECTS.items() if name != "numpy"},  # numpy: an allow-list
    **{f"dtype_{dtype}": _tensor_of(dtype, 12).view(3, 4)[1:, ::2] for dtype in DTYPES},
}


@pytest.mark.skipif(not _OLD_TORCH, reason="TRAJTRACK_OLD_TORCH_PYTHON names no older torch")
def test_an_older_torch_loads_the_archives(tmp_path: Path) -> None:
    paths = []
    for name, obj in OLD_TORCH_OBJECTS.items():
        for kind in ("ours", "torch"):
            path = tmp_path / f"{name}.{kind}.pt"
            with open(path, "wb") as handle:
                if kind == "ours":
                    write_archive(obj, handle)
                else:
                    torch.save(obj, handle)
            paths.append(str(path))
    script = tmp_path / "digest.py"
    script.write_text(_DIGEST)
    result = subprocess.run(
        [str(_OLD_TORCH), str(script), *paths], capture_output=True, text=True, check=True
    )
    digests = json.loads(result.stdout.strip().splitlines()[-1])
    version = digests.pop("torch")
    assert version != torch.__version__
    refused = []
    for name in OLD_TORCH_OBJECTS:
        ours = digests[str(tmp_path / f"{name}.ours.pt")]
        # The same objects as from torch.save's file, or the same refusal (a dtype that torch
        # does not know, a global its weights_only unpickler does not allow).
        assert ours == digests[str(tmp_path / f"{name}.torch.pt")], name
        if isinstance(ours, str):
            refused.append(name)
    print(f"torch {version} refused: {refused}")
    # torch 2.4's weights_only unpickler allows neither complex nor bytes (protocol 2 pickles
    # them through globals); some dtypes are newer than some torch versions.
    assert all(name.startswith("dtype_") or name in ("scalars", "nested") for name in refused)


def test_the_digest_script_runs_here(tmp_path: Path) -> None:
    # The older-torch test's own helper, checked with this torch (it must see differences).
    path = tmp_path / "a.pt"
    with open(path, "wb") as handle:
        write_archive(OBJECTS["sliced_views"], handle)
    script = tmp_path / "digest.py"
    script.write_text(_DIGEST)
    out = subprocess.run(
        [sys.executable, str(script), str(path)], capture_output=True, text=True, check=True
    )
    digest = json.loads(out.stdout)[str(path)]
    assert digest[0] == digest[1] and digest[0][0] == "dict"
