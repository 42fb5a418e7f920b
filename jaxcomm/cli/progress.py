"""Plain progress lines for long training loops, for output that is not a terminal.

rich's progress bar draws only on a terminal; in a CI log, under ``nohup`` or through ``| tee``
it shows nothing. :class:`StepLog` prints one line when a run starts and one every ``every``
steps (and at the last): step, loss, elapsed seconds and the estimated time left.

    >>> import io
    >>> out = io.StringIO()
    >>> log = StepLog("adam", total=4, every=2, stream=out, clock=iter([0, 10, 20]).__next__)
    >>> for loss in (3.0, 2.5, 2.0, 1.5):
    ...     log.step(1, loss)
    >>> print(out.getvalue(), end="")
    adam: 4 steps
    adam: step 2/4  loss 2.5000  elapsed 10s  left ~10s
    adam: step 4/4  loss 1.5000  elapsed 20s  left ~0s
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


def is_terminal(stream: TextIO) -> bool:
    """True when ``stream`` is an interactive terminal (where rich's bar is visible)."""
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except ValueError:  # a closed stream
        return False


def default_every(total: int) -> int:
    """A line every 200 steps on long runs, about five lines a run on short ones."""
    return max(1, min(200, -(-total // 5)))


class StepLog:
    """Prints ``name: step i/total  loss ...  elapsed ...  left ~...`` every ``every`` steps.

    Args:
      name: the run's label (a method name).
      total: the steps the run will take.
      every: steps between lines (default :func:`default_every`).
      stream: where the lines go (default ``sys.stdout``); flushed after each line.
      clock: seconds since some origin (``time.perf_counter``); the first call starts the run.
    """

    def __init__(
        self,
        name: str,
        total: int,
        every: int | None = None,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.name, self.total = name, total
        self.every = every or default_every(total)
        self.stream = sys.stdout if stream is None else stream
        self.clock = clock
        self.done = 0
        self.start = clock()
        print(f"{name}: {total} steps", file=self.stream, flush=True)

    def step(self, k: int = 1, loss: Any = None) -> None:
        """Count ``k`` more steps (the last of which had ``loss``, a number or a JAX scalar,
        read only when a line is printed); print when one is due."""
        before, self.done = self.done, self.done + k
        if self.done // self.every == before // self.every and self.done != self.total:
            return
        elapsed = self.clock() - self.start
        left = elapsed / self.done * max(0, self.total - self.done)
        shown = "" if loss is None else f"  loss {float(loss):.4f}"
        print(
            f"{self.name}: step {self.done}/{self.total}{shown}  elapsed {elapsed:.0f}s"
            f"  left ~{left:.0f}s",
            file=self.stream,
            flush=True,
        )
