"""The static check of byte-identical pairs: ``only_default_globals`` and ``check_loadable``.

``diff`` does not load a pair whose bytes are equal, but refuses it when a load would be
refused. The scan answers "every global the pickle names is on torch's default list" without
unpickling anything; whenever it says so, torch's own static check must find nothing unsafe.
"""

from __future__ import annotations

import io
import os
import pickle
import random
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from reader.test_fast_load import Marker, _replace_pickle, rezipped, saved
from trajtrack._exceptions import UnsafeLoadError
from trajtrack.reader._fast_load import only_default_globals
from trajtrack.reader._safe_load import check_loadable


def torch_finds_unsafe(data: bytes) -> list[str] | None:
    """What torch's static check names outside its default list (``None``: it cannot read
    the archive)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
    except Exception:
        return None


PLAIN = saved({"i": 3, "v": torch.arange(64, dtype=torch.int16).reshape(8, 8).t()})


def test_plain_tensor_archives_pass_the_scan() -> None:
    for obj in ({"v": torch.ones(3)}, [torch.zeros(2, dtype=torch.bool), 1.5], torch.Size([2])):
        assert only_default_globals(saved(obj))


@pytest.mark.parametrize(
    "line",
    [b"posix\nsystem\n", b"builtins\neval\n", b"torch\nload\n", b"collections\nCounter\n"],
)
def test_a_global_outside_the_table_fails_the_scan(line: bytes) -> None:
    pickled = pickle.PROTO + b"\x02" + pickle.GLOBAL + line + pickle.STOP
    assert not only_default_globals(_replace_pickle(PLAIN, pickled))


def test_a_hostile_identical_dump_is_still_refused(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = saved({"x": Marker(str(marker)), "t": torch.ones(2)})
    assert not only_default_globals(data)
    with pytest.raises(UnsafeLoadError, match=r"posix\.mkdir"):
        check_loadable(data)
    assert not marker.exists()


def test_a_second_pickle_record_fails_the_scan() -> None:
    # Two records named data.pkl: which one a reader takes is not the scan's to guess.
    hostile = pickle.PROTO + b"\x02" + pickle.GLOBAL + b"posix\nsystem\n" + pickle.STOP
    doubled = rezipped(
        PLAIN, lambda name, body: [body, hostile] if name.endswith("/data.pkl") else body
    )
    assert not only_default_globals(doubled)


@pytest.mark.parametrize("other", ["ARCHIVE/DATA.PKL", "elsewhere/data.pkl", "archive/Data.pkl"])
def test_another_record_a_lookup_could_take_for_the_pickle_fails_the_scan(other: str) -> None:
    # torch's reader looks up <folder>/data.pkl ignoring ASCII case; the scan reads only the
    # first record, so any other record named like a pickle declines, wherever it lies.
    hostile = pickle.PROTO + b"\x02" + pickle.GLOBAL + b"posix\nsystem\n" + pickle.STOP
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(PLAIN)) as source, zipfile.ZipFile(out, "w") as target:
        for record in source.infolist():
            target.writestr(record.filename, source.read(record))
        target.writestr(other, hostile)
    assert not only_default_globals(out.getvalue())


def test_the_first_record_must_be_the_pickle() -> None:
    # A harmless pickle first under another name, the hostile data.pkl after it: torch reads
    # data.pkl, so the scan must not take the first record for it.
    hostile = pickle.PROTO + b"\x02" + pickle.GLOBAL + b"posix\nsystem\n" + pickle.STOP
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(PLAIN)) as source, zipfile.ZipFile(out, "w") as target:
        target.writestr("archive/decoy", pickle.dumps(None, protocol=2))
        for record in source.infolist():
            body = hostile if record.filename.endswith("/data.pkl") else source.read(record)
            target.writestr(record.filename, body)
    assert torch_finds_unsafe(out.getvalue()) == ["posix.system"]
    assert not only_default_globals(out.getvalue())


def test_python2_names_the_unpickler_would_map_fail_the_scan() -> None:
    # The C unpickler maps UserDict to collections (fix_imports); the scan takes names as
    # written, so such a pickle goes to torch's check.
    pickled = pickle.PROTO + b"\x02" + pickle.GLOBAL + b"UserDict\nOrderedDict\n"
    pickled += pickle.EMPTY_TUPLE + pickle.REDUCE + pickle.STOP
    assert not only_default_globals(_replace_pickle(PLAIN, pickled))


def test_flipped_bytes_never_pass_what_torch_finds_unsafe() -> None:
    # Differential: most flips go into the pickle, where they can rename a global.
    rng = random.Random(int(os.environ.get("SEED", "4321")))
    start = PLAIN.index(b"\x80\x02")
    end = PLAIN.index(pickle.STOP, start) + 1
    passed = unreadable = 0
    for _ in range(1500):
        data = bytearray(PLAIN)
        for _ in range(rng.choice((1, 2, 4))):
            at = rng.randrange(start, end) if rng.random() < 0.8 else rng.randrange(len(data))
            data[at] ^= 1 << rng.randrange(8)
        if not only_default_globals(bytes(data)):
            continue
        passed += 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = torch_finds_unsafe(bytes(data))
        if found is None:
            unreadable += 1
            continue
        assert found == [], bytes(data[start:end])
    assert passed > 150 and unreadable < passed  # most flips leave the names alone


def test_what_the_scan_passes_needs_no_torch_call(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = torch.serialization.get_unsafe_globals_in_checkpoint

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.serialization, "get_unsafe_globals_in_checkpoint", counting)
    check_loadable(PLAIN)
    assert calls == []
    with pytest.raises(UnsafeLoadError):
        check_loadable(saved({"x": Marker("/nonexistent/x")}))
    assert calls == [1]
