"""The plain-data snapshot (tracker/_snapshot.py): copies that later mutation cannot reach."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch

from trajtrack._exceptions import SerializationError
from trajtrack.tracker._payloads import DeferredPayload
from trajtrack.tracker._snapshot import SMALL_COPY_MAX_BYTES, _small_copy, snapshot_plain


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
