"""Docstrings as ``--help`` text: shared by the command (``main``) and ``demo`` run alone."""

from __future__ import annotations

import re

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :func:`x`, :mod:`~a.b`
_LITERAL_IN_COLUMN = re.compile(r"``([^`]+)``(?=  )")  # ``x`` followed by column padding
_LITERAL = re.compile(r"``([^`]+)``|`([^`]+)`")


def terminal_text(doc: str | None) -> str:
    """A reStructuredText docstring as plain terminal text (for ``--help``).

    Roles (``:func:`x```) and literals (````x````) lose their markup, a literal that ends a
    table cell keeps the column aligned, table rules (``====``) are dropped, and a literal
    block's ``::`` becomes ``:``.
    """
    lines = []
    for line in (doc or "").strip("\n").splitlines():
        if line.strip() and set(line.strip()) <= {"=", " "}:
            continue
        line = _ROLE.sub(r"\1", line)
        line = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"\1", line)  # *emphasis*
        line = _LITERAL_IN_COLUMN.sub(lambda m: m.group(1) + "    ", line)
        line = _LITERAL.sub(lambda m: m.group(1) or m.group(2), line)
        if line.endswith("::"):
            line = line[:-1]
        lines.append(line.rstrip())
    return "\n".join(lines)
