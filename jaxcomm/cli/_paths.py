"""Checks of the tools' output paths, made before any work (a run must not fail at its end)."""

from __future__ import annotations

import os
import tempfile


def output_problem(path: str | os.PathLike[str] | None, *, directory: bool = False) -> str | None:
    """Why ``path`` cannot be written, or ``None`` if it can (``None`` paths are fine).

    ``directory=True``: ``path`` is a directory the tool will create (``os.makedirs``) and
    write into; otherwise a file whose directory must exist (or be creatable) and be writable.
    The check writes and removes a probe file: permission bits alone miss read-only mounts and
    root-owned directories seen by root (which may write anywhere but a read-only mount).
    """
    if path is None or str(path) in ("", "-"):
        return None
    path = os.path.abspath(os.fspath(path))
    if directory:
        target = path
        if os.path.exists(target) and not os.path.isdir(target):
            return f"{path!r} exists and is not a directory"
    else:
        if os.path.isdir(path):
            return f"{path!r} is a directory, expected a file name"
        target = os.path.dirname(os.path.abspath(path))
    existing = target
    while not os.path.exists(existing):  # the first ancestor that exists must be writable
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        return f"cannot create {target!r}: {existing!r} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".jaxcomm-write-check-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"cannot write to {existing!r} (for {path!r}): {e.strerror or e}"
    return None
