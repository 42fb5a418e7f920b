"""A small byte-level transformer LM and an offline byte corpus: the convergence test task.

The model has what breaks naive 1-bit optimizers on real models: the full 256-byte
vocabulary, unfiltered, so the embedding rows of bytes that never (or rarely) occur get no
gradient; and attention with a bias on the fused ``qkv`` projection, whose key part has an exactly
zero gradient (a constant added to every score of a query does not change its softmax). Both
have a (near) zero Adam variance when 1-bit Adam freezes it.

Plain JAX (a parameter dict and a pure ``apply``), so the tests need no Flax: token + position
embeddings, ``layers`` pre-LayerNorm blocks (fused ``qkv`` with bias, ``heads`` heads, causal
softmax attention, a GELU MLP of width ``4 * width``), a final LayerNorm and an untied output
layer. Trained as a causal LM: every position predicts the next byte.

The corpus is the source text of a fixed list of Python standard-library modules (read from the
running interpreter, nothing to download), as bytes.
"""

from __future__ import annotations

import math
import os
import sysconfig
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Standard-library modules whose source is the corpus (about 0.6 MB of Python on 3.11).
CORPUS_MODULES = (
    "argparse.py",
    "dataclasses.py",
    "enum.py",
    "fractions.py",
    "functools.py",
    "inspect.py",
    "pathlib.py",
    "statistics.py",
    "textwrap.py",
    "typing.py",
)


def byte_corpus(modules: tuple[str, ...] = CORPUS_MODULES) -> np.ndarray:
    """The UTF-8 bytes of ``modules`` (paths in the stdlib directory), joined, as uint8."""
    root = sysconfig.get_paths()["stdlib"]
    chunks = []
    for name in modules:
        with open(os.path.join(root, name), "rb") as f:
            chunks.append(f.read())
    return np.frombuffer(b"\n".join(chunks), dtype=np.uint8)


@dataclass(frozen=True)
class ByteBatches:
    """Causal-LM windows of ``context`` bytes from a train/held-out split of a byte stream.

    ``sample`` and ``held_out`` give ``(inputs, targets)``, both int32 ``(..., context)``:
    ``targets`` is ``inputs`` shifted by one byte. The vocabulary is all 256 byte values.
    """

    context: int
    train: np.ndarray
    test: np.ndarray

    vocab_size = 256

    @classmethod
    def from_corpus(cls, context: int = 32, holdout: float = 0.1) -> ByteBatches:
        ids = byte_corpus().astype(np.int32)
        cut = int(len(ids) * (1 - holdout))
        return cls(context=context, train=ids[:cut], test=ids[cut:])

    def _windows(self, ids: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        offsets = np.arange(self.context)
        inputs = ids[starts[:, None] + offsets]
        return inputs, ids[starts[:, None] + offsets + 1]

    def sample(self, rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
        """Random training windows: inputs and targets ``(*shape, context)``."""
        count = int(np.prod(shape))
        starts = rng.integers(0, len(self.train) - self.context - 1, size=count)
        inputs, targets = self._windows(self.train, starts)
        return inputs.reshape(*shape, self.context), targets.reshape(*shape, self.context)

    def held_out(self, count: int = 512) -> tuple[np.ndarray, np.ndarray]:
        """Fixed, evenly spaced held-out windows (the same for every run)."""
        starts = np.linspace(0, len(self.test) - self.context - 1, count).astype(np.int64)
        return self._windows(self.test, starts)


@dataclass(frozen=True)
class ByteTransformer:
    """Sizes of the LM; ``init(seed)`` gives the parameters, ``apply(params, ids)`` the logits.

    The defaults have 135,168 parameters: 16,384 of them in the token
    embedding, 192 in each block's ``qkv`` bias (64 of those the key part).
    """

    vocab: int = 256
    context: int = 32
    width: int = 64
    heads: int = 4
    layers: int = 2

    def init(self, seed: int = 0, dtype: Any = np.float32) -> dict:
        """Parameters as a nested dict of NumPy arrays (GPT-2-like init: N(0, 0.02))."""
        rng = np.random.default_rng(seed)
        d, v = self.width, self.vocab

        def normal(*shape, std=0.02):
            return (std * rng.standard_normal(shape)).astype(dtype)

        def zeros(*shape):
            return np.zeros(shape, dtype)

        def ones(*shape):
            return np.ones(shape, dtype)

        params = {
            "embed": normal(v, d),
            "pos": normal(self.context, d),
            "final_ln": {"scale": ones(d), "bias": zeros(d)},
            "head": {"w": normal(d, v), "b": zeros(v)},
        }
        proj_std = 0.02 / math.sqrt(2 * self.layers)
        for i in range(self.layers):
            params[f"block{i}"] = {
                "ln1": {"scale": ones(d), "bias": zeros(d)},
                "qkv": {"w": normal(d, 3 * d), "b": zeros(3 * d)},
                "proj": {"w": normal(d, d, std=proj_std), "b": zeros(d)},
                "ln2": {"scale": ones(d), "bias": zeros(d)},
                "fc": {"w": normal(d, 4 * d), "b": zeros(4 * d)},
                "out": {"w": normal(4 * d, d, std=proj_std), "b": zeros(d)},
            }
        return params

    def apply(self, params: dict, ids):
        """Logits ``(..., T, vocab)`` (fp32) for int ids ``(..., T)``, ``T <= context``."""
        import jax
        import jax.numpy as jnp

        t = ids.shape[-1]
        h = params["embed"][ids] + params["pos"][:t]
        h = h.astype(jnp.float32)
        causal = jnp.tril(jnp.ones((t, t), bool))
        for i in range(self.layers):
            block = params[f"block{i}"]
            h = h + self._attention(block, _layer_norm(block["ln1"], h), causal)
            x = _layer_norm(block["ln2"], h)
            x = jax.nn.gelu(_dense(block["fc"], x))
            h = h + _dense(block["out"], x)
        return _dense(params["head"], _layer_norm(params["final_ln"], h))

    def _attention(self, block, x, causal):
        import jax
        import jax.numpy as jnp

        *batch, t, d = x.shape
        hd = d // self.heads
        qkv = _dense(block["qkv"], x).reshape(*batch, t, 3, self.heads, hd)
        q, k, v = (qkv[..., j, :, :] for j in range(3))
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k) / math.sqrt(hd)
        scores = jnp.where(causal, scores, -1e30)
        out = jnp.einsum("...hqk,...khd->...qhd", jax.nn.softmax(scores, axis=-1), v)
        return _dense(block["proj"], out.reshape(*batch, t, d))

    def loss(self, params: dict, batch) -> Any:
        """Mean next-byte cross-entropy of ``batch = (inputs, targets)``."""
        import optax

        inputs, targets = batch
        logits = self.apply(params, inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def _dense(p, x):
    w = p["w"].astype(x.dtype)
    return x @ w + p["b"].astype(x.dtype)


def _layer_norm(p, x, eps: float = 1e-5):
    import jax.numpy as jnp

    mean = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), -1, keepdims=True)
    y = (x - mean) / jnp.sqrt(var + eps)
    return y * p["scale"].astype(x.dtype) + p["bias"].astype(x.dtype)
