"""The HTML shell the reports share: one page, its CSS, escaping, an atomic write.

A page is self-contained: the CSS is inline, there is no script, and its
Content-Security-Policy forbids loading anything at all (``default-src 'none'``), so a report
opens anywhere after a copy and cannot call out even if some text escaped the escaping.
"""

from __future__ import annotations

import html
import os
import re
import secrets
import stat
import string
from collections.abc import Collection
from pathlib import Path

from trajtrack._exceptions import ConfigurationError, StorageError, StorageNotFoundError

__all__ = [
    "CSS",
    "GENERATOR",
    "check_report_target",
    "escape",
    "number",
    "page",
    "report_generator",
    "visible",
    "with_generator",
    "write_atomically",
]

GENERATOR = "trajtrack"
"""What a page says wrote it (``<meta name="generator">``; the demo's: ``trajtrack demo``): a
file saying so may be replaced by the next report written to its path; any other file is the
user's and never replaced."""

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;
margin:0 auto;max-width:1180px;padding:16px 24px}
h1{font-size:22px;margin:4px 0}h2{font-size:17px;margin:24px 0 8px}
code,td.mono{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12px}
table{border-collapse:collapse;width:100%}th,td{text-align:left;padding:3px 8px;
border-bottom:1px solid #e3e3e3;vertical-align:top}th{background:#f4f4f4}
td.num{text-align:right;white-space:nowrap}
.verdict{display:inline-block;padding:2px 10px;border-radius:10px;font-weight:600}
.s-equal{color:#1e8449}.s-different{color:#c0392b}.s-only_in_a{color:#2471a3}
.s-only_in_b{color:#7d3c98}.s-error{color:#000;font-weight:700}
.verdict.ok{background:#d5f5e3;color:#1e8449}.verdict.bad{background:#fadbd8;color:#922b21}
.counts{display:flex;gap:10px;flex-wrap:wrap}.count{border:1px solid #ddd;border-radius:6px;
padding:6px 14px;font-size:15px}.count b{font-size:20px;margin-right:4px}
dl{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;margin:8px 0}
dt{color:#666}dd{margin:0;word-break:break-all}
svg.plot{width:100%;height:auto;display:block}
ul.legend{list-style:none;display:flex;flex-wrap:wrap;gap:4px 18px;padding:0;margin:4px 0 0 60px;
font-size:13px}.mark{font-weight:700}svg.histogram{max-width:780px}
.note{color:#666;font-size:13px}footer{margin-top:32px;color:#888;font-size:12px}
"""

_HEAD = '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
_GENERATOR_META = '<meta name="generator" content="{}">\n'
# The head of a report written before the generator mark, up to its title: still a report.
_LEGACY_HEAD = (
    _HEAD + '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
    "style-src 'unsafe-inline'\">\n"
    '<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>'
)
_GENERATOR_RE = re.compile(
    re.escape(_HEAD) + r'<meta name="generator" content="(trajtrack[^"<>]*)">\n'
)
_HEAD_BYTES = 4096  # read of a file to tell whether it is a report

_PAGE = string.Template("""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="generator" content="trajtrack">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>$title</title>
<style>$css</style>
</head>
<body>
<header><h1>$heading</h1>$badge</header>
$body
<footer>$footer</footer>
</body>
</html>
""")


def page(*, title: str, heading: str, badge: str, body: str, footer: str) -> str:
    """The page; *title* and *heading* are text (escaped here), the rest HTML already."""
    return _PAGE.substitute(
        title=escape(title),
        css=CSS,
        heading=escape(heading),
        badge=badge,
        body=body,
        footer=footer,
    )


def escape(text: str) -> str:
    """*text* as HTML text or attribute value (quotes escaped too), see :func:`visible`."""
    return html.escape(visible(text), quote=True)


_SURROGATE = re.compile("[\ud800-\udfff]")


def visible(text: str) -> str:
    """*text* with each lone surrogate written as a visible ``\\udcXX`` escape.

    A name read from a file system as ``os.fsdecode`` does holds a lone surrogate for each
    byte that is not UTF-8 (``\\xff`` becomes ``\\udcff``): no encoder writes it, no font
    draws it. Shown as the text output shows it (:func:`trajtrack.cli._common.printable`).
    """
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def number(value: float | None) -> str:
    """A difference or statistic, 4 significant digits; empty for ``None``."""
    return "" if value is None else escape(f"{value:.4g}")


def with_generator(text: str, generator: str) -> str:
    """The page *text* marked as written by *generator* (``"trajtrack demo"``), not the default."""
    return text.replace(_GENERATOR_META.format(GENERATOR), _GENERATOR_META.format(generator), 1)


def report_generator(head: bytes) -> str | None:
    """Who wrote the page starting with *head* (``"trajtrack"``...); ``None``: not a report."""
    text = head.decode("utf-8", "replace")
    found = _GENERATOR_RE.match(text)
    if found:
        return found.group(1)
    return GENERATOR if text.startswith(_LEGACY_HEAD) else None


def check_report_target(
    path: Path, *, replaces: Collection[str] | None = None, overwrite: bool = False
) -> None:
    """Raise unless a report can be written to *path*, before any work is done for it.

    Its folder must exist, and *path* must be absent, or a regular file (not a link) holding
    an HTML report that one of *replaces* wrote (:func:`report_generator`; ``None``: any
    trajtrack report). Anything else there is the user's: never replaced, unless *overwrite*
    (``--overwrite``): then any regular file is replaced, and a symbolic link is replaced as a
    link (the rename replaces the link itself, never writes through it); a directory or
    another special file is still refused.

    Raises:
        StorageNotFoundError: The folder does not exist.
        ConfigurationError: *path* is a folder, or (without *overwrite*) a link or a file
            that is no such report, or its folder is not a folder.
    """
    parent = path.parent
    try:
        if not stat.S_ISDIR(os.stat(parent).st_mode):
            raise ConfigurationError(f"cannot write {path}: {parent} is not a directory")
    except FileNotFoundError:
        raise StorageNotFoundError(f"cannot write {path}: no such directory {parent}") from None
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        raise ConfigurationError(f"cannot write {path}: it is a directory")
    replaceable = stat.S_ISREG(mode) or stat.S_ISLNK(mode)  # by a rename, whatever it holds
    if overwrite and replaceable:
        return  # nothing is read: a link's target is never opened
    what = _not_a_report(path, mode, replaces)
    if what is None:
        return
    # --overwrite is named where it would do: show and diff (any trajtrack report), not the
    # demo (it replaces only its own reports: *replaces*), nor for a FIFO or a device.
    advice = (
        "rerun with --overwrite to replace it, or choose another file"
        if replaceable and replaces is None
        else "remove it yourself or choose another file"
    )
    raise ConfigurationError(f"refusing to replace {path}: it exists and is {what}; {advice}")


def _not_a_report(path: Path, mode: int, replaces: Collection[str] | None) -> str | None:
    """What the entry at *path* (its ``lstat`` *mode*) is, if not a report *replaces* wrote."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if not stat.S_ISREG(mode):
        return "not a regular file"
    with open(path, "rb") as file:
        generator = report_generator(file.read(_HEAD_BYTES))
    if generator is None:
        return "not an HTML report trajtrack wrote"
    if replaces is None or generator in replaces:
        return None
    return f"a report that {generator!r} wrote, not {' or '.join(map(repr, replaces))}"


def write_atomically(
    path: Path, text: str, *, replaces: Collection[str] | None = None, overwrite: bool = False
) -> None:
    """Write *text* (UTF-8) to a new temporary file beside *path*, then rename it over *path*.

    An existing *path* is replaced only when :func:`check_report_target` allows it (an HTML
    report one of *replaces* wrote; with *overwrite*, any regular file or symbolic link: the
    link itself, not its target). A lone surrogate left in *text* is written as a visible
    ``\\udcXX`` escape, never an encoding error.

    Raises:
        StorageNotFoundError: The folder of *path* does not exist.
        ConfigurationError: *path* is no report to replace (see :func:`check_report_target`).
        StorageError: The file cannot be written (named by *path*, not the temporary file).
    """
    check_report_target(path, replaces=replaces, overwrite=overwrite)
    data = text.encode("utf-8", "backslashreplace")
    while True:  # a name of its own: never a file that happens to be there
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        except FileNotFoundError:  # the folder: name what was asked for, not the temp file
            raise StorageNotFoundError(
                f"cannot write {path}: no such directory {path.parent}"
            ) from None
        except OSError as exc:
            raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from None
        break
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(temporary, path)
    except OSError as exc:
        raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from None
    finally:
        temporary.unlink(missing_ok=True)
