"""Token ids read as text: a dump's prompts and responses, and where two runs' tokens part.

The tokenizer is a ``tokenizer.json`` (or a model directory holding one) loaded with Hugging
Face's ``tokenizers`` (the ``text`` extra); nothing is downloaded. Token-id tensors are found by
verl's names (``input_ids``, ``prompts``, ``responses``, plus any the caller names) wherever
:func:`~trajtrack.reader.compare` would reach them (a ``DataProto``'s or ``RolloutBatch``'s
``.batch``, a ``RolloutSample``'s ``.full_batch``, a dict), and decoded row by row with verl's
masks: a prompt is left-padded, a response right-padded, and the padding is what lies before
the mask's first 1 and after its last 1. A response's mask is the attention mask's response
part when there is one, else ``response_mask``: in multi-turn rollouts ``response_mask`` is 0
over tool outputs, which are still text the model saw.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trajtrack._exceptions import ConfigurationError, MissingDependencyError, StorageNotFoundError
from trajtrack.reader._tensor_path import find_at_path, numeric_leaves

__all__ = [
    "TOKEN_KEYS",
    "TextRow",
    "TokenBatch",
    "TokenDifference",
    "load_tokenizer",
    "parse_rows",
    "text_differences",
    "text_rows",
    "token_batches",
    "token_keys",
]

TOKEN_KEYS = ("input_ids", "prompts", "responses")
_MASKS = ("attention_mask", "response_mask")
_CONTEXT = 8  # tokens shown either side of the first differing one


def token_keys(keys: Sequence[str] = ()) -> tuple[str, ...]:
    """verl's token-id keys and *keys*, each once."""
    return tuple(dict.fromkeys((*TOKEN_KEYS, *keys)))


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` or a directory holding one.

    Blocking (reads the file): call it in a worker thread from async code.

    Raises:
        MissingDependencyError: ``tokenizers`` is not installed.
        StorageNotFoundError: No ``tokenizer.json`` at *path*.
        ConfigurationError: The file is not a tokenizer ``tokenizers`` can load.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise MissingDependencyError(
            "reading token ids as text needs the 'tokenizers' package: "
            "pip install 'trajtrack[text]'"
        ) from None
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise StorageNotFoundError(f"{os.fspath(path)}: no tokenizer.json there")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust loader raises plain Exceptions
        line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigurationError(f"{file}: not a tokenizer file ({line})") from None


def parse_rows(spec: str) -> list[int]:
    """Row numbers from ``"0-3,7"`` (ranges inclusive), in the order given, each once.

    Raises:
        ConfigurationError: Not such a list of non-negative numbers and ranges.
    """
    rows: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ConfigurationError(f"rows {spec!r}: use numbers and ranges, e.g. '0-3,7'")
        stop = int(last) if last else int(first)
        rows.extend(r for r in range(int(first), stop + 1) if r not in rows)
    return rows


@dataclasses.dataclass(frozen=True)
class TokenBatch:
    """The token-id tensors and masks found together in one container of a dump.

    Attributes:
        path: The container, named as ``compare`` names paths (``".full_batch.batch"``).
        tensors: Its 2-D integer tensors by key (token ids and masks).
        uids: Each row's ``uid`` from the batch's ``non_tensor_batch``, if it has them.
    """

    path: str
    tensors: dict[str, torch.Tensor]
    uids: list[str] | None

    @property
    def rows(self) -> int:
        """The number of rows (the first dimension)."""
        return next(iter(self.tensors.values())).shape[0]

    def tokens(self, key: str, row: int) -> list[int]:
        """Row *row* of token tensor *key* without its padding."""
        ids = self.tensors[key][row]
        mask = self._mask(key, ids.shape[0])
        if mask is None:
            return [int(t) for t in ids.tolist()]
        ones = torch.nonzero(mask[row]).flatten().tolist()
        if not ones:
            return []
        return [int(t) for t in ids[ones[0] : ones[-1] + 1].tolist()]

    def _mask(self, key: str, width: int) -> torch.Tensor | None:
        attention = self.tensors.get("attention_mask")
        if key == "prompts" and attention is not None and attention.shape[1] >= width:
            return attention[:, :width]  # verl: attention_mask = cat(prompt's, response's)
        if key == "responses":
            if attention is not None and attention.shape[1] >= width:
                return attention[:, attention.shape[1] - width :]
            return self.tensors.get("response_mask")
        for name in _MASKS:
            mask = self.tensors.get(name)
            if mask is not None and mask.shape[1] == width:
                return mask
        return None


def token_batches(obj: Any, keys: Sequence[str] = ()) -> list[TokenBatch]:
    """The containers in *obj* that hold token-id tensors (verl's names, plus *keys*)."""
    wanted = {*TOKEN_KEYS, *keys}
    found: dict[str, dict[str, torch.Tensor]] = {}
    for path, value in numeric_leaves(obj):
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.is_floating_point():
            continue
        for key in (*wanted, *_MASKS):
            suffix = f"[{key!r}]"
            if path.endswith(suffix):
                found.setdefault(path[: -len(suffix)], {})[key] = value.detach().cpu()
    batches = []
    for path, tensors in found.items():
        if wanted & tensors.keys():
            batches.append(TokenBatch(path, tensors, _uids(obj, path, tensors)))
    return batches


def _uids(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> list[str] | None:
    if not path.endswith(".batch"):
        return None
    uids = find_at_path(obj, path[: -len(".batch")] + ".non_tensor_batch['uid']")
    rows = next(iter(tensors.values())).shape[0]
    if isinstance(uids, np.ndarray | list | tuple) and len(uids) == rows:
        return [str(u) for u in uids]
    return None


def _shown_keys(batch: TokenBatch, keys: Sequence[str]) -> list[str]:
    """The token keys of *batch* to read: with ``prompts`` and ``responses`` there,
    ``input_ids`` (their concatenation) says nothing more, unless asked for by name."""
    shown = [k for k in token_keys(keys) if k in batch.tensors]
    if {"prompts", "responses"} <= set(shown) and "input_ids" not in keys:
        shown = [k for k in shown if k != "input_ids"]
    return shown


@dataclasses.dataclass(frozen=True)
class TextRow:
    """One row of a token batch as text: ``texts`` maps each token key to its decoded row."""

    path: str
    row: int
    uid: str | None
    texts: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable form."""
        return dataclasses.asdict(self)


def text_rows(
    obj: Any,
    tokenizer: Any,
    *,
    keys: Sequence[str] = (),
    rows: Sequence[int] | None = None,
    max_rows: int = 8,
) -> list[TextRow]:
    """Each token batch's rows as text (*rows*, or the first *max_rows*)."""
    out = []
    for batch in token_batches(obj, keys):
        shown = _shown_keys(batch, keys)
        if rows is None:
            picked: Sequence[int] = range(min(batch.rows, max_rows))
        else:
            picked = [r for r in rows if r < batch.rows]
        for row in picked:
            texts = {k: tokenizer.decode(batch.tokens(k, row)) for k in shown}
            uid = batch.uids[row] if batch.uids else None
            out.append(TextRow(batch.path, row, uid, texts))
    return out


@dataclasses.dataclass(frozen=True)
class TokenDifference:
    """Where one row of a token tensor first differs between two dumps.

    Attributes:
        path: The tensor, named as ``compare`` names it.
        row: The row.
        uid: The row's uid (from A), if the batch has uids.
        position: The first differing token's index among the row's unpadded tokens.
        tokens: Each side's token id there (``None`` past the end of a shorter row).
        pieces: Each side's token as the vocabulary spells it (``"Ġ3"``).
        contexts: Each side's text around it: ``(before, token, after)``.
        rows_differing: How many rows of this tensor differ.
    """

    path: str
    row: int
    uid: str | None
    position: int
    tokens: tuple[int | None, int | None]
    pieces: tuple[str | None, str | None]
    contexts: tuple[tuple[str, str, str], tuple[str, str, str]]
    rows_differing: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-serializable form."""
        return dataclasses.asdict(self)


def text_differences(
    obj_a: Any, obj_b: Any, tokenizer: Any, *, keys: Sequence[str] = (), max_rows: int = 5
) -> list[TokenDifference]:
    """For each token tensor of *obj_a* and *obj_b* that differs, its first *max_rows*
    differing rows: the first differing token, both tokens, both texts around it."""
    batches_b = {batch.path: batch for batch in token_batches(obj_b, keys)}
    out: list[TokenDifference] = []
    for batch_a in token_batches(obj_a, keys):
        batch_b = batches_b.get(batch_a.path)
        if batch_b is None:
            continue
        for key in _shown_keys(batch_a, keys):
            if key in batch_b.tensors:
                out.extend(_tensor_differences(batch_a, batch_b, key, tokenizer, max_rows))
    return out


def _tensor_differences(
    a: TokenBatch, b: TokenBatch, key: str, tokenizer: Any, max_rows: int
) -> Iterator[TokenDifference]:
    parted = []
    for row in range(min(a.rows, b.rows)):
        ta, tb = a.tokens(key, row), b.tokens(key, row)
        if ta != tb:
            position = next(
                (i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None
            )
            parted.append((row, min(len(ta), len(tb)) if position is None else position, ta, tb))
    for row, position, ta, tb in parted[:max_rows]:
        token_a = ta[position] if position < len(ta) else None
        token_b = tb[position] if position < len(tb) else None
        yield TokenDifference(
            path=f"{a.path}[{key!r}]",
            row=row,
            uid=a.uids[row] if a.uids else None,
            position=position,
            tokens=(token_a, token_b),
            pieces=(_piece(tokenizer, token_a), _piece(tokenizer, token_b)),
            contexts=(_context(tokenizer, ta, position), _context(tokenizer, tb, position)),
            rows_differing=len(parted),
        )


def _piece(tokenizer: Any, token: int | None) -> str | None:
    if token is None:
        return None
    piece = tokenizer.id_to_token(token)
    return None if piece is None else str(piece)


def _context(tokenizer: Any, ids: list[int], at: int) -> tuple[str, str, str]:
    """``(before, token, after)`` around ``ids[at]``, each decoded as part of the whole, so a
    decoder that joins words with spaces or merges byte pieces spells them as in the text."""
    lo, hi = max(0, at - _CONTEXT), min(len(ids), at + 1 + _CONTEXT)
    before = tokenizer.decode(ids[lo:at])
    upto = tokenizer.decode(ids[lo : min(at + 1, len(ids))])
    whole = tokenizer.decode(ids[lo:hi])
    token = upto[len(before) :] if upto.startswith(before) else tokenizer.decode(ids[at : at + 1])
    after = whole[len(upto) :] if whole.startswith(upto) else tokenizer.decode(ids[at + 1 : hi])
    lead = token[: len(token) - len(token.lstrip())]
    return (
        ("…" if lo > 0 else "") + before + lead,
        token.lstrip(),
        after + ("…" if hi < len(ids) else ""),
    )
