"""Safe loading: trajtrack's allow-list without process-wide state, under concurrent loads."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trajtrack.reader._safe_load as safe_load
import trajtrack.reader._weights_only as weights_only
from _support.expect import assert_same
from trajtrack import DumpLoadError, UnsafeLoadError
from trajtrack.reader._safe_load import load_dump_bytes
from trajtrack.rollout import RolloutBatch, RolloutSample


class WritesMarker:
    """Unpickling this object creates the marker (a directory): what a malicious dump does."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def sample(i: int) -> RolloutSample:
    return RolloutSample(
        full_batch=RolloutBatch(
            {"responses": torch.arange(6).reshape(2, 3) + i},
            {"uid": np.array([f"u{i}", "v"], dtype=object)},
            {"k": np.float64(i)},
        ),
        sample_id=f"s{i}",
    )


@pytest.fixture
def no_process_wide_changes(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail if anything adds to (or removes from) torch's process-wide allow-list."""

    def forbidden(*args: object) -> None:
        raise AssertionError("torch's process-wide allow-list was modified")

    before = torch.serialization.get_safe_globals()
    for name in ("_add_safe_globals", "_remove_safe_globals", "_clear_safe_globals"):
        monkeypatch.setattr(torch._weights_only_unpickler, name, forbidden)
    yield
    assert torch.serialization.get_safe_globals() == before


@pytest.mark.usefixtures("no_process_wide_changes")
def test_concurrent_loads_refuse_the_malicious_dump_and_load_the_others(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    evil = saved({"x": torch.ones(3), "payload": WritesMarker(str(marker))})
    good = {i: saved(sample(i)) for i in range(8)}
    plain = {i: saved({"t": torch.full((1000,), float(i)), "n": i}) for i in range(8)}

    def one(job: tuple[str, int]) -> object:
        kind, i = job
        if kind == "evil":
            with pytest.raises(UnsafeLoadError, match=r"posix\.mkdir|os\.mkdir"):
                load_dump_bytes(evil, where=f"evil{i}")
            return None
        data = good[i % 8] if kind == "sample" else plain[i % 8]
        return load_dump_bytes(data, share_memory=i % 2 == 0)

    jobs = [(kind, i) for i in range(40) for kind in ("sample", "evil", "plain")]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs))
    assert not marker.exists()
    for (kind, i), result in zip(jobs, results, strict=True):
        if kind == "sample":
            assert_same(result, sample(i % 8))
        elif kind == "plain":
            assert isinstance(result, dict) and result["n"] == i % 8
            assert torch.equal(result["t"], torch.full((1000,), float(i % 8)))


@pytest.mark.usefixtures("no_process_wide_changes")
def test_refusal_names_the_global_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafeLoadError, match=r"refusing to load: it references .*mkdir"):
        load_dump_bytes(saved([WritesMarker(str(marker))]), where="d")
    assert not marker.exists()
    with pytest.raises(UnsafeLoadError, match=r"builtins\.print|print"):
        load_dump_bytes(saved({"f": print}), where="d")


def test_process_wide_additions_are_still_honoured() -> None:
    # What torch.load(weights_only=True) accepts in this process, trajtrack accepts too.
    data = saved({"c": complex_holder(3)})
    with pytest.raises(UnsafeLoadError, match="Holder"):
        load_dump_bytes(data)
    with torch.serialization.safe_globals([Holder]):
        assert load_dump_bytes(data)["c"].value == 3
    with pytest.raises(UnsafeLoadError, match="Holder"):
        load_dump_bytes(data)


class Holder:
    def __init__(self, value: int) -> None:
        self.value = value


def complex_holder(value: int) -> Holder:
    return Holder(value)


def test_shared_memory_tensors_view_the_bytes() -> None:
    data = saved({"x": torch.arange(1000, dtype=torch.float32), "y": [torch.ones(2, 2)]})
    copied = load_dump_bytes(data)
    shared = load_dump_bytes(data, share_memory=True)
    assert torch.equal(copied["x"], shared["x"]) and torch.equal(copied["y"][0], shared["y"][0])
    start = np.frombuffer(data, dtype=np.uint8).ctypes.data
    assert start <= shared["x"].data_ptr() < start + len(data)  # no copy
    assert not start <= copied["x"].data_ptr() < start + len(data)


def test_sparse_tensors_load_and_are_validated() -> None:
    dense = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    assert torch.equal(load_dump_bytes(saved({"s": dense.to_sparse()}))["s"].to_dense(), dense)
    bad = torch.sparse_coo_tensor(
        torch.tensor([[0, 5], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2), check_invariants=False
    )
    data = saved({"s": bad})
    with torch.sparse.check_sparse_tensor_invariants(), pytest.raises(DumpLoadError):
        load_dump_bytes(data)


@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
def test_torchscript_archives_and_junk_are_refused() -> None:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buffer)
    with pytest.raises(DumpLoadError, match="TorchScript"):
        load_dump_bytes(buffer.getvalue())
    with pytest.raises(DumpLoadError):
        load_dump_bytes(b"PK\x03\x04 not really a zip")


def test_legacy_format_loads_with_the_allow_list() -> None:
    buffer = io.BytesIO()
    torch.save(sample(1), buffer, _use_new_zipfile_serialization=False)
    assert_same(load_dump_bytes(buffer.getvalue()), sample(1))


def test_without_the_torch_internals_the_locked_fallback_behaves_the_same(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(safe_load, "restricted_loader", lambda extra: None)
    marker = tmp_path / "pwned"
    assert_same(load_dump_bytes(saved(sample(2))), sample(2))
    with pytest.raises(UnsafeLoadError, match="mkdir"):
        load_dump_bytes(saved(WritesMarker(str(marker))))
    assert not marker.exists()


def test_the_loader_reuses_torchs_own_unpickling_code() -> None:
    loader = weights_only.restricted_loader(safe_load.allowed_globals())
    assert loader is not None
    unpickler: Callable[..., Any] = loader._concurrent.Unpickler.load
    assert unpickler.__code__ is torch._weights_only_unpickler.Unpickler.load.__code__
