"""The plain-data snapshot (tracker/_snapshot.py): copies that later mutation cannot reach."""

from __future__ import annotations

import io
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from trajtrack._exceptions import SerializationError
from trajtrack.tracker._payloads import DeferredPayload
from trajtrack.tracker._snapshot import (
    RELEASING_COPY_MIN_BYTES,
    SMALL_COPY_MAX_BYTES,
    NotPlainError,
    _small_copy,
    measure_plain,
    snapshot_plain,
)


@pytest.mark.filterwarnings("ignore::UserWarning")  # quantized tensors are deprecated
@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.ones(2, device="meta"),
        lambda: torch.ones(2, 2).to_sparse(),
        lambda: torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8),
    ],
    ids=["meta", "sparse", "quantized"],
)
def test_special_tensors_are_not_plain_data(make: Any) -> None:
    # They go to the serializer whole (torch.save writes them), never to the plain copier.
    with pytest.raises(NotPlainError):
        measure_plain({"t": make()})


def test_a_tensor_counts_the_bytes_of_its_elements_not_of_its_storage() -> None:
    view = torch.zeros(100, 8)[:, ::4]  # 200 float32 elements of a 3,200-byte storage
    assert measure_plain(view) - measure_plain(torch.zeros(0)) == 200 * 4


@pytest.mark.parametrize(
    "source",
    [
        torch.randn(3, 4),
        torch.arange(10, dtype=torch.int64),
        torch.tensor(2.5),  # 0-d
        torch.tensor(7),  # 0-d integer (bytearray(array) would read it as a length)
        torch.tensor(True),  # 0-d bool
        torch.zeros(0, 5),
        torch.rand(6) > 0.5,
        torch.randn(4, dtype=torch.complex64),
        torch.randn(5).half(),
    ],
    ids=["float", "int64", "0-d", "0-d-int", "0-d-bool", "empty", "bool", "complex", "half"],
)
def test_small_cpu_tensors_are_copied_exactly_and_independently(source: torch.Tensor) -> None:
    copy = _small_copy(source)
    assert copy is not None  # the GIL-holding path applies
    assert copy.dtype == source.dtype and copy.shape == source.shape
    assert torch.equal(copy, source)
    assert copy.data_ptr() != source.data_ptr() or source.numel() == 0
    if source.numel():
        first = source.view(-1)[0]
        source.view(-1)[0] = ~first if source.dtype is torch.bool else first + 1
        assert not torch.equal(copy, source)  # the copy did not follow the change


@pytest.mark.parametrize(
    "source",
    [
        torch.randn(4, 4).t(),  # not contiguous
        torch.randn(8).bfloat16(),  # no numpy dtype
        torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate
        torch.zeros(SMALL_COPY_MAX_BYTES // 4 + 1),  # too big: torch copies it, GIL released
    ],
    ids=["transposed", "bfloat16", "conj", "large"],
)
def test_other_tensors_take_torchs_copy(source: torch.Tensor) -> None:
    assert _small_copy(source) is None


def _spy_on_copyto(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real = np.copyto

    def spy(dst: Any, src: Any, **kwargs: Any) -> None:
        sizes.append(np.asarray(src).nbytes)
        real(dst, src, **kwargs)

    monkeypatch.setattr(np, "copyto", spy)
    return sizes


@pytest.mark.parametrize(
    "source",
    [
        torch.randn(RELEASING_COPY_MIN_BYTES // 4),
        torch.randn(64, RELEASING_COPY_MIN_BYTES // 256),  # 2-D, exactly the threshold
        torch.arange(RELEASING_COPY_MIN_BYTES // 8 + 3, dtype=torch.int64),
        torch.rand(RELEASING_COPY_MIN_BYTES + 5) > 0.5,
        torch.randn(RELEASING_COPY_MIN_BYTES // 8, dtype=torch.complex64),
    ],
    ids=["float", "2-d", "int64", "bool", "complex"],
)
def test_large_cpu_tensors_are_copied_exactly_with_the_gil_released(
    source: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    copied = _spy_on_copyto(monkeypatch)
    copy = _small_copy(source)
    assert copy is not None
    assert copied == [source.numel() * source.element_size()]  # numpy's copy, GIL released
    assert copy.dtype == source.dtype and copy.shape == source.shape and copy.is_contiguous()
    assert torch.equal(copy, source)
    assert copy.data_ptr() != source.data_ptr()
    first = source.view(-1)[0]
    source.view(-1)[0] = ~first if source.dtype is torch.bool else first + 1
    assert not torch.equal(copy, source)  # the copy did not follow the change


def test_copies_below_the_threshold_hold_the_gil(monkeypatch: pytest.MonkeyPatch) -> None:
    copied = _spy_on_copyto(monkeypatch)
    below = torch.randn(RELEASING_COPY_MIN_BYTES // 4 - 1)
    copy = _small_copy(below)
    assert copy is not None and torch.equal(copy, below)
    assert copied == []  # the bytes copy, which never releases it


def test_only_a_tensor_that_requires_grad_is_detached(monkeypatch: pytest.MonkeyPatch) -> None:
    # detach() is a torch op: it releases the GIL, and getting it back can take a switch
    # interval when other threads are busy. A tensor outside autograd does not need it.
    detached: list[bool] = []
    real = torch.Tensor.detach

    def spy(self: torch.Tensor) -> torch.Tensor:
        detached.append(self.requires_grad)
        return real(self)

    monkeypatch.setattr(torch.Tensor, "detach", spy)
    plain, graded = torch.randn(3), torch.randn(3, requires_grad=True)
    copy = snapshot_plain({"plain": plain, "graded": graded}).materialize()
    assert detached == [True]  # the tensor that requires grad, and only it
    assert torch.equal(copy["plain"], plain) and not copy["plain"].requires_grad
    assert copy["graded"].requires_grad and torch.equal(copy["graded"].detach(), graded.detach())


def test_a_snapshot_keeps_values_dtypes_grad_and_sharing() -> None:
    shared = torch.randn(3, requires_grad=True)
    obj: dict[str, Any] = {
        "a": shared,
        "b": [shared, torch.randn(2, 2).t()],
        "c": torch.randn(4).bfloat16(),
        "n": np.arange(3),
        "s": 1,
    }
    copy = snapshot_plain(obj).materialize()
    assert copy["a"] is copy["b"][0]  # one tensor twice stays one tensor
    assert copy["a"].requires_grad
    assert torch.equal(copy["a"].detach(), shared.detach())
    assert torch.equal(copy["b"][1], obj["b"][1]) and copy["b"][1].is_contiguous()
    assert copy["c"].dtype is torch.bfloat16 and torch.equal(copy["c"], obj["c"])
    with torch.no_grad():
        shared.add_(1)
    obj["n"][0] = 99
    assert not torch.equal(copy["a"].detach(), shared.detach())
    assert copy["n"][0] == 0


def test_a_deferred_payload_is_made_by_the_writer_once_and_a_failure_is_typed() -> None:
    calls: list[int] = []

    def make() -> Any:
        calls.append(1)
        if len(calls) == 1:
            raise ValueError("bytes gone")  # the first write fails...
        return {"x": torch.arange(3)}

    payload = DeferredPayload(make, 100)
    with pytest.raises(SerializationError, match="could not rebuild the dump: bytes gone"):
        payload.write_to(io.BytesIO())
    first, second = io.BytesIO(), io.BytesIO()
    payload.write_to(first)  # ...a retry makes it (never saves a missing object)
    payload.write_to(second)
    assert len(calls) == 2  # made once it succeeded
    first.seek(0)
    assert torch.equal(torch.load(first)["x"], torch.arange(3))
    assert first.getvalue() == second.getvalue()


@pytest.mark.parametrize(
    "source",
    [torch.randn(3, 4), torch.arange(10), torch.tensor(7), torch.randn(4, dtype=torch.complex64)],
    ids=["2-d", "1-d", "0-d", "complex"],
)
def test_a_small_copy_lets_no_other_thread_run(source: torch.Tensor) -> None:
    # A thread that counts while it holds the GIL. With a long switch interval, it can run
    # during the copy only if the copy gives the GIL up (as a torch op like clone does).
    counted, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.05)
    thread = threading.Thread(target=count)
    try:
        thread.start()
        while not counted[0]:
            time.sleep(0.001)  # the counter holds the GIL now, and hands it back at intervals
        runs = []
        for _ in range(20):
            before = counted[0]
            copy = _small_copy(source)
            runs.append(counted[0] - before)
    finally:
        stop.set()
        thread.join(30)
        sys.setswitchinterval(interval)
    assert copy is not None and torch.equal(copy, source)
    # A forced switch can still land inside one copy (the interval ran out during it).
    assert sorted(runs)[len(runs) // 2] == 0, runs
