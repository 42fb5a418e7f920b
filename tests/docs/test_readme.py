"""Every Python block of README.md and docs/**/*.md runs (on the 8 simulated devices).

A block runs as written in a fresh namespace. A block that cannot run here (a launch on two
hosts) says so where readers see it: the line before its fence starts with ``*Not run in the
tests:``, then the reason; few may, and they are only compiled. The names a block uses
without defining them (the user's model: ``params``, ``loss_fn``, ``batches``, ``model``;
``mesh``, ``n``) come from :func:`user_context`, a small regression model, so that fragments
showing one change to a training loop run too; a block that defines them uses its own.
"""

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomm as jc

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = "*Not run in the tests:"
MAX_NOT_RUN = 3


def python_blocks():
    for path in DOCS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            runs = not before.startswith(NOT_RUN)
            yield pytest.param(match.group(1), runs, id=f"{path.relative_to(ROOT)}:{line}")


def block_containing(path: Path, needle: str) -> str:
    return next(m.group(1) for m in BLOCK.finditer(path.read_text()) if needle in m.group(1))


def user_context(block: str) -> dict:
    """A small model and data for the names a block leaves to the user."""
    from jax.sharding import PartitionSpec as P

    n = jax.device_count()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * n, 6)).astype(np.float32)
    y = rng.standard_normal((4 * n, 2)).astype(np.float32)
    context = {
        "jax": jax,
        "jnp": jnp,
        "np": np,
        "optax": optax,
        "jc": jc,
        "P": P,
        "partial": functools.partial,
        "n": n,
        "mesh": jax.make_mesh((n,), ("dp",)),
        "params": {"w": jnp.zeros((6, 2)), "b": jnp.zeros(2)},
        "batches": [(x, y)] * 3,
        "loss_fn": lambda p, b: jnp.mean((b[0] @ p["w"] + p["b"] - b[1]) ** 2),
    }
    if "nnx." in block:
        from flax import nnx

        context["nnx"] = nnx
        context["model"] = nnx.Linear(6, 2, rngs=nnx.Rngs(0))
        context["loss_fn"] = lambda model, b: jnp.mean((model(b[0]) - b[1]) ** 2)
    return context


@pytest.mark.parametrize("block, runs", list(python_blocks()))
def test_block_runs(block, runs):
    if not runs:  # marked where readers see it; still valid Python, so no skip in CI
        compile(block, "<doc block, not run>", "exec")
        return
    namespace = user_context(block)
    exec(compile(block, "<doc block>", "exec"), namespace)  # noqa: S102
    # A block that trains leaves finite parameters behind.
    state = namespace.get("state")
    if isinstance(state, jc.TrainState):
        for leaf in jax.tree.leaves(jc.params_of(state)):
            assert np.isfinite(np.asarray(leaf)).all()


def test_docs_have_python_blocks_and_few_are_not_run():
    blocks = list(python_blocks())
    not_run = [b.id for b in blocks if not b.values[1]]
    assert len(blocks) >= 10, [b.id for b in blocks]
    assert len(not_run) <= MAX_NOT_RUN, not_run


def test_the_readme_example_trains():
    """The first example fits its least-squares problem, which a linear model can fit
    exactly: the last loss is under 1% of the first (the variance of the targets)."""
    block = block_containing(ROOT / "README.md", "jc.make_train_step")
    namespace = {}
    exec(compile(block, "<README example>", "exec"), namespace)  # noqa: S102
    first = float(np.mean(namespace["y"] ** 2))
    assert float(namespace["loss"]) < 0.01 * first, (float(namespace["loss"]), first)


def test_the_use_block_is_the_compressed_mean():
    """The README's direct-call block computes OneBit's mean: with every device holding the
    same gradients, the 1-bit mean of a constant tree is that constant (sign times its norm)."""
    block = block_containing(ROOT / "README.md", "jc.compressed_pmean(grads, state")
    namespace = user_context(block)
    exec(compile(block, "<README Use>", "exec"), namespace)  # noqa: S102
    for key, leaf in namespace["mean"].items():
        np.testing.assert_allclose(np.asarray(leaf), 1.0, rtol=1e-6, err_msg=key)
