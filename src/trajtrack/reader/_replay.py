"""Replaying a recorded run step by step: ``Run.replay`` / ``SyncRun.replay``.

A dump-name pattern such as ``"step{step}/sample{i}"`` picks each step's dumps out of the run's
listing; steps come in ascending numeric order (1, 2, 10: never the listing's completion order
nor ``step10`` before ``step2``), a step's dumps in ascending order of the other field. Where
the trainer recorded a step manifest (:func:`trajtrack.rollout.record_step_manifest`), the
step's dumps are those it names, in its order: in fully-async training only the trainer knows
which samples made up its step.

Whole steps are loaded ahead of the consumer, at most ``prefetch`` of them; each step's dumps
are read in one batch (:meth:`Run.read_many`: shard spans, one worker-thread hop locally) and
loaded safely in worker threads. The loads are tasks of a task group that lives in the
``async with`` block, so leaving the block (a ``break``, an error, a cancellation) cancels the
loads still running: an async generator cannot own background tasks safely (trio's
``as_safe_channel`` and anyio's documentation give the reason).
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
from collections.abc import AsyncIterator, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from anyio.abc import TaskGroup

from trajtrack._exceptions import ConfigurationError, StorageNotFoundError, TrackerStateError
from trajtrack.reader._dumps import DumpInfo
from trajtrack.reader._gather import gather_bounded
from trajtrack.reader._safe_load import load_dump_bytes
from trajtrack.rollout import STEP_MANIFEST, manifest_dumps

if TYPE_CHECKING:
    from trajtrack.reader._run import Run

__all__ = ["Replay", "StepPattern", "plan_steps"]

_LOAD_THREADS = 4  # worker threads loading one step's dumps at once (torch drops the GIL in parts)


@dataclasses.dataclass(frozen=True)
class StepPattern:
    """A dump-name pattern with a ``{step}`` field and at most one other integer field.

    Args:
        pattern: The template, e.g. ``"step{step}/sample{i}"``; fields match decimal digits.

    Raises:
        ConfigurationError: No ``{step}`` field, more than one other field, a repeated field, or
            a format spec or conversion (``{step:03d}``, ``{i!r}``).
    """

    pattern: str
    regex: re.Pattern[str] = dataclasses.field(init=False, repr=False, compare=False)
    other: str | None = dataclasses.field(init=False, compare=False)

    def __post_init__(self) -> None:
        parts: list[str] = []
        fields: list[str] = []
        try:
            parsed = list(string.Formatter().parse(self.pattern))
        except ValueError as exc:
            raise ConfigurationError(f"replay pattern {self.pattern!r}: {exc}") from None
        for literal, field, spec, conversion in parsed:
            parts.append(re.escape(literal))
            if field is None:
                continue
            if spec or conversion or not field.isidentifier() or field in fields:
                raise ConfigurationError(
                    f"replay pattern {self.pattern!r}: fields are plain names, each once "
                    f"(got {{{field}{'!' + conversion if conversion else ''}"
                    f"{':' + spec if spec else ''}}})"
                )
            fields.append(field)
            parts.append(f"(?P<{field}>[0-9]+)")
        if "step" not in fields or len(fields) > 2:
            raise ConfigurationError(
                f"replay pattern {self.pattern!r}: needs a {{step}} field and at most one "
                f"other integer field, e.g. 'step{{step}}/sample{{i}}'"
            )
        object.__setattr__(self, "regex", re.compile("".join(parts)))
        object.__setattr__(self, "other", next((f for f in fields if f != "step"), None))

    def match(self, name: str) -> tuple[int, int] | None:
        """``(step, other field)`` of a dump name the pattern matches (other 0 if none)."""
        found = self.regex.fullmatch(name)
        if found is None:
            return None
        return int(found["step"]), int(found[self.other]) if self.other else 0


@dataclasses.dataclass
class _Step:
    """One step to replay: its dumps, or its manifest (whose dumps are known once it loads)."""

    step: int
    dumps: list[DumpInfo]
    manifest: DumpInfo | None = None
    done: anyio.Event = dataclasses.field(default_factory=anyio.Event)
    objects: list[Any] | None = None
    error: Exception | None = None


def plan_steps(
    dumps: Sequence[DumpInfo],
    pattern: str,
    *,
    steps: Iterable[int] | None = None,
    manifest: str | None = STEP_MANIFEST,
) -> list[tuple[int, list[DumpInfo], DumpInfo | None]]:
    """The steps to replay, ascending: ``(step, its dumps in order, its manifest or None)``.

    A step with a manifest (a dump matching *manifest*) gets no dumps here: they are the ones
    the manifest names.

    Raises:
        ConfigurationError: A bad pattern, or a manifest template with another field.
        StorageNotFoundError: A step asked for in *steps* has neither dumps nor a manifest.
    """
    step_pattern = StepPattern(pattern)
    manifests: dict[int, DumpInfo] = {}
    if manifest is not None:
        manifest_pattern = StepPattern(manifest)
        if manifest_pattern.other is not None:
            raise ConfigurationError(f"manifest template {manifest!r}: only a {{step}} field")
        for info in dumps:
            found = manifest_pattern.match(info.name)
            if found is not None:  # a rewritten manifest: the last one written counts
                manifests[found[0]] = info
    grouped: dict[int, list[tuple[int, str, DumpInfo]]] = {}
    taken = {info.name for info in manifests.values()}
    for info in dumps:
        found = step_pattern.match(info.name)
        if found is not None and info.name not in taken:
            grouped.setdefault(found[0], []).append((found[1], info.name, info))
    wanted = None if steps is None else set(steps)
    chosen = sorted(set(grouped) | set(manifests))
    if wanted is not None:
        missing = sorted(wanted - set(chosen))
        if missing:
            raise StorageNotFoundError(f"replay {pattern!r}: no dumps for step(s) {missing}")
        chosen = [s for s in chosen if s in wanted]
    plan: list[tuple[int, list[DumpInfo], DumpInfo | None]] = []
    for step in chosen:
        if step in manifests:
            plan.append((step, [], manifests[step]))
        else:
            plan.append((step, [info for *_, info in sorted(grouped[step])], None))
    return plan


class Replay:
    """The steps of a run, loaded ahead: ``async with run.replay(pattern) as steps``.

    Iterating yields ``(step, objects)``. In the block, at most *prefetch* steps are loading or
    loaded and not yet taken; with the step the consumer holds, memory holds at most
    ``prefetch + 1`` steps' objects (plus the stored bytes of the steps loading). A bare
    ``async for ... in run.replay(pattern)`` works too, loading each step when it is asked for
    (no look-ahead: one step in memory). Made by :meth:`Run.replay`.
    """

    def __init__(
        self,
        run: Run,
        pattern: str,
        *,
        steps: Iterable[int] | None = None,
        prefetch: int = 2,
        manifest: str | None = STEP_MANIFEST,
        unsafe: bool = False,
    ) -> None:
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 1:
            raise ConfigurationError(f"replay needs prefetch >= 1 (steps ahead), got {prefetch!r}")
        StepPattern(pattern)  # a bad pattern fails here, not at the first step
        self._run = run
        self._pattern = pattern
        self._steps = None if steps is None else list(steps)
        self._manifest = manifest
        self._unsafe = unsafe
        self._prefetch = prefetch
        self._slots: anyio.Semaphore | None = None
        self._plan: list[_Step] = []
        self._next = 0
        self._by_name: dict[str, DumpInfo] = {}
        self._group: TaskGroup | None = None

    async def _make_plan(self) -> None:
        listing = await self._run.list()
        self._by_name = {info.name: info for info in listing}
        self._plan = [
            _Step(step, dumps, manifest)
            for step, dumps, manifest in plan_steps(
                listing, self._pattern, steps=self._steps, manifest=self._manifest
            )
        ]

    async def __aenter__(self) -> Replay:
        await self._make_plan()
        self._slots = anyio.Semaphore(self._prefetch)  # made on the loop that uses it
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._group.start_soon(self._launch, self._group)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        group, self._group = self._group, None
        if group is None:
            return None
        group.cancel_scope.cancel()  # loads the consumer will never take
        # The loads raise nothing (a failure is kept for the consumer), so the group ends with
        # no error of its own; the block's exception, if any, propagates as it is (unwrapped).
        await group.__aexit__(None, None, None)
        return None

    @property
    def steps(self) -> list[int]:
        """The steps this replay yields, in order (known once entered)."""
        return [slot.step for slot in self._plan]

    def __aiter__(self) -> AsyncIterator[tuple[int, list[Any]]]:
        if self._group is not None:
            return self  # inside the block: whole steps loaded ahead
        return self._one_at_a_time()

    async def _one_at_a_time(self) -> AsyncIterator[tuple[int, list[Any]]]:
        """A bare ``async for``: each step is loaded when the consumer asks for it.

        An async generator cannot own background tasks safely (the reason the look-ahead lives
        in the ``async with`` block), so nothing here outlives a ``yield``: the step's dumps
        still load concurrently, but no step loads ahead.
        """
        await self._make_plan()
        for slot in self._plan:
            yield slot.step, await self._load_step(slot)

    async def __anext__(self) -> tuple[int, list[Any]]:
        if self._group is None or self._slots is None:
            raise TrackerStateError(
                "iterate a replay inside its block: 'async with run.replay(pattern) as steps: "
                "async for step, objects in steps: ...'"
            )
        if self._next >= len(self._plan):
            raise StopAsyncIteration
        slot = self._plan[self._next]
        self._next += 1
        await slot.done.wait()  # bounded: each read and load underneath has its own timeout
        self._slots.release()  # the consumer holds this step now: the next one may load
        objects, slot.objects, error = slot.objects, None, slot.error
        if error is not None:
            raise error
        assert objects is not None
        return slot.step, objects

    async def _launch(self, group: TaskGroup) -> None:
        assert self._slots is not None
        for slot in self._plan:
            await self._slots.acquire()
            group.start_soon(self._load, slot)

    async def _load(self, slot: _Step) -> None:
        try:
            slot.objects = await self._load_step(slot)
        except Exception as exc:  # re-raised to the consumer when it reaches this step
            slot.error = exc
        finally:
            slot.done.set()

    async def _load_step(self, slot: _Step) -> list[Any]:
        dumps = slot.dumps
        if slot.manifest is not None:
            manifest = await self._run.load(slot.manifest)
            names = manifest_dumps(manifest, slot.step, slot.manifest.name)
            missing = [n for n in names if n not in self._by_name]
            if missing:
                raise StorageNotFoundError(
                    f"{self._run.url}: step {slot.step}'s manifest names dumps the run does "
                    f"not hold: {missing[:5]}"
                )
            dumps = [self._by_name[n] for n in names]
        return await load_step(self._run, dumps, unsafe=self._unsafe)


async def load_step(run: Run, dumps: Sequence[DumpInfo], *, unsafe: bool = False) -> list[Any]:
    """Read *dumps* in one batch and load them safely in worker threads, in order.

    Raises:
        StorageNotFoundError: A dump is gone.
        UnsafeLoadError: A dump needs a global outside the allow-list (and not *unsafe*).
        DumpLoadError: A dump's bytes do not load.
    """
    if not dumps:
        return []
    datas = await run.read_many(dumps)
    for data in datas:
        if isinstance(data, Exception):
            raise data
    jobs = list(zip(dumps, datas, strict=True))
    size = math.ceil(len(jobs) / _LOAD_THREADS)
    chunks = [jobs[i : i + size] for i in range(0, len(jobs), size)]
    loaded = await gather_bounded(
        chunks,
        lambda chunk: anyio.to_thread.run_sync(_load_chunk, chunk, unsafe),
        limit=_LOAD_THREADS,
    )
    for part in loaded:  # raised here, as it is: a task group would wrap it in a group
        if isinstance(part, Exception):
            raise part
    return [obj for part in loaded if isinstance(part, list) for obj in part]


def _load_chunk(
    chunk: Sequence[tuple[DumpInfo, bytes | Exception]], unsafe: bool
) -> list[Any] | Exception:
    out = []
    for info, data in chunk:
        assert isinstance(data, bytes)
        try:
            out.append(load_dump_bytes(data, unsafe=unsafe, where=info.name))
        except Exception as exc:  # the first failure of the chunk, for load_step to raise
            return exc
    return out
