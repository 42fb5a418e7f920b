"""A small real text corpus available offline: Python's bundled ``pydoc_data`` topics.

Used by the demo, the examples and the convergence benchmark: a character-level language model
on about 465k characters of Python documentation, with a held-out split, and nothing to
download. Characters outside printable ASCII map to one "unknown" id.
"""

from __future__ import annotations

import string
from dataclasses import dataclass

import numpy as np

#: Printable ASCII plus the unknown id 0.
VOCAB = "\0" + string.printable
VOCAB_SIZE = len(VOCAB)
_CHAR_TO_ID = {c: i for i, c in enumerate(VOCAB)}


def load_corpus() -> str:
    """The text of every ``pydoc_data`` topic, in sorted topic order (deterministic)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def encode(text: str) -> np.ndarray:
    """Character ids (int32); unknown characters become 0."""
    return np.fromiter((_CHAR_TO_ID.get(c, 0) for c in text), dtype=np.int32, count=len(text))


@dataclass(frozen=True)
class CharBatches:
    """Next-character prediction windows drawn from a train/held-out split.

    Attributes:
      context: characters seen before the one to predict.
      train: encoded training text (the first ``1 - holdout`` of the corpus).
      test: encoded held-out text (the rest).
    """

    context: int
    train: np.ndarray
    test: np.ndarray

    @classmethod
    def from_corpus(cls, context: int = 32, holdout: float = 0.1) -> CharBatches:
        ids = encode(load_corpus())
        cut = int(len(ids) * (1 - holdout))
        return cls(context=context, train=ids[:cut], test=ids[cut:])

    def _windows(self, ids: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.arange(self.context)
        inputs = ids[starts[:, None] + offsets]
        targets = ids[starts + self.context]
        return inputs, targets

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """Random training windows: inputs ``(*shape, context)``, targets ``shape``."""
        count = int(np.prod(shape))
        starts = rng.integers(0, len(self.train) - self.context - 1, size=count)
        inputs, targets = self._windows(self.train, starts)
        return inputs.reshape(*shape, self.context), targets.reshape(shape)

    def held_out(self, count: int = 4096) -> tuple[np.ndarray, np.ndarray]:
        """Fixed, evenly spaced held-out windows (the same for every run)."""
        starts = np.linspace(0, len(self.test) - self.context - 1, count).astype(np.int64)
        return self._windows(self.test, starts)
