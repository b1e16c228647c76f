"""Admitting snapshots into the queue, and the ways in for dumps made in another process.

:class:`Intake` is the part of :class:`~trajtrack.Tracker` that the Ray adapter's actor uses:
:meth:`~Intake.dump_serialized` for bytes serialized by the caller, :meth:`~Intake.dump_decoded`
for plain data received as raw buffers. Both apply the name template with the identity of the
process that made the dump.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from trajtrack.backends import BytesPayload, Payload
from trajtrack.layouts.names import WriterIdentity, render_name, validate_name
from trajtrack.tracker._future import DumpFuture
from trajtrack.tracker._handle import DumpHandle
from trajtrack.tracker._ledger import Ledger
from trajtrack.tracker._payloads import DeferredPayload
from trajtrack.tracker._queue import FullPolicy, Job
from trajtrack.tracker._runner import Runner
from trajtrack.tracker._serialize import Serializer

__all__ = ["Intake", "make_job"]


class Intake:
    """Queueing of snapshots; the tracker's entry points for adapters."""

    _runner: Runner
    _ledger: Ledger
    _who: WriterIdentity
    _template: str
    _suffix: str
    _policy: FullPolicy
    _serializer: Serializer

    async def dump_serialized(
        self,
        data: bytes | bytearray | memoryview,
        name: str,
        *,
        writer: WriterIdentity | None = None,
        timeout: float | None = None,
    ) -> DumpHandle:
        """Queue a dump another process already serialized (for adapters such as Ray's).

        Args:
            data: The serialized bytes (what the serializer would have written); not copied.
            name: The dump name.
            writer: The process that made the dump: the name template and the record use it
                instead of this tracker's own identity.
            timeout: As for :meth:`dump`.
        """
        self._runner.check_running()
        who = writer or self._who
        return await self._admit(
            name, self._path_for(name, who), BytesPayload(data), None, timeout, who
        )

    async def dump_decoded(
        self,
        make: Callable[[], Any],
        nbytes: int,
        name: str,
        *,
        writer: WriterIdentity | None = None,
    ) -> DumpHandle:
        """Queue plain data another process sent as raw buffers (for adapters such as Ray's).

        ``make()`` rebuilds the object from buffers the tracker owns (nothing is copied); the
        upload worker calls it, in its thread, then serializes the object with the tracker's
        serializer. *nbytes* is what the memory budget counts.
        """
        self._runner.check_running()
        who = writer or self._who
        payload = DeferredPayload(make, nbytes, serializer=self._serializer)
        return await self._admit(name, self._path_for(name, who), payload, None, None, who)

    async def _admit(
        self,
        name: str,
        path: str,
        payload: Payload,
        policy: FullPolicy | None,
        timeout: float | None,
        who: WriterIdentity | None = None,
    ) -> DumpHandle:
        job = make_job(name, path, payload)
        if who is not None and who is not self._who:
            job.who = who  # the record names the process that made the dump
        deadline = None if timeout is None else time.monotonic() + timeout
        await self._runner.queue.put(job, policy or self._policy, deadline)
        return self._ledger.admitted(job)

    def _path_for(self, name: str, who: WriterIdentity) -> str:
        # Validated again with the suffix: the stored file name must fit HDFS's 255 bytes.
        return validate_name(render_name(self._template, name, who) + self._suffix, new=True)


def make_job(name: str, path: str, payload: Payload) -> Job:
    """A job for *payload*, with the future its handle resolves through."""
    return Job(name=name, path=path, payload=payload, nbytes=payload.nbytes, future=DumpFuture())
