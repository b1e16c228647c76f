"""The archive writer changes nothing for others, and its files load in an older torch."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from _support.archive import DTYPES, OBJECTS, mask_serialization_id, tensor_of, torch_bytes
from trajtrack.tracker._archive import write_archive

# --------------------------------------------------------------------------- nothing global


class _NoConfig:
    compute_crc32 = True


def test_a_users_torch_save_in_other_threads_is_unchanged() -> None:
    obj = {"x": torch.randn(300_000), "y": torch.arange(10)}  # big enough for the CRC thread
    quiet = mask_serialization_id(torch_bytes(obj))
    serialization = getattr(torch.utils, "serialization", None)  # torch 2.4 has no such setting
    config = serialization.config.save if serialization is not None else _NoConfig()
    assert config.compute_crc32 is True
    stop = threading.Event()
    outputs: list[bytes] = []
    flags: list[bool] = []

    def user() -> None:
        while not stop.is_set():
            flags.append(config.compute_crc32)
            outputs.append(torch_bytes(obj))

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
    assert all(mask_serialization_id(output) == quiet for output in outputs)
    assert all(zipfile.ZipFile(io.BytesIO(o)).testzip() is None for o in outputs)
    assert all(flags) and config.compute_crc32 is True


# --------------------------------------------------------------------------- older torch

# The python of a virtual environment with an older torch, e.g. the declared minimum:
#   python3 -m venv /tmp/t24 && /tmp/t24/bin/pip install torch==2.4.1 "numpy<2"
# (PyPI's wheel is a CUDA build: it pulls the nvidia-* wheels, ~5 GB, and imports without a GPU.)
_OLD_TORCH = os.environ.get("TRAJTRACK_OLD_TORCH_PYTHON")

# Runs in the other interpreter: loads each file, prints a digest of what it loaded.
_DIGEST = r"""
import hashlib, json, sys, torch, numpy as np

def digest(obj, storages):
    if isinstance(obj, torch.Tensor):
        storage = obj.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8).set_(storage).numpy().tobytes()
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
    **{f"dtype_{dtype}": tensor_of(dtype, 12).view(3, 4)[1:, ::2] for dtype in DTYPES},
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
