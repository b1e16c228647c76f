"""``trajtrack show URL NAME``: the structure of one dump, with tensor statistics."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio.to_thread
import numpy as np
import torch

from trajtrack._exceptions import DumpLoadError, TrajtrackError
from trajtrack.cli._common import (
    EXIT_OK,
    Streams,
    format_size,
    format_time,
    printable,
    write_json,
)
from trajtrack.cli._parsers import MAX_ITEMS
from trajtrack.cli._text import show_text_lines, tokenizer_of
from trajtrack.reader import (
    DumpInfo,
    Run,
    abbreviate,
    check_report_target,
    open_run,
    record_disagreement,
    render_dump_report,
    require_matplotlib,
    text_rows,
    within_budget,
    write_atomically,
)

__all__ = ["describe", "run"]

_MAX_DEPTH = 12
_ABBREVIATE = 60
_BATCH_PARTS = ("batch", "non_tensor_batch", "meta_info")


async def run(args: argparse.Namespace, streams: Streams) -> int:
    if args.html:  # fail before loading, not after (file system look-ups: off the loop)
        await anyio.to_thread.run_sync(require_matplotlib)
        # Its folder exists; the file is absent or a report trajtrack wrote, never the user's
        # (with --overwrite: any file, or a link, replaced as a link; never a directory).
        target = functools.partial(check_report_target, overwrite=args.overwrite)
        await anyio.to_thread.run_sync(target, Path(args.html))
    tokenizer = await tokenizer_of(args)  # a missing extra or file fails before loading
    async with open_run(args.url) as source:
        info = await source.info(args.name)
        obj = await _load(source, info, args.unsafe)
    tree = await anyio.to_thread.run_sync(describe, obj, args.max_items)
    texts = None
    if tokenizer is not None:
        texts = await anyio.to_thread.run_sync(
            lambda: text_rows(obj, tokenizer, keys=args.text_keys, rows=args.rows)
        )
    if args.json:
        extra = {} if texts is None else {"text": [row.to_json() for row in texts]}
        write_json(streams, {"dump": info.to_json(), "structure": tree, **extra})
    else:
        _print(streams, info, tree)
        for line in [] if texts is None else show_text_lines(texts):
            streams.line(line)
    if args.html:
        page = await anyio.to_thread.run_sync(lambda: render_dump_report(obj, info, url=args.url))
        write = functools.partial(write_atomically, overwrite=args.overwrite)
        await anyio.to_thread.run_sync(write, Path(args.html), page)
        streams.note(printable(f"trajtrack show: HTML report written to {args.html}"))
    return EXIT_OK


async def _load(source: Run, info: DumpInfo, unsafe: bool) -> Any:
    """The dump's object. If it cannot be loaded, the error first says how its stored bytes
    differ from its record, as ``diff`` says it: a dump that changed since it was written is
    the cause worth reading, not what the loader made of its bytes."""
    try:
        return await source.load(info, unsafe=unsafe)
    except (TrajtrackError, OSError) as exc:
        try:  # read again: the load gives no bytes back (a local file is loaded in place)
            stored: bytes | None = await source.read_bytes(info)
        except (TrajtrackError, OSError):  # gone, or refused: its listed size is what is known
            stored = None
        hint = await anyio.to_thread.run_sync(record_disagreement, info.name, info, stored)
        if hint is None:
            raise
        raise DumpLoadError(f"{hint}; {exc}") from exc


def _print(streams: Streams, info: DumpInfo, tree: dict[str, Any]) -> None:
    checksum = info.checksum or "unrecorded"
    streams.line(
        printable(
            f"{info.name}  ({info.path}, {format_size(info.size)}, {checksum}, "
            f"writer {info.writer or '-'}, {format_time(info.time)})"
        )
    )
    for line in render(tree):
        streams.line(printable(line))


def describe(obj: Any, max_items: int = MAX_ITEMS, depth: int = 0) -> dict[str, Any]:
    """A JSON-serializable description of *obj*: type, and children or statistics.

    Bounded whatever the object: a node reached again through a shared reference is described
    once (later: ``"same_as"`` its first key path), at most :data:`_MAX_NODES` nodes and
    :data:`_MAX_DEPTH` levels are described, values are abbreviated by a bounded repr, and a
    tensor's statistics are computed only within the element budget.
    """
    return _Describer(max_items).node(obj, depth, "")


_MAX_NODES = 5_000  # nodes described at most: a DAG or a wide tree is cut, not walked out


class _Describer:
    def __init__(self, max_items: int) -> None:
        self.max_items = max_items
        self.seen: dict[int, tuple[str, Any]] = {}  # id -> (first path, the object: kept alive)
        self.nodes = 0

    def node(self, obj: Any, depth: int, path: str) -> dict[str, Any]:
        self.nodes += 1
        node: dict[str, Any] = {"type": type(obj).__name__}
        if isinstance(obj, torch.Tensor):
            node.update(_tensor_summary(obj))
        elif isinstance(obj, np.ndarray):
            node.update(_array_summary(obj))
        elif isinstance(obj, (str, bytes, int, float, complex, bool, type(None))):
            node["value"] = _abbrev(obj)
        elif id(obj) in self.seen:
            node["same_as"] = self.seen[id(obj)][0] or "<root>"
        elif depth >= _MAX_DEPTH or self.nodes > _MAX_NODES:
            node["value"] = _abbrev(obj)
        else:
            self.seen[id(obj)] = (path, obj)
            self._container(obj, node, depth, path)
        return node

    def _container(self, obj: Any, node: dict[str, Any], depth: int, path: str) -> None:
        max_items = self.max_items
        if isinstance(obj, Mapping):
            items: Any = ((f"[{k!r}]", v) for k, v in obj.items())
            self._children(node, items, len(obj), max_items, depth, path)
        elif isinstance(obj, (list, tuple)):
            items = ((f"[{i}]", v) for i, v in enumerate(obj))
            self._children(node, items, len(obj), max_items, depth, path)
            node["length"] = len(obj)
        elif all(hasattr(obj, n) for n in _BATCH_PARTS):  # RolloutBatch, verl's DataProto
            items = ((f".{n}", getattr(obj, n)) for n in _BATCH_PARTS)
            self._children(node, items, 3, 3, depth, path)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            fields = dataclasses.fields(obj)
            items = ((f".{f.name}", getattr(obj, f.name)) for f in fields)
            self._children(node, items, len(fields), len(fields), depth, path)
        else:
            node["value"] = _abbrev(obj)

    def _children(
        self, node: dict[str, Any], items: Any, count: int, limit: int, depth: int, path: str
    ) -> None:
        children = []
        for i, (key, value) in enumerate(items):
            if i >= limit:
                break
            children.append({"key": key, **self.node(value, depth + 1, path + key)})
        node["children"], node["more"] = children, max(0, count - len(children))


def _tensor_summary(t: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "device": str(t.device),
    }
    if t.layout != torch.strided or t.numel() == 0:
        return out
    if not within_budget(t):  # an expanded view of a small storage: not materialized
        out["note"] = f"statistics not computed: {t.numel()} elements over a smaller storage"
        return out
    data = t.detach()
    if data.dtype == torch.bool:
        out["true"] = int(data.sum())
        return out
    if data.is_complex():
        out["nan"] = int(torch.isnan(data).sum())
        return out
    values = data.to(torch.float64)
    if data.is_floating_point():
        nan = torch.isnan(values)
        inf = torch.isinf(values)
        out["nan"] = int(nan.sum())
        out["inf"] = int(inf.sum())
        values = values[~(nan | inf)]
    if values.numel():
        out["min"] = float(values.min())
        out["max"] = float(values.max())
        out["mean"] = float(values.mean())
    return out


def _array_summary(a: np.ndarray[Any, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"dtype": str(a.dtype), "shape": list(a.shape)}
    if a.dtype.kind in "biuf" and a.size:
        stats = _tensor_summary(torch.from_numpy(np.array(a, dtype=np.float64, copy=True)))
        if a.dtype.kind != "f":
            stats.pop("nan", None)
            stats.pop("inf", None)
        out.update({k: v for k, v in stats.items() if k not in ("dtype", "shape", "device")})
    elif a.size:
        out["values"] = _abbrev(a.reshape(-1)[:8].tolist()) + (" ..." if a.size > 8 else "")
    return out


def _abbrev(value: Any) -> str:
    return abbreviate(value, _ABBREVIATE)  # bounded: a DAG or a deep list has no plain repr


def render(node: dict[str, Any], indent: int = 0, key: str = "") -> list[str]:
    """The human form of :func:`describe`'s output, one line per node."""
    pad = "  " * indent
    head = f"{pad}{key}: " if key else pad
    lines = [head + _summary_line(node)]
    for child in node.get("children", []):
        lines.extend(render(child, indent + 1, child["key"]))
    if node.get("more"):
        lines.append(f"{pad}  ... {node['more']} more")
    return lines


def _summary_line(node: dict[str, Any]) -> str:
    kind = node["type"]
    if "shape" in node:
        parts = [kind, node["dtype"], str(node["shape"])]
        if "device" in node:
            parts.append(node["device"])
        for stat in ("min", "max", "mean"):
            if stat in node:
                parts.append(f"{stat}={_number(node[stat])}")
        for count in ("nan", "inf", "true"):
            if count in node:
                parts.append(f"{count}={node[count]}")
        if "values" in node:
            parts.append(node["values"])
        if "note" in node:
            parts.append(f"({node['note']})")
        return " ".join(parts)
    if "same_as" in node:
        return f"{kind} (the same object as {node['same_as']})"
    if "children" in node:
        size = node.get("length", len(node["children"]) + node.get("more", 0))
        return f"{kind} ({size} {'item' if size == 1 else 'items'})"
    return f"{kind} {node.get('value', '')}".rstrip()


def _number(value: float) -> str:
    if math.isfinite(value) and value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.6g}"
