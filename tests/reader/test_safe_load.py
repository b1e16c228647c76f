"""Safe loading on torch's public API: refusals, the caller's allow-list untouched, threads."""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import random
import shlex
import threading
import time
import types
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import trajtrack.reader._load_worker as load_worker
import trajtrack.reader._safe_load as safe_load
from _support.expect import assert_same
from trajtrack import DumpLoadError, UnsafeLoadError
from trajtrack.reader import allow_in_this_process, check_loadable, load_dump_bytes, load_dump_file
from trajtrack.rollout import RolloutBatch, RolloutSample


class WritesMarker:
    """Unpickling this object creates the marker (a directory): what a malicious dump does."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


class RunsShell:
    """Unpickling this object runs a shell command that creates the marker."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def saved(obj: object, *, legacy: bool = False) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer, _use_new_zipfile_serialization=not legacy)
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


def names(entries: list[Any]) -> list[str]:
    return sorted(safe_load._name(entry) for entry in entries)


TRAJTRACK_NAMES = sorted(safe_load._allowed_names())


@pytest.fixture
def allow_list_watch() -> Iterator[list[list[str]]]:
    """Fail if torch's process-wide allow-list changes while the test runs, even briefly.

    A thread compares it with its starting value in a loop; a load that widened the list for a
    moment (``safe_globals()`` around a load, for example) is seen by it.
    """
    before = names(torch.serialization.get_safe_globals())
    changes: list[list[str]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            now = names(torch.serialization.get_safe_globals())
            if now != before:
                changes.append(now)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield changes
    stop.set()
    watcher.join()
    assert changes == []
    assert names(torch.serialization.get_safe_globals()) == before


def test_concurrent_loads_refuse_the_malicious_dump_and_load_the_others(
    tmp_path: Path, allow_list_watch: list[list[str]]
) -> None:
    marker = tmp_path / "pwned"
    evil = saved({"x": torch.ones(3), "payload": WritesMarker(str(marker))})
    good = {i: saved(sample(i)) for i in range(8)}
    plain = {i: saved({"t": torch.full((1000,), float(i)), "n": i}) for i in range(8)}
    files = {i: tmp_path / f"s{i}.pth" for i in range(8)}
    for i, path in files.items():
        path.write_bytes(good[i])

    def one(job: tuple[str, int]) -> object:
        kind, i = job
        if kind == "evil":
            with pytest.raises(UnsafeLoadError, match=r"posix\.mkdir|os\.mkdir"):
                load_dump_bytes(evil, where=f"evil{i}")
            return None
        if kind == "file":
            return load_dump_file(files[i % 8])
        return load_dump_bytes(good[i % 8] if kind == "sample" else plain[i % 8])

    jobs = [(kind, i) for i in range(24) for kind in ("sample", "evil", "plain", "file")]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, jobs))
    assert not marker.exists()
    for (kind, i), result in zip(jobs, results, strict=True):
        if kind in ("sample", "file"):
            assert_same(result, sample(i % 8))
        elif kind == "plain":
            assert isinstance(result, dict) and result["n"] == i % 8
            assert torch.equal(result["t"], torch.full((1000,), float(i % 8)))


def test_the_allow_list_is_unchanged_during_a_load(
    monkeypatch: pytest.MonkeyPatch, allow_list_watch: list[list[str]]
) -> None:
    # Seen from inside the load: a RolloutBatch checks itself while the object is built.
    during: list[list[str]] = []
    original = RolloutBatch.check_consistency

    def hook(self: RolloutBatch) -> None:
        during.append(names(torch.serialization.get_safe_globals()))
        original(self)

    monkeypatch.setattr(RolloutBatch, "check_consistency", hook)
    before = names(torch.serialization.get_safe_globals())
    data = saved(sample(3))
    assert_same(load_dump_bytes(data), sample(3))
    assert during and all(seen == before for seen in during)
    # ... and torch.load elsewhere in the process still refuses trajtrack's types.
    with pytest.raises(Exception, match="rebuild_sample"):
        torch.load(io.BytesIO(data), weights_only=True)


def test_refusal_names_the_global_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(UnsafeLoadError, match=r"refusing to load: it references .*mkdir"):
        load_dump_bytes(saved([WritesMarker(str(marker))]), where="d")
    with pytest.raises(UnsafeLoadError, match=r"posix\.system"):
        load_dump_bytes(saved([sample(1), RunsShell(str(marker))]), where="d")
    assert not marker.exists()
    with pytest.raises(UnsafeLoadError, match=r"builtins\.print|print"):
        load_dump_bytes(saved({"f": print}), where="d")


@pytest.mark.parametrize("payload", [WritesMarker, RunsShell])
@pytest.mark.parametrize(
    "load",
    [
        "bytes",
        "bytes, legacy format (through the worker)",
        "file",
        "check_loadable bytes",
        "check_loadable file",
    ],
)
def test_hostile_payloads_are_refused_by_every_loader(
    tmp_path: Path, payload: Callable[[str], object], load: str
) -> None:
    marker = tmp_path / "pwned"
    # The trajtrack type first: the caller refuses it, so a legacy dump (which cannot be
    # scanned) goes to the worker, whose own restricted load must refuse the payload.
    obj = [sample(0), payload(str(marker))]
    data = saved(obj, legacy="legacy" in load)
    path = tmp_path / "d.pth"
    path.write_bytes(data)
    loaders: dict[str, Callable[[], object]] = {
        "bytes": lambda: load_dump_bytes(data),
        "bytes, legacy format (through the worker)": lambda: load_dump_bytes(data),
        "file": lambda: load_dump_file(path),
        "check_loadable bytes": lambda: check_loadable(data),
        "check_loadable file": lambda: check_loadable(path),
    }
    with pytest.raises(UnsafeLoadError, match=r"refusing to load: .*(mkdir|system)"):
        loaders[load]()
    assert not marker.exists()


def test_process_wide_additions_are_still_honoured() -> None:
    # What torch.load(weights_only=True) accepts in this process, trajtrack accepts too.
    data = saved({"c": Holder(3)})
    with pytest.raises(UnsafeLoadError, match="Holder"):
        load_dump_bytes(data)
    with torch.serialization.safe_globals([Holder]):
        assert load_dump_bytes(data)["c"].value == 3
    with pytest.raises(UnsafeLoadError, match="Holder"):
        load_dump_bytes(data)


class Holder:
    def __init__(self, value: int) -> None:
        self.value = value


def test_a_dump_needing_the_process_list_and_trajtracks_says_how_to_load_it() -> None:
    data = saved({"c": Holder(3), "s": sample(1)})
    torch.serialization.add_safe_globals([Holder])  # the suite's fixture restores the list
    with pytest.raises(UnsafeLoadError, match=r"Holder.*allow_in_this_process\(\)"):
        load_dump_bytes(data)
    allow_in_this_process()
    loaded = load_dump_bytes(data)
    assert loaded["c"].value == 3
    assert_same(loaded["s"], sample(1))


def test_allow_in_this_process_loads_here_once_widened(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_worker(**_: object) -> None:
        raise AssertionError("the load worker was used")

    monkeypatch.setattr(load_worker, "request_load", no_worker)
    with pytest.raises(DumpLoadError, match="the load worker was used"):
        load_dump_bytes(saved(sample(2)))
    allow_in_this_process()
    allow_in_this_process()
    allowed = names(torch.serialization.get_safe_globals())
    assert all(allowed.count(name) == 1 for name in TRAJTRACK_NAMES)
    assert_same(load_dump_bytes(saved(sample(2))), sample(2))


def test_sparse_tensors_load_and_are_validated() -> None:
    dense = torch.tensor([[0.0, 2.0], [3.0, 0.0]])
    assert torch.equal(load_dump_bytes(saved({"s": dense.to_sparse()}))["s"].to_dense(), dense)
    bad = torch.sparse_coo_tensor(
        torch.tensor([[0, 5], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2), check_invariants=False
    )
    with torch.sparse.check_sparse_tensor_invariants():
        with pytest.raises(DumpLoadError):
            load_dump_bytes(saved({"s": bad}))
        with pytest.raises(DumpLoadError):  # through the worker: checked as this process checks
            load_dump_bytes(saved({"s": bad, "sample": sample(0)}))


def test_a_failed_load_leaves_no_sparse_tensor_to_blame_on_the_next(tmp_path: Path) -> None:
    # torch collects sparse tensors to validate as it unpickles, and validates them when a load
    # ends; one refused half-way would leave its tensors to the next load.
    bad = torch.sparse_coo_tensor(
        torch.tensor([[0, 5], [1, 0]]), torch.tensor([1.0, 2.0]), (2, 2), check_invariants=False
    )
    good = saved({"s": torch.eye(2).to_sparse()})
    with torch.sparse.check_sparse_tensor_invariants():
        for refused in ({"s": bad, "f": print}, {"s": bad, "x": WritesMarker(str(tmp_path))}):
            with pytest.raises(UnsafeLoadError):
                load_dump_bytes(saved(refused))
            assert load_dump_bytes(good)["s"].is_sparse


def test_loads_do_not_overlap_while_sparse_tensors_are_checked(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch validates loaded sparse tensors from one process-wide list that each load empties.
    real_load = torch.load
    active, peak = [0], [0]
    count = threading.Lock()

    def watched(*args: Any, **kwargs: Any) -> Any:
        with count:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.002)  # widens the window in which two loads would overlap
            return real_load(*args, **kwargs)
        finally:
            with count:
                active[0] -= 1

    monkeypatch.setattr(torch, "load", watched)
    data = saved({"s": torch.eye(3).to_sparse()})
    with torch.sparse.check_sparse_tensor_invariants(), ThreadPoolExecutor(6) as pool:
        assert all(r["s"].is_sparse for r in pool.map(lambda _: load_dump_bytes(data), range(24)))
    assert peak[0] == 1


@pytest.mark.filterwarnings("ignore:'torch.load' received a zip file that looks like a TorchScript")
@pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")
def test_torchscript_archives_and_junk_are_refused() -> None:
    buffer = io.BytesIO()
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), buffer)
    with pytest.raises(DumpLoadError, match="TorchScript"):
        load_dump_bytes(buffer.getvalue())
    with pytest.raises(DumpLoadError):
        load_dump_bytes(b"PK\x03\x04 not really a zip")


def test_legacy_format_loads_with_the_allow_list() -> None:
    assert_same(load_dump_bytes(saved(sample(1), legacy=True)), sample(1))


def test_corrupt_files_are_dump_load_errors(tmp_path: Path) -> None:
    data = saved({"x": torch.arange(20000, dtype=torch.float32), "y": [torch.ones(3)]})
    rng = random.Random(7)
    path = tmp_path / "d.pth"
    outcomes: set[str] = set()
    for _ in range(150):
        broken = bytearray(data[: rng.randrange(len(data))] if rng.random() < 0.7 else data)
        for _ in range(rng.randrange(0, 6)):
            if broken:
                broken[rng.randrange(len(broken))] = rng.randrange(256)
        path.write_bytes(broken)
        data_now = bytes(broken)
        for load in (
            lambda: load_dump_bytes(data_now),  # noqa: B023 - called within the iteration
            lambda: load_dump_file(path),
        ):
            try:
                obj = load()
            except (DumpLoadError, UnsafeLoadError):  # a flipped byte may rename a global
                outcomes.add("refused")
            else:
                outcomes.add("loaded")
                if isinstance(obj, dict) and isinstance(obj.get("x"), torch.Tensor):
                    assert obj["x"].sum().numel() == 1  # every element can be read
    assert outcomes == {"refused", "loaded"}
    with pytest.raises(FileNotFoundError):
        load_dump_file(tmp_path / "absent.pth")


class _OldPickler(pickle.Pickler):
    """Pickles trajtrack's records as they pickled before their ``__reduce__``: ``NEWOBJ`` and
    ``BUILD`` of the class, numpy's own reconstructors inside."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is RolloutBatch:
            return (copyreg.__newobj__, (RolloutBatch,), obj.__getstate__())
        if type(obj) is RolloutSample:
            return (copyreg.__newobj__, (RolloutSample,), dict(vars(obj)))
        return NotImplemented


def test_records_written_before_the_rebuild_form_still_load() -> None:
    old = types.SimpleNamespace(Pickler=_OldPickler, __name__="old_pickle")
    buffer = io.BytesIO()
    torch.save(sample(5), buffer, pickle_module=old)
    data = buffer.getvalue()
    names = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))
    assert any(name.endswith("_reconstruct") for name in names)  # the old form, numpy inside
    assert not any("rebuild" in name for name in names)
    assert_same(load_dump_bytes(data), sample(5))  # through the load worker
