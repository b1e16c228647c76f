"""Drive a writer process directly (from a thread): one batch, its answers collected."""

from __future__ import annotations

from collections.abc import Sequence

from trajtrack.backends._staging import Block
from trajtrack.backends._writer_process import WriterProcess


def write_batch(
    writer: WriterProcess, directory: int, items: Sequence[tuple[str, str, memoryview | Block]]
) -> list[tuple[int, object]]:
    """Write *items* (``(temporary name, final name, data)``) in *directory*, overwriting, no
    fsync, mode 0o644; the ``(index, outcome)`` answers in the order they came."""
    answers: list[tuple[int, object]] = []
    writer.write(
        directory,
        items,
        overwrite=True,
        fsync=False,
        mode=0o644,
        report=lambda index, outcome: answers.append((index, outcome)),
    )
    return answers
