"""DeMo: decoupled momentum, its fast DCT components all-gathered, a sign update.

Peng, Quesnelle and Kingma, 2024, "DeMo: Decoupled Momentum Optimization" (arXiv:2411.19870),
following the reference code (bloc97/DeMo ``demo.py``): the momentum stays on each device; only
the largest DCT coefficients of its chunks are sent, and what was sent leaves the momentum.
Two pieces, like :mod:`jaxcomm.optim.onebit_adam`:

* :func:`scale_by_demo`: the direction ``sign(U)`` (the momentum, the messages, their
  exchange; its steps are named functions of :mod:`jaxcomm.optim._demo_step`); it takes the
  learning rate, which weighs the gradients in the momentum;
* :func:`demo`: ``-lr sign(U)`` and the decoupled weight decay, in the parameters' dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm.comm.axes import AxisName, canonical_axis, split_levels
from jaxcomm.comm.state import per_device
from jaxcomm.compressors.chunks import offset_bytes
from jaxcomm.guard import SkipCounters, keep_if
from jaxcomm.optim._common import (
    PyTree,
    cast_like,
    check_static_range,
    f32,
    is_static_zero,
    learning_rate_at,
    needs_params,
    zeros_f32,
)
from jaxcomm.optim._demo_step import (
    demo_plan,
    exchange_messages,
    momentum_messages,
    sign_directions,
    tile_layout,
)
from jaxcomm.optim._skip import count_skips, zeros_unless


@per_device
class DemoLocal(NamedTuple):
    """DeMo's per-device leaf: ``mu``, this device's momentum (fp32, shaped like the parameters),
    what it has not yet transmitted."""

    mu: PyTree


class DemoState(NamedTuple):
    """State of :func:`demo`.

    Attributes:
      count: updates done so far (int32 scalar, replicated).
      local: the per-device :class:`DemoLocal` momentum.
      skips: the updates skipped because they were not finite, in a row and in all
        (:class:`~jaxcomm.guard.SkipCounters`, int32, replicated).
    """

    count: jax.Array
    local: DemoLocal
    skips: SkipCounters


def scale_by_demo(
    learning_rate: optax.ScalarOrSchedule,
    *,
    axis_name: AxisName,
    compression_decay: float = 0.999,
    top_k: int = 32,
    chunk_size: int = 64,
    value_dtype=jnp.float32,
    max_consecutive_skips: int | None = 16,
) -> optax.GradientTransformation:
    """DeMo's direction ``sign(U)`` from this device's local gradients (Peng, Quesnelle and
    Kingma, 2024, *DeMo: Decoupled Momentum Optimization*, arXiv:2411.19870; the reference
    code's rules, bloc97/DeMo ``demo.py``).

    Per step and parameter (gradient ``g`` on this device, ``lr = learning_rate(count)``,
    ``beta = compression_decay``):

    1. ``m <- beta m + lr g`` (``m`` fp32, private to the device: its momentum);
    2. ``C = DCT(m)`` chunk by chunk (:mod:`jaxcomm.compressors.chunks`: ``h x w`` tiles of up to
       ``chunk_size x chunk_size``, chunks of up to ``chunk_size`` for vectors), the orthonormal
       DCT-II ``D_h T D_w^T`` of each tile ``T``;
    3. in each chunk keep the ``k = min(top_k, h w)`` coefficients of largest ``|C|`` (``top_k``
       per chunk, whatever its size: 32 of 4096 in a 64 x 64 tile, 32 of 64 in a vector's
       chunk; a non-finite one ranks first);
    4. ``m <- m - IDCT(sent)``: the transmitted part leaves the momentum;
    5. one ``all_gather`` of every device's message: the kept coefficients' offsets in their
       chunks in the shortest of three fixed-size codes (``k`` fields of ``ceil(log2(h w))``
       bits, an ``h w``-bit mask, or Elias-Fano; see
       :func:`jaxcomm.compressors.chunks.index_code`), then their values in ``value_dtype``;
    6. ``U = IDCT(S)``, ``S`` at each coefficient the mean of the values sent for it over the
       devices that sent one (0 where none did); the direction is ``sign(U)``, fp32 and
       identical on every device.

    Steps 2-4 are ``momentum_messages``, 5 ``exchange_messages``, 6 ``sign_directions`` (of
    :mod:`jaxcomm.optim._demo_step`). The learning rate is an argument because it weighs the
    gradients in the momentum (step 1), so what a device sends depends on it; the step's own
    ``-lr`` splits out exactly: :func:`demo` is ``optax.chain(jc.scale_by_demo(lr, axis_name="dp"),
    optax.scale_by_learning_rate(lr))`` bit for bit without weight decay.

    A step whose gathered values are not finite (a NaN or Inf in any device's momentum ranks
    first in its chunk, so it is sent) is skipped on every device: the momentum is kept, the
    direction is zero, ``state.skips`` counts it, and more than
    ``max_consecutive_skips`` in a row raise ``FloatingPointError``. The arguments are those of
    :func:`demo`.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, jaxcomm as jc
      >>> tx = optax.chain(jc.scale_by_demo(0.1, axis_name="dp", top_k=2),
      ...                  optax.scale_by_learning_rate(0.1))
      >>> params = {"w": jnp.ones(4)}
      >>> state = jax.vmap(lambda _: tx.init(params), axis_name="dp")(jnp.zeros(2))
      >>> grads = {"w": jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 3.0]])}
      >>> updates, state = jax.vmap(lambda g, s: tx.update(g, s), axis_name="dp")(grads, state)
      >>> [round(float(u), 6) for u in updates["w"][0]]  # -lr sign(U), the same on both
      [-0.1, -0.1, -0.1, -0.1]
    """
    top_k, chunk_size, wire = check_settings(top_k, chunk_size, compression_decay, value_dtype)
    axis_name = canonical_axis(axis_name)
    _, fast = split_levels(axis_name)

    def init_fn(params):
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
                raise ValueError(
                    f"jaxcomm: demo needs floating-point parameters, got {jnp.result_type(x)} "
                    f"at {jax.tree_util.keystr(path) or '(the root)'}"
                )
        count = jnp.zeros([], jnp.int32)
        return DemoState(count, DemoLocal(zeros_f32(params)), SkipCounters.zeros())

    def update_fn(updates, state, params=None):
        del params
        lr = learning_rate_at(learning_rate, state.count)
        beta = jnp.asarray(compression_decay, jnp.float32)
        grads, treedef = jax.tree.flatten(f32(updates))
        if fast:  # a replica is a node: the exact mean of its devices' gradients
            grads = lax.pmean(grads, fast)
        mus = treedef.flatten_up_to(state.local.mu)
        ms = [beta * mu.reshape(-1) + lr * g.reshape(-1) for g, mu in zip(grads, mus, strict=True)]
        layout = tile_layout([jnp.shape(g) for g in grads], chunk_size, top_k)
        messages, new_mus = momentum_messages(ms, layout, wire)
        new_mus = [m.reshape(mu.shape) for m, mu in zip(new_mus, mus, strict=True)]
        parts, values, ok = exchange_messages(messages, layout.plans, axis_name, wire)
        directions = sign_directions(parts, values, layout, grads)
        mu = keep_if(ok, treedef.unflatten(new_mus), state.local.mu)
        skips = count_skips(ok, state.skips, max_consecutive_skips, "demo")
        new_state = DemoState(
            jnp.where(ok, optax.safe_increment(state.count), state.count), DemoLocal(mu), skips
        )
        return zeros_unless(ok, treedef.unflatten(directions)), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def demo(
    learning_rate: optax.ScalarOrSchedule,
    *,
    axis_name: AxisName,
    compression_decay: float = 0.999,
    top_k: int = 32,
    chunk_size: int = 64,
    weight_decay: float = 0.0,
    value_dtype=jnp.float32,
    max_consecutive_skips: int | None = 16,
) -> optax.GradientTransformation:
    """DeMo (Peng, Quesnelle and Kingma, 2024, *DeMo: Decoupled Momentum Optimization*,
    arXiv:2411.19870) over this device's local gradients, with the reference code's rules
    (bloc97/DeMo ``demo.py``).

    :func:`scale_by_demo`'s direction ``sign(U)`` (see there: the momentum ``m <- beta m + lr
    g``, its top DCT coefficients per chunk all-gathered), then the step: per parameter ``p``
    (``wd = weight_decay``) ``p <- p (1 - lr wd) - lr sign(U)``. The returned optax update is
    ``-(lr sign(U) + (wd lr) p)`` in each parameter's dtype (bf16 parameters get bf16 updates;
    the momentum stays fp32), identical on every device; a skipped step's is zero (no weight
    decay either). Without weight decay it is ``optax.scale_by_learning_rate(lr)`` after the
    direction, bit for bit; with it, the reference's order ``(wd lr) p`` rounds differently
    from ``optax.add_decayed_weights(wd)`` before that scale (``lr (sign(U) + wd p)``).

    Wire (measured from the compiled HLO in the tests): in a 64 x 64 tile at ``top_k=32`` the
    offsets take 288 bits (Elias-Fano), so a kept value costs 9 bits plus its value: **5.125
    bytes a value** in fp32 (3.125 in bf16), sent to each of the ``n - 1`` other devices; the
    reference sends an int64 index with each value (12 bytes a value in fp32). Against the fp32
    ring all-reduce (``2 (n - 1)/n x 4`` bytes per element) such a tile costs
    ``2 x 4 x 4096 / (n x 32 x 5.125)`` times less, ``100`` at ``n = 2`` and ``25`` at ``n = 8``
    (each device receives every other device's message). Vectors' chunks keep up to ``top_k``
    of their ``chunk_size`` coefficients (half, at the defaults: a 64-bit mask and 32 values,
    4.25 bytes a value in fp32) and save little.

    Defaults (``top_k=32``, ``chunk_size=64``, ``compression_decay=0.999``) are the reference
    code's and the setting the README's pick table measured, with ``learning_rate=3e-3``
    (chosen over 3e-4, 1e-3 and 3e-3 on the byte-level LM of ``benchmarks/time_to_loss.py``:
    ``benchmarks/results/time_to_loss_select.json``); no other ``top_k`` or decay was measured.

    Use it like any optax optimizer inside ``jc.make_train_step(mesh, "dp", loss_fn,
    jc.demo(3e-3, axis_name="dp"), params)``; with ``optax.inject_hyperparams`` pass
    ``static_args=("top_k", "chunk_size", "value_dtype")``.

    Args:
      learning_rate: a float or an optax schedule of the step count.
      axis_name: the data-parallel axis, or a tuple of axes, slowest first (``("host",
        "local")``). Over a tuple a replica is a node, a group of the slow axis: its devices
        step on the exact mean of their gradients over the fast axes (so they keep the same
        momentum), and the messages are exchanged across the slow axis only, each device
        sending ``1/L`` of its node's message there (``L`` devices on the fast axes) and the
        node all-gathering the pieces over the fast axes.
      compression_decay: ``beta`` in ``[0, 1)``.
      top_k: coefficients kept per chunk (>= 1).
      chunk_size: the largest chunk side, 1 to 64 (offsets are coded in at most 12 bits).
      weight_decay: decoupled weight decay ``wd`` (needs ``params`` in ``update``).
      value_dtype: the kept values' dtype on the wire: ``jnp.float32``, ``jnp.bfloat16`` or
        ``jnp.float16`` (the rounded value is what leaves the momentum).
      max_consecutive_skips: non-finite steps in a row before the error (``None``: never).

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`DemoState`; its ``local``
      momentum is per device, the rest replicated. Parameters stay replicated.

    Examples:
      >>> import jax, jax.numpy as jnp, jaxcomm as jc
      >>> tx = jc.demo(0.1, axis_name="dp", top_k=2)
      >>> params = {"w": jnp.ones(4)}
      >>> state = jax.vmap(lambda _: tx.init(params), axis_name="dp")(jnp.zeros(2))
      >>> grads = {"w": jnp.array([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 3.0]])}
      >>> updates, state = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="dp")(
      ...     grads, state)
      >>> [round(float(u), 6) for u in updates["w"][0]]  # -lr sign(U), the same on both
      [-0.1, -0.1, -0.1, -0.1]
      >>> state.local.mu["w"].shape  # each device's own momentum: what it did not send
      (2, 4)
    """
    check_static_range("demo", "weight_decay", weight_decay, 0.0)
    direction = scale_by_demo(
        learning_rate,
        axis_name=axis_name,
        compression_decay=compression_decay,
        top_k=top_k,
        chunk_size=chunk_size,
        value_dtype=value_dtype,
        max_consecutive_skips=max_consecutive_skips,
    )

    def update_fn(updates, state, params=None):
        needs_params(params, weight_decay, "demo")
        d, new_state = direction.update(updates, state, params)
        lr = learning_rate_at(learning_rate, state.count)
        out = jax.tree.map(lambda x: lr * x, d)
        if params is not None and not is_static_zero(weight_decay):
            decay = jnp.asarray(weight_decay, jnp.float32) * lr
            out = jax.tree.map(lambda o, p: o + decay * p, out, f32(params))
        applied = new_state.skips.consecutive == 0  # a skipped step moves nothing, no decay
        out = jax.tree.map(lambda o: jnp.where(applied, -o, jnp.zeros_like(o)), out)
        return cast_like(out, updates if params is None else params), new_state

    return optax.GradientTransformation(direction.init, update_fn)


def check_settings(top_k, chunk_size, compression_decay, value_dtype) -> tuple[int, int, np.dtype]:
    """``(top_k, chunk_size, the wire's value dtype)``, checked; one sentence if not."""

    def bad(what):
        raise ValueError(f"jaxcomm: demo {what}")

    if isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 1:
        bad(f"top_k must be an int >= 1, got {top_k!r}")
    if (
        isinstance(chunk_size, bool)
        or not isinstance(chunk_size, int | np.integer)
        or not 1 <= chunk_size <= 64
    ):
        bad(f"chunk_size must be an int in [1, 64], got {chunk_size!r}")
    check_static_range("demo", "compression_decay", compression_decay, 0.0, 1.0, high_open=True)
    wire = np.dtype(value_dtype)
    if wire not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        bad(f"value_dtype must be float32, bfloat16 or float16, got {value_dtype!r}")
    return int(top_k), int(chunk_size), wire


def message_bytes(shapes, *, top_k: int = 32, chunk_size: int = 64, value_dtype=jnp.float32):
    """Bytes of one device's :func:`demo` message for parameters of ``shapes``: ``ceil(sum
    chunks index_bits / 8)`` bytes of offsets, then every kept value in ``value_dtype``."""
    plans = [demo_plan(tuple(s), chunk_size, top_k) for s in shapes]
    return offset_bytes(plans) + sum(p.kept for p in plans) * np.dtype(value_dtype).itemsize
