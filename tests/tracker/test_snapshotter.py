"""The snapshot's route for small plain data: copied for the files layout, serialized at once
for the shards layout (whose members are laid out from their bytes on the event loop)."""

from __future__ import annotations

import io
import zlib
from typing import Any

import torch

from trajtrack.backends import BytesPayload
from trajtrack.layouts.names import WriterIdentity
from trajtrack.tracker._payloads import ObjectPayload
from trajtrack.tracker._serialize import torch_save
from trajtrack.tracker._snapshotter import SERIALIZE_NOW_MAX_BYTES, Snapshotter


def snapshotter(*, serialize_small: bool, serializer: Any = torch_save) -> Snapshotter:
    return Snapshotter(
        serializer,
        inline_bytes=4 << 20,
        serialize_small=serialize_small,
        spool_dir=None,
        who=WriterIdentity.current(),
        threads=2,
    )


def small() -> dict[str, torch.Tensor]:
    return {"obs": torch.arange(64, dtype=torch.float32), "ids": torch.arange(8)}


def test_small_plain_data_is_copied_for_the_files_layout() -> None:
    obj = small()
    payload = snapshotter(serialize_small=False).take_here(obj)
    assert isinstance(payload, ObjectPayload)
    obj["obs"].zero_()  # the caller goes on: the snapshot must not see it
    assert torch.equal(payload.obj["obs"], torch.arange(64, dtype=torch.float32))
    assert payload.obj["obs"].data_ptr() != obj["obs"].data_ptr()


def test_small_plain_data_is_serialized_at_once_for_the_shards_layout() -> None:
    obj = small()
    payload = snapshotter(serialize_small=True).take_here(obj)
    assert isinstance(payload, BytesPayload)
    obj["obs"].zero_()
    data = bytes(payload.data)
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    assert torch.equal(loaded["obs"], torch.arange(64, dtype=torch.float32))
    assert torch.equal(loaded["ids"], torch.arange(8))
    assert payload.counted().checksum == f"crc32:{zlib.crc32(data):08x}"


def test_larger_or_custom_serialized_data_is_copied_even_for_shards() -> None:
    large = {"obs": torch.zeros(SERIALIZE_NOW_MAX_BYTES // 4 + 1)}
    assert isinstance(snapshotter(serialize_small=True).take_here(large), ObjectPayload)

    def custom(obj: Any, file: Any) -> None:
        torch.save(obj, file)

    assert isinstance(
        snapshotter(serialize_small=True, serializer=custom).take_here(small()), ObjectPayload
    )
