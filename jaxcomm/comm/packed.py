"""A compressed mean kept as it was sent: the packed form of an all-reduce's output.

A compressor whose all-reduce output is itself compressed (:class:`jaxcomm.OneBit`: every
device's server chunk is a scale times packed signs) can hand that output back in its packed
form, about 1/32 of the mean's bytes. An optimizer whose next step starts from the mean (1-bit
Adam: the mean momentum is the next step's momentum) keeps the packed form in its state and
reads the momentum back from it on GPU, instead of reading the mean's dense leaves: on a
memory-bound step that is a pass over the parameters saved, twice (the momentum update and the
non-finite fallback both read it).

:class:`PackedMean` holds it, per bucket, with a flag saying whether it stands for the state's
dense copy (``valid``). Its layout depends on the number of devices, so a state moved onto
another device count (:func:`jaxcomm.reshard_train_state`) gets it reset (``valid`` false), and
the optimizer then reads its dense copy once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcomm.comm.axes import AxisName, axis_names
from jaxcomm.comm.state import plan_tree
from jaxcomm.compressors import Compressor
from jaxcomm.compressors.buckets import map_buckets

PyTree = Any


class PackedMean(NamedTuple):
    """A compressed all-reduce's last mean in the form it was sent, replicated.

    Attributes:
      buckets: per bucket, the compressor's packed mean
        (:meth:`~jaxcomm.Compressor.init_packed_mean`; OneBit: one ``(n, M + 4)`` uint8
        array, every device's chunk as it was gathered: its packed signs, then its scale);
        empty where the compressor, the tree or the axis has none (then the optimizer always
        reads its dense copy).
      valid: bool scalar: whether ``buckets`` is the mean the optimizer's dense copy holds.
    """

    buckets: tuple
    valid: jax.Array


def packs_mean(
    tree: PyTree, compressor: Compressor, bucket_bytes: int | None, axis_name: AxisName
) -> bool:
    """Whether ``compressor``'s means of ``tree`` over ``axis_name`` come with a packed form:
    one axis, every bucket floating and not empty, and a compressor that has one."""
    if len(axis_names(axis_name)) != 1:
        return False
    _, _, buckets = plan_tree(tree, compressor, bucket_bytes)
    return bool(buckets) and all(
        not b.exact and b.numel and compressor.init_packed_mean(b, 1) is not None for b in buckets
    )


def init_packed_mean(
    tree: PyTree,
    compressor: Compressor,
    bucket_bytes: int | None,
    axis_name: AxisName,
    axis_size: Any,
) -> PackedMean:
    """Zeros in the packed form of ``tree``'s mean on ``axis_size`` devices, not valid (empty
    buckets where :func:`packs_mean` is false)."""
    invalid = jnp.zeros([], jnp.bool_)
    if not packs_mean(tree, compressor, bucket_bytes, axis_name):
        return PackedMean((), invalid)
    _, _, buckets = plan_tree(tree, compressor, bucket_bytes)
    packed = tuple(compressor.init_packed_mean(b, int(axis_size)) for b in buckets)
    return PackedMean(packed, invalid)


def unpack_mean(
    packed: PackedMean, like: PyTree, compressor: Compressor, bucket_bytes: int | None
) -> PyTree:
    """The mean ``packed`` stands for, as a tree of fp32 leaves structured like ``like``.

    Each leaf is decoded where it is read: on GPU its decode fuses into its consumer, which
    reads the packed bytes, not a dense leaf (XLA:CPU unpacks bits element by element).
    """
    leaves, treedef, buckets = plan_tree(like, compressor, bucket_bytes)

    def decoded(bucket, bucket_packed):
        leaves_of_bucket = compressor.unpack_mean(bucket_packed, bucket)
        return [leaf.astype(jnp.float32) for leaf in leaves_of_bucket], None

    out, _ = map_buckets(decoded, buckets, len(leaves), packed.buckets)
    return jax.tree_util.tree_unflatten(treedef, out)


def packed_mean_squares(
    packed: tuple, like: PyTree, compressor: Compressor, bucket_bytes: int | None
) -> PyTree | None:
    """Each leaf's mean of squares of the mean ``packed`` stands for (a bucket's packed form
    each, as :func:`unpack_mean` reads them), as a tree of fp32 scalars structured like
    ``like``, from the packed form alone; ``None`` where the compressor cannot give a bucket's
    (:meth:`~jaxcomm.Compressor.packed_mean_squares`).

    A leaf's RMS then costs no pass over the leaf (a reduction of the decoded leaf reads all of
    it, and on CPU has it written first).
    """
    leaves, treedef, buckets = plan_tree(like, compressor, bucket_bytes)
    squares = [compressor.packed_mean_squares(p, b) for b, p in zip(buckets, packed, strict=True)]
    if any(s is None for s in squares):
        return None
    out, _ = map_buckets(lambda bucket, s: (s, None), buckets, len(leaves), squares)
    return jax.tree_util.tree_unflatten(treedef, out)
