"""The non-finite policy of jaxcomm, in one place.

A NaN or an Inf in a gradient, a mean or an update never reaches the state: the collectives
keep a bucket's error feedback when its result is not finite, and the optimizers skip the whole
step on every device (the state is kept, the update is zero). Three pieces, used by every
layer above this one:

* :func:`probes_finite`, the one finiteness test: exact (finite values whose sum would
  overflow are finite), one fused float reduction.
* :func:`keep_if`, the one keep-or-skip: the new tree where the verdict is true, else the old.
* :class:`SkipCounters`, carried by every optimizer state: the steps skipped in a row
  (bounded by the optimizers' ``max_consecutive_skips``) and in all.

Example:
  >>> import jax.numpy as jnp, jaxcomm as jc
  >>> ok = jc.guard.probes_finite([jnp.array([1.0, 3e38, 3e38])])  # the sum overflows
  >>> bool(ok)
  True
  >>> skips = jc.SkipCounters.zeros().after(jnp.array(False)).after(jnp.array(False))
  >>> int(skips.consecutive), int(skips.after(jnp.array(True)).total)
  (2, 2)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


def probes_finite(probes: Iterable[Any]) -> jax.Array:
    """True iff every element of every array in ``probes`` is finite (bool scalar).

    Decided as ``isfinite(sum(x - x))``: ``x - x`` is 0 for a finite ``x`` and NaN for an Inf
    or a NaN, so the sum is exactly 0 or NaN (no false alarm, unlike ``sum(x)``), one fused
    float reduction. Integer arrays are finite and not read. (On XLA:CPU a boolean
    ``all(isfinite(x))`` writes a mask and reduces it in a tree, and ``x * 0`` can make XLA
    write a buffer of zeros first.)
    """
    total = jnp.zeros([], jnp.float32)
    for x in probes:
        if jnp.size(x) and jnp.issubdtype(jnp.result_type(x), jnp.inexact):
            total = total + jnp.sum(x - x, dtype=jnp.float32)
    return jnp.isfinite(total)


def keep_if(finite: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where ``finite``, else ``old``, leaf by leaf (trees of the same structure)."""
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)


class SkipCounters(NamedTuple):
    """The non-finite steps an optimizer skipped, in every jaxcomm optimizer's state
    (``state.skips``; DiLoCo counts its inner steps per device in ``state.local.skips`` and
    its outer steps in ``state.skips``).

    Attributes:
      consecutive: int32 scalar: steps skipped in a row up to now (0 after a step that was
        applied); the optimizers raise once it passes ``max_consecutive_skips``.
      total: int32 scalar: all steps skipped so far.
    """

    consecutive: jax.Array
    total: jax.Array

    @classmethod
    def zeros(cls) -> SkipCounters:
        """No step skipped yet."""
        return cls(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32))

    def after(self, ok: jax.Array) -> SkipCounters:
        """The counters after one more step, applied where ``ok`` (a bool), else skipped."""
        skipped = jnp.where(ok, 0, 1).astype(jnp.int32)
        return SkipCounters(
            jnp.where(ok, 0, self.consecutive + 1).astype(jnp.int32), self.total + skipped
        )
