"""Differential fuzz: the fast path and ``_archive_diff`` against ``torch.load(weights_only=True)``.

Mutated archives (bit flips, truncations, opcode swaps in the pickle, record edits) of plain
tensor data and of trajtrack's rollout records go through the fast path and through torch
(with trajtrack's allow-list, which the fast path stands for). Whatever the fast path accepts,
torch accepts, with the same values: types, dtypes, shapes, strides, offsets, bits and which
tensors share a storage. Whatever ``compare_archives`` answers is what comparing torch's two
loads answers. The safe loader's overall decision (fast path, else torch) is checked against
torch's for the plain archives. Bounded and seeded (``SEED``): a few seconds.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import random
import struct
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from reader.test_fast_load import assert_identical, rezipped, saved
from trajtrack import DumpLoadError, UnsafeLoadError
from trajtrack.reader._archive_diff import compare_archives
from trajtrack.reader._compare import Tolerance, compare
from trajtrack.reader._fast_load import DECLINED, fast_load
from trajtrack.reader._safe_load import load_dump_bytes
from trajtrack.rollout import SAFE_GLOBALS, RolloutBatch, RolloutSample

SEED = int(os.environ.get("SEED", "20261203"))
_BASE = torch.arange(24, dtype=torch.float32).reshape(4, 6)

PLAIN: Any = {
    "i": 3,
    "v": torch.arange(64, dtype=torch.int16).reshape(8, 8).t(),
    "views": [_BASE, _BASE[1], _BASE[:, 2], _BASE],
    "scalars": ["text", b"raw", 2.5, 1 + 2j, None, True, {1, 2}, torch.float16],
    "od": OrderedDict(a=torch.ones(2)),
    "u16": torch.zeros(3, dtype=torch.uint16),
    "grad": torch.ones(2, requires_grad=True),
}
RECORD = RolloutSample(
    full_batch=RolloutBatch(
        {"responses": torch.arange(8).reshape(2, 4), "old_log_probs": torch.randn(2, 4)},
        {"uid": np.array(["a", "b"], dtype=object), "raw": [[{"role": "user"}], [{}]]},
        {"temperature": 1.0},
    ),
    sample_id="sample_0_1",
    processing_times=[0.5, 0.25],
    rollout_status={"count": 2},
)
_OPCODES = b"().02GJKMNQRXabehqrstu}\x80\x85\x86\x87\x88\x89\x8a"  # torch's set, and some


def torch_load(data: bytes) -> Any:
    with warnings.catch_warnings(), torch.serialization.safe_globals(list(SAFE_GLOBALS)):
        warnings.simplefilter("ignore")  # TypedStorage, "protocol 0"...
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def torch_outcome(data: bytes) -> tuple[bool, Any]:
    try:
        return True, torch_load(data)
    except Exception:  # any refusal
        return False, None


def assert_same(got: Any, want: Any, shared: dict[int, int], where: str = "") -> None:
    """Same types and values all the way down (tensors bit for bit, with torch's sharing)."""
    assert type(got) is type(want), f"{where}: {type(got)} vs {type(want)}"
    if isinstance(want, torch.Tensor):
        assert_identical(got, want, shared, where)  # every attribute, bits and sharing
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for key in want:
            assert_same(got[key], want[key], shared, f"{where}[{key!r}]")
    elif isinstance(want, list | tuple):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, shared, f"{where}[{i}]")
    elif isinstance(want, np.ndarray):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), where
        if want.dtype == object:
            assert_same(got.tolist(), want.tolist(), shared, where)
        else:
            assert got.tobytes() == want.tobytes(), where
    elif isinstance(want, RolloutSample | RolloutBatch):
        assert_same(vars(got), vars(want), shared, where)
    elif isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), where
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


def _pickle_span(data: bytes) -> tuple[int, int]:
    info = zipfile.ZipFile(io.BytesIO(data)).infolist()[0]
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    start = info.header_offset + 30 + name_len + extra_len
    return start, start + info.file_size


def _flip(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.choice((1, 2, 3))):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def _truncate(rng: random.Random, data: bytes) -> bytes:
    return data[: rng.randrange(len(data))]


def _swap_opcode(rng: random.Random, data: bytes) -> bytes:
    start, end = _pickle_span(data)
    out = bytearray(data)
    out[rng.randrange(start, end)] = rng.choice(_OPCODES)
    return bytes(out)


def _edit_record(rng: random.Random, data: bytes) -> bytes:
    """A storage record longer or shorter, a pickle byte changed, or a record dropped,
    written again as a valid zip."""
    choice = rng.randrange(3)

    def change(name: str, body: bytes) -> Any:
        if choice == 0 and "/data/" in name and rng.random() < 0.5:
            return body[: -rng.randint(1, 4)] if rng.random() < 0.5 else body + b"\0" * 4
        if choice == 1 and name.endswith("/data.pkl"):
            at = rng.randrange(len(body))
            return body[:at] + bytes([rng.randrange(256)]) + body[at + 1 :]
        if choice == 2 and "/data/" in name and rng.random() < 0.3:
            return []  # the record dropped
        return body

    return rezipped(data, change)


# Opcode sequences torch's unpickler implements, inserted where an opcode starts: a BUILD
# (None, a dict, slot state), an item assignment, an append, a pop of the stack's top.
_SNIPPETS = [
    b"Nb",
    b"}b",
    b"N}X\x05\x00\x00\x00startK\x00sb",
    b"N}X\x05\x00\x00\x00dtypectorch\nint32\nsb",
    b"K\x00K\x07s",
    b"X\x01\x00\x00\x00vK\x07s",
    b"(K\x01e",
    b"K\x01a",
    b"\x85",
]


def _insert_opcodes(rng: random.Random, data: bytes) -> bytes:
    def change(name: str, body: bytes) -> bytes:
        if not name.endswith("/data.pkl"):
            return body
        starts = [position for _, _, position in pickletools.genops(body)]
        at = rng.choice(starts[1:])  # after PROTO
        return body[:at] + rng.choice(_SNIPPETS) + body[at:]

    return rezipped(data, change)


MUTATIONS: list[Callable[[random.Random, bytes], bytes]] = [
    _flip,
    _flip,
    _truncate,
    _swap_opcode,
    _insert_opcodes,
    _insert_opcodes,
    _edit_record,
]


def _fuzz(original: bytes, rounds: int, seed: int) -> tuple[int, int]:
    """``(accepted by the fast path, refused by torch)`` over *rounds* mutations."""
    rng = random.Random(seed)
    accepted = refused = 0
    for _ in range(rounds):
        data = rng.choice(MUTATIONS)(rng, original)
        got = fast_load(data)
        ok, want = torch_outcome(data)
        refused += not ok
        if got is DECLINED:
            continue
        accepted += 1
        assert ok, f"the fast path accepted what torch refuses: {data!r:.300}"
        assert_same(got, want, {})
    return accepted, refused


def test_the_fast_path_agrees_with_torch_on_mutated_tensor_archives() -> None:
    accepted, refused = _fuzz(saved(PLAIN), 700, SEED)
    assert accepted > 60 and refused > 150  # both sides of the boundary were exercised


def test_the_fast_path_agrees_with_torch_on_mutated_rollout_records() -> None:
    accepted, refused = _fuzz(saved(RECORD), 400, SEED + 1)
    assert accepted > 50 and refused > 50


def test_the_safe_loader_makes_torchs_decision_on_mutated_archives() -> None:
    rng = random.Random(SEED + 2)
    original = saved(PLAIN)
    for _ in range(200):
        data = rng.choice(MUTATIONS)(rng, original)
        ok, want = torch_outcome(data)
        try:
            got = load_dump_bytes(data)
        except (DumpLoadError, UnsafeLoadError):
            assert not ok or _has_directory_record(data)
            continue
        assert ok
        assert_same(got, want, {})


def _has_directory_record(data: bytes) -> bool:
    try:
        entries = zipfile.ZipFile(io.BytesIO(data)).infolist()
    except Exception:  # not a zip: no such record
        return False
    return any(e.filename.endswith("/") or e.external_attr & 0x10 for e in entries)


def test_archive_diff_agrees_with_comparing_torchs_loads() -> None:
    rng = random.Random(SEED + 3)
    obj = {"a": torch.arange(40.0).reshape(5, 8), "b": [torch.ones(3, dtype=torch.float64), 1]}
    original = saved(obj)
    answered = 0
    for _ in range(500):
        mutated = rng.choice(MUTATIONS)(rng, original)
        found = compare_archives(original, mutated, Tolerance(), 50)
        if found is None:
            continue
        answered += 1
        ok, want = torch_outcome(mutated)
        assert ok, f"compared what torch refuses: {mutated!r:.300}"
        expected = compare(torch_load(original), want, Tolerance(), limit=50)
        assert [(d.path, d.kind, d.index, d.mismatched) for d in found] == [
            (d.path, d.kind, d.index, d.mismatched) for d in expected
        ]
    assert answered > 50


def test_hostile_pickles_never_change_a_later_load() -> None:
    # Every mutation above ran through the same process: an honest dump still loads right.
    honest = saved({"x": torch.tensor([1.0, 2.0, 3.0]), "b": b"ok"})
    got = load_dump_bytes(honest)
    assert got["x"].dtype == torch.float32
    assert torch.equal(got["x"], torch.tensor([1.0, 2.0, 3.0]))
    assert pickle.dumps(got["b"]) == pickle.dumps(b"ok")
