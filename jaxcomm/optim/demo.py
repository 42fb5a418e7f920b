"""DeMo: decoupled momentum, its fast DCT components all-gathered, a sign update.

Peng, Quesnelle and Kingma, 2024, "DeMo: Decoupled Momentum Optimization" (arXiv:2411.19870),
following the reference code (bloc97/DeMo ``demo.py``): the momentum stays on each device; only
the largest DCT coefficients of its chunks are sent, and what was sent leaves the momentum.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomm._compat import all_gather_replicated, ensure_varying
from jaxcomm.comm.axes import AxisName, axis_names, canonical_axis, split_levels
from jaxcomm.comm.state import per_device
from jaxcomm.compressors import keep_if
from jaxcomm.compressors.chunks import (
    ChunkPlan,
    chunk_plan,
    encode_offsets,
    from_chunks,
    offset_bytes,
    pack_bits,
    split_rows,
    stacked_plan,
    tile_groups,
    to_chunks,
    unpack_grouped_offsets,
    wire_order,
)
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
from jaxcomm.optim._skip import count_skips

_HIGHEST = lax.Precision.HIGHEST  # the DCT in true fp32 (no TF32 / bf16 passes on accelerators)
# Leaves of fewer chunks are stacked with their tile's others (fewer, larger ops); larger
# ones go alone, where stacking would only add a copy of them.
_ALONE_FROM = 64


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
      skipped: consecutive updates skipped because they were not finite (int32, replicated).
      skipped_total: all updates skipped so far (int32, replicated).
    """

    count: jax.Array
    local: DemoLocal
    skipped: jax.Array
    skipped_total: jax.Array


def dct_basis(n: int) -> np.ndarray:
    """The orthonormal DCT-II matrix ``D`` (``n x n``, fp32): ``C = D x``, ``x = D^T C``."""
    b, j = np.arange(n)[:, None], np.arange(n)[None, :]
    d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * j + 1) * b / (2 * n))
    d[0] /= np.sqrt(2.0)
    return d.astype(np.float32)


def demo_plan(shape: tuple[int, ...], chunk_size: int, top_k: int) -> ChunkPlan:
    """The chunks of a tensor (:func:`jaxcomm.compressors.chunks.chunk_plan`) with DeMo's
    ``k = min(top_k, h w)`` kept coefficients per chunk (the same for 2-D tiles and vectors)."""
    plan = chunk_plan(tuple(shape), chunk_size, top_k)
    return dataclasses.replace(plan, k=min(top_k, plan.length) if plan.size else 0)


def _dct(chunks: jax.Array, plan: ChunkPlan, inverse: bool = False) -> jax.Array:
    """``D_h T D_w^T`` of every tile ``T`` of ``chunks`` ``(chunks, h w)`` (``inverse``:
    ``D_h^T T D_w``); a vector's chunks (``h = 1``) along the chunk only."""
    t = chunks.reshape(-1, plan.h, plan.w)
    if plan.h > 1:
        bh = jnp.asarray(dct_basis(plan.h))
        t = jnp.einsum("ji,cjl->cil" if inverse else "ij,cjl->cil", bh, t, precision=_HIGHEST)
    if plan.w > 1:
        bw = jnp.asarray(dct_basis(plan.w))
        t = jnp.einsum("cil,lk->cik" if inverse else "cil,kl->cik", t, bw, precision=_HIGHEST)
    return t.reshape(chunks.shape)


def gather_messages(packed: jax.Array, axis_name: AxisName) -> jax.Array:
    """Every replica's message ``packed`` (``(bytes,)`` uint8), stacked ``(replicas, bytes)``
    and replicated.

    One axis: an all-gather over it. A tuple of axes, slowest first: a replica is a node (a
    group of the slow axis) whose devices hold the same message; device ``l`` of the ``L`` on
    the fast axes sends only its ``1/L`` piece across the slow axis and the node's devices then
    all-gather their pieces, so each device receives ``(S - 1)/L`` messages across the slow
    link instead of ``S - 1``.
    """
    slow, fast = split_levels(axis_name)
    if not fast:
        return all_gather_replicated(ensure_varying(packed, slow), slow)
    size = packed.shape[0]
    pieces = int(lax.axis_size(fast))
    width = -(-size // pieces)
    rows = jnp.pad(packed, (0, pieces * width - size)).reshape(pieces, width)
    mine = rows[lax.axis_index(fast)]
    across = all_gather_replicated(ensure_varying(mine, axis_names(axis_name)), slow)  # (S, c)
    nodes = all_gather_replicated(ensure_varying(across, fast), fast)  # (L, S, c)
    return nodes.transpose(1, 0, 2).reshape(across.shape[0], pieces * width)[:, :size]


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

    Per step and parameter ``p`` (gradient ``g`` on this device, ``lr = learning_rate(count)``,
    ``beta = compression_decay``, ``wd = weight_decay``):

    1. ``p <- p (1 - lr wd)``;
    2. ``m <- beta m + lr g`` (``m`` fp32, private to the device: its momentum);
    3. ``C = DCT(m)`` chunk by chunk (:mod:`jaxcomm.compressors.chunks`: ``h x w`` tiles of up to
       ``chunk_size x chunk_size``, chunks of up to ``chunk_size`` for vectors), the orthonormal
       DCT-II ``D_h T D_w^T`` of each tile ``T``;
    4. in each chunk keep the ``k = min(top_k, h w)`` coefficients of largest ``|C|`` (``top_k``
       per chunk, whatever its size: 32 of 4096 in a 64 x 64 tile, 32 of 64 in a vector's
       chunk; a non-finite one ranks first);
    5. ``m <- m - IDCT(sent)``: the transmitted part leaves the momentum;
    6. one ``all_gather`` of every device's message: the kept coefficients' offsets in their
       chunks in the shortest of three fixed-size codes (``k`` fields of ``ceil(log2(h w))``
       bits, an ``h w``-bit mask, or Elias-Fano; see
       :func:`jaxcomm.compressors.chunks.index_code`), then their values in ``value_dtype``;
    7. ``U = IDCT(S)``, ``S`` at each coefficient the mean of the values sent for it over the
       devices that sent one (0 where none did), and ``p <- p - lr sign(U)``.

    The returned optax update is ``-lr wd p - lr sign(U)`` in each parameter's dtype (bf16
    parameters get bf16 updates; the momentum stays fp32). ``U`` and the update are identical
    on every device.

    Wire (measured from the compiled HLO in the tests): in a 64 x 64 tile at ``top_k=32`` the
    offsets take 288 bits (Elias-Fano), so a kept value costs 9 bits plus its value, **5.125
    bytes** in fp32 (3.125 in bf16), sent to each of the ``n - 1`` other devices; the reference
    sends an int64 index with each value (12 bytes in fp32). Against the fp32 ring all-reduce
    (``2 (n - 1)/n x 4`` bytes per element) such a tile costs ``2 x 4 x 4096 / (n x 32 x
    5.125)`` times less: 100x at ``n = 2``, 25x at ``n = 8`` (each device receives every other
    device's message). Vectors' chunks keep up to ``top_k`` of their ``chunk_size``
    coefficients (half, at the defaults: a 64-bit mask and 32 values, 4.25 bytes a value in
    fp32) and save little.

    A step whose gathered values are not finite (a NaN or Inf in any device's momentum ranks
    first in its chunk, so it is sent) is skipped on every device: the momentum is kept, the
    update is zero (no weight decay either), ``skipped`` / ``skipped_total`` count it, and more
    than ``max_consecutive_skips`` in a row raise ``FloatingPointError``.

    Defaults (``top_k=32``, ``chunk_size=64``, ``compression_decay=0.999``) are the reference
    code's and the setting the README's pick table measured, with ``learning_rate=3e-3``
    (chosen over 3e-4, 1e-3 and 3e-3 on the byte-level LM of ``benchmarks/time_to_loss.py``:
    ``benchmarks/results/time_to_loss_select.json``); no other ``top_k`` or decay was measured.

    Use it like any optax optimizer inside ``jc.make_train_step(mesh, "dp", loss_fn,
    jc.demo(3e-3, axis_name="dp"), params)``; with ``optax.inject_hyperparams`` pass
    ``static_args=("top_k", "chunk_size", "value_dtype")``.

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
    """

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
    check_static_range("demo", "weight_decay", weight_decay, 0.0)
    wire = np.dtype(value_dtype)
    if wire not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        bad(f"value_dtype must be float32, bfloat16 or float16, got {value_dtype!r}")
    top_k, chunk_size = int(top_k), int(chunk_size)
    axis_name = canonical_axis(axis_name)
    _, fast = split_levels(axis_name)

    def init_fn(params):
        for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
            if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
                bad(
                    f"needs floating-point parameters, got {jnp.result_type(x)} at "
                    f"{jax.tree_util.keystr(path) or '(the root)'}"
                )
        count, skipped, total = (jnp.zeros([], jnp.int32) for _ in range(3))
        return DemoState(count, DemoLocal(zeros_f32(params)), skipped, total)

    def update_fn(updates, state, params=None):
        needs_params(params, weight_decay, "demo")
        lr = learning_rate_at(learning_rate, state.count)
        beta = jnp.asarray(compression_decay, jnp.float32)
        grads, treedef = jax.tree.flatten(f32(updates))
        if fast:  # a replica is a node: the exact mean of its devices' gradients
            grads = lax.pmean(grads, fast)
        mus = treedef.flatten_up_to(state.local.mu)
        plans = [demo_plan(jnp.shape(g), chunk_size, top_k) for g in grads]

        # 2-5: this device's momentum, its kept coefficients, what it keeps; leaves with the
        # same tile go through the DCT, top-k and coding as one stack of chunks.
        ms = [beta * mu.reshape(-1) + lr * g.reshape(-1) for g, mu in zip(grads, mus, strict=True)]
        groups = tile_groups(plans, alone_from=_ALONE_FROM)
        group_plans = [stacked_plan([plans[i] for i in members]) for members in groups]
        group_rows = [split_rows(members, plans) for members in groups]
        leaf_bits, leaf_values, leaf_sent = {}, {}, {}
        for members, plan, rows_of in zip(groups, group_plans, group_rows, strict=True):
            coeffs = _dct(jnp.concatenate([to_chunks(ms[i], plans[i]) for i in members]), plan)
            key = jnp.where(jnp.isfinite(coeffs), jnp.abs(coeffs), jnp.inf)
            idx = wire_order(lax.top_k(key, plan.k)[1], plan)
            kept = jnp.take_along_axis(coeffs, idx, axis=-1).astype(wire)
            rows = jnp.arange(plan.chunks)[:, None]
            sent = jnp.zeros_like(coeffs).at[rows, idx].set(kept.astype(jnp.float32))
            sent = _dct(sent, plan, inverse=True)
            bits = encode_offsets(idx, plan).reshape(plan.chunks, -1)
            for i, rows_i in zip(members, rows_of, strict=True):
                leaf_bits[i], leaf_values[i] = bits[rows_i], kept[rows_i].reshape(-1)
                leaf_sent[i] = sent[rows_i]
        new_mus = [
            (m - from_chunks(leaf_sent[i], plans[i]) if i in leaf_sent else m).reshape(mu.shape)
            for i, (m, mu) in enumerate(zip(ms, mus, strict=True))
        ]

        # 6: one all-gather of [offset bits | values] (uint8), leaf by leaf.
        total = sum(p.kept for p in plans)
        n = 1
        if total:
            order = sorted(leaf_bits)
            packed = jnp.concatenate(
                [
                    pack_bits(jnp.concatenate([leaf_bits[i].reshape(-1) for i in order])),
                    lax.bitcast_convert_type(
                        jnp.concatenate([leaf_values[i] for i in order]), jnp.uint8
                    ).reshape(-1),
                ]
            )
            parts = gather_messages(packed, axis_name)
            n = parts.shape[0]
            raw = parts[:, offset_bytes(plans) :].reshape(n, total, wire.itemsize)
            all_values = lax.bitcast_convert_type(raw, wire).astype(jnp.float32)
            ok = jnp.isfinite(jnp.sum(all_values))
        else:
            ok = jnp.ones([], jnp.bool_)

        # 7: scatter-mean over contributors in DCT space, inverse DCT, sign (by tile group).
        directions = [jnp.zeros_like(g) for g in grads]
        if total:
            group_offsets = unpack_grouped_offsets(parts, plans, groups)
            starts = np.cumsum([0] + [p.kept for p in plans])
            for members, plan, rows_of, off in zip(
                groups, group_plans, group_rows, group_offsets, strict=True
            ):
                val = jnp.concatenate(
                    [all_values[:, starts[i] : starts[i + 1]] for i in members], axis=1
                ).reshape(-1)
                flat = (jnp.arange(plan.chunks)[:, None] * plan.length + off).reshape(-1)
                size = plan.chunks * plan.length
                sums = jnp.zeros((size,), jnp.float32).at[flat].add(val)
                count = jnp.zeros((size,), jnp.float32).at[flat].add(1.0)
                mean = (sums / jnp.maximum(count, 1.0)).reshape(plan.chunks, plan.length)
                u = _dct(mean, plan, inverse=True)
                for i, rows_i in zip(members, rows_of, strict=True):
                    directions[i] = jnp.sign(from_chunks(u[rows_i], plans[i])).reshape(
                        grads[i].shape
                    )

        out = [lr * d for d in directions]
        if params is not None and not is_static_zero(weight_decay):
            decay = jnp.asarray(weight_decay, jnp.float32) * lr
            flat_params = treedef.flatten_up_to(f32(params))
            out = [o + decay * p for o, p in zip(out, flat_params, strict=True)]
        out = [jnp.where(ok, -o, jnp.zeros_like(o)) for o in out]
        mu = keep_if(ok, treedef.unflatten(new_mus), state.local.mu)
        skipped, skipped_total = count_skips(
            ok, state.skipped, state.skipped_total, max_consecutive_skips, "demo"
        )
        new_state = DemoState(
            jnp.where(ok, optax.safe_increment(state.count), state.count),
            DemoLocal(mu),
            skipped,
            skipped_total,
        )
        like = updates if params is None else params
        return cast_like(treedef.unflatten(out), like), new_state

    return optax.GradientTransformation(init_fn, update_fn)


def message_bytes(shapes, *, top_k: int = 32, chunk_size: int = 64, value_dtype=jnp.float32):
    """Bytes of one device's :func:`demo` message for parameters of ``shapes``: ``ceil(sum
    chunks index_bits / 8)`` bytes of offsets, then every kept value in ``value_dtype``."""
    plans = [demo_plan(tuple(s), chunk_size, top_k) for s in shapes]
    return offset_bytes(plans) + sum(p.kept for p in plans) * np.dtype(value_dtype).itemsize
