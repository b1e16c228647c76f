"""``--tokenizer`` for ``show`` and ``diff``: token ids printed as the text they spell.

Text from a dump is untrusted: it is printed with ``repr``-style escaping (a control character
or a terminal escape sequence shows as ``\\x1b``, never acts on the terminal).
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from typing import Any

import anyio.to_thread

from trajtrack._exceptions import TrajtrackError
from trajtrack.reader import (
    DumpComparison,
    Run,
    RunDiff,
    TextRow,
    TokenDifference,
    load_tokenizer,
    text_differences,
    token_keys,
)

__all__ = [
    "diff_text",
    "diff_text_lines",
    "show_text_lines",
    "tokenizer_of",
]


async def tokenizer_of(args: argparse.Namespace) -> Any:
    """The ``--tokenizer`` loaded (in a worker thread: it reads a file), or ``None``."""
    if not args.tokenizer:
        return None
    return await anyio.to_thread.run_sync(load_tokenizer, args.tokenizer)


def _quote(text: str | None) -> str:
    return "-" if text is None else repr(text)


def show_text_lines(rows: Sequence[TextRow]) -> list[str]:
    """``show``'s text section: each row's id, then each of its texts."""
    if not rows:
        return ["text: no token-id tensors (input_ids, prompts, responses; or --text-keys)"]
    lines = ["text:"]
    for row in rows:
        uid = f" (uid {row.uid})" if row.uid is not None else ""
        lines.append(f"  {row.path or '<root>'} row {row.row}{uid}")
        for key, text in row.texts.items():
            lines.append(f"    {_LABELS.get(key, key)}: {_quote(text)}")
    return lines


_LABELS = {"prompts": "prompt", "responses": "response", "input_ids": "text"}


async def diff_text(
    result: RunDiff,
    run_a: Run,
    run_b: Run,
    tokenizer: Any,
    *,
    keys: Sequence[str] = (),
    unsafe: bool = False,
    max_dumps: int = 20,
    max_rows: int = 5,
) -> list[tuple[str, list[TokenDifference]]]:
    """For each differing dump whose differences touch a token-id tensor (at most
    *max_dumps*), the first differing token of its differing rows, both runs reloaded.

    A dump that cannot be reloaded is left out (the diff already reported it).
    """
    names = set(token_keys(keys))
    out: list[tuple[str, list[TokenDifference]]] = []
    for comparison in result.comparisons:
        if len(out) >= max_dumps:
            break
        if not _touches_tokens(comparison, names):
            continue
        try:
            obj_a = await run_a.load(comparison.name, unsafe=unsafe)
            obj_b = await run_b.load(comparison.name, unsafe=unsafe)
        except (TrajtrackError, OSError):
            continue
        found = await anyio.to_thread.run_sync(
            functools.partial(
                text_differences, obj_a, obj_b, tokenizer, keys=keys, max_rows=max_rows
            )
        )
        if found:
            out.append((comparison.name, found))
    return out


def _touches_tokens(comparison: DumpComparison, names: set[str]) -> bool:
    if comparison.status != "different":
        return False
    return any(f"[{n!r}]" in d.path for d in comparison.differences for n in names)


def diff_text_lines(found: Sequence[tuple[str, Sequence[TokenDifference]]]) -> list[str]:
    """``diff``'s text section: per differing row, the first differing token, both texts."""
    if not found:
        return []
    lines = ["", "token text of the differing rows:"]
    for name, differences in found:
        for d in differences:
            uid = f" (uid {d.uid})" if d.uid is not None else ""
            lines.append(
                f"{name} {d.path} row {d.row}{uid}: first differing token #{d.position} "
                f"({d.rows_differing} rows differ): A={_token(d, 0)}  B={_token(d, 1)}"
            )
            for side, (before, token, after) in zip("AB", d.contexts, strict=True):
                lines.append(f"    {side}: {_quote(before + '«' + token + '»' + after)}")
    return lines


def _token(d: TokenDifference, side: int) -> str:
    token = d.tokens[side]
    return "(end)" if token is None else f"{token} {_quote(d.pieces[side])}"
