"""A small real text corpus available offline: Python's bundled ``pydoc_data`` topics.

Used by the examples, ``benchmarks/diloco_convergence.py`` and ``benchmarks/onebit_lamb.py``
(``jaxcomm demo`` and ``benchmarks/convergence.py`` use the unfiltered byte corpus of
:mod:`jaxcomm.cli.models`): a character-level language model on about 465k characters of
Python documentation, with a held-out split, and nothing to download.

The vocabulary is the characters that occur at least ``min_count`` times in the training split,
plus id 0 for all others. Every embedding row then receives gradients regularly: a row that
never does (an unused character) has zero Adam variance, and sign-compressed momentum puts
``+-scale`` there, which 1-bit optimizers turn into ``scale / eps`` (DeepSpeed's 1-bit Adam
asks users for a momentum mask in that case).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

UNKNOWN = "\0"


def load_corpus() -> str:
    """The text of every ``pydoc_data`` topic, in sorted topic order (deterministic)."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def build_vocab(text: str, min_count: int = 20) -> str:
    """``UNKNOWN`` then the characters of ``text`` seen at least ``min_count`` times, sorted."""
    counts = Counter(text)
    frequent = (c for c, k in counts.items() if k >= min_count and c != UNKNOWN)
    return UNKNOWN + "".join(sorted(frequent))


def encode(text: str, vocab: str) -> np.ndarray:
    """Character ids (int32) in ``vocab``; characters not in it become 0."""
    ids = {c: i for i, c in enumerate(vocab)}
    return np.fromiter((ids.get(c, 0) for c in text), dtype=np.int32, count=len(text))


@dataclass(frozen=True)
class CharBatches:
    """Next-character prediction windows drawn from a train/held-out split.

    Attributes:
      context: characters seen before the one to predict.
      vocab: the characters of each id (id 0: any other character).
      train: encoded training text (the first ``1 - holdout`` of the corpus).
      test: encoded held-out text (the rest).
    """

    context: int
    vocab: str
    train: np.ndarray
    test: np.ndarray

    @classmethod
    def from_corpus(
        cls, context: int = 32, holdout: float = 0.1, min_count: int = 20
    ) -> CharBatches:
        text = load_corpus()
        cut = int(len(text) * (1 - holdout))
        vocab = build_vocab(text[:cut], min_count)
        ids = encode(text, vocab)
        return cls(context=context, vocab=vocab, train=ids[:cut], test=ids[cut:])

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

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
