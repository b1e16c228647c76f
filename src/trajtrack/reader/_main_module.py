"""Whether a new process started with ``spawn`` may safely re-import this program's main module.

A process started with multiprocessing's ``spawn`` method imports the parent's main module
first (as ``__mp_main__``), so that what the parent defined there exists in the child. Code
under ``if __name__ == "__main__":`` does not run again; anything else at the top level of the
script does. trajtrack starts its load worker that way, and must not re-run a caller's script
(training it again, deleting what it deletes): it first checks, statically, that the main
module's top level only defines things (:func:`main_module_problem`).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

__all__ = ["main_module_problem"]

_DEFINITIONS = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
    ast.Pass,
)


def main_module_problem() -> str | None:
    """``None`` when spawning re-imports no code of the main module but definitions.

    Otherwise a sentence naming the main module and the first statement that would run again.
    A main module without a file (an interactive session, a notebook, ``python -c``) or run as
    a package's ``__main__`` (``python -m pkg``) is not re-imported by ``spawn``.
    """
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if path is None or (name is not None and (name == "__main__" or name.endswith(".__main__"))):
        return None
    try:
        tree = ast.parse(Path(path).read_bytes(), path)
    except (OSError, SyntaxError, ValueError) as exc:
        return f"its main module {path} cannot be checked ({exc})"
    for node in tree.body:
        if not _inert(node):
            return (
                f"its main module {path} runs code at import (line {node.lineno}), outside "
                "`if __name__ == '__main__':`"
            )
    return None


def _inert(node: ast.stmt) -> bool:
    if isinstance(node, _DEFINITIONS):
        return True
    if isinstance(node, ast.Expr):  # a docstring or a bare constant
        return isinstance(node.value, ast.Constant)
    if isinstance(node, ast.If):
        if _is_main_guard(node.test):
            return all(_inert(n) for n in node.orelse)
        calls = any(isinstance(n, ast.Call) for n in ast.walk(node.test))
        return not calls and all(_inert(n) for n in [*node.body, *node.orelse])
    if isinstance(node, ast.Try):  # try: import x / except ImportError: ...
        handlers = [n for handler in node.handlers for n in handler.body]
        parts = [*node.body, *handlers, *node.orelse, *node.finalbody]
        return all(_inert(n) for n in parts)
    return False


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return False
    if not isinstance(test.ops[0], ast.Eq):
        return False
    sides = [test.left, *test.comparators]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    mains = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(mains) == 1
