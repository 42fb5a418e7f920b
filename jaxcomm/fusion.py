"""How jaxcomm shapes its programs for the backend's fusion, in one place.

A memory-bound step costs the bytes it moves, and the same computation can move different
bytes on different backends: XLA:CPU runs a conditional's taken branch in place, while XLA:GPU
copies a conditional's outputs into the program's outputs; XLA:GPU fuses a buffer's producer
into each of its consumers, re-reading every input per consumer, unless the buffer is written
once. The helpers keep the values and pick the cheaper program per backend at lowering
(``lax.platform_dependent``: one branch is compiled, none runs at run time); exactly, except
that :func:`apart_on_cpu` fuses an expression differently, which may round it differently:

* :func:`write_or_keep`: ``write(...)`` or ``keep(...)`` on a scalar verdict (the non-finite
  guard's): a fused select on GPU, a conditional elsewhere.
* :func:`written_once`: the values behind an optimization barrier on GPU (materialised once,
  read by every consumer), as they are elsewhere.
* :func:`verdict_first`: a guarded collective whose verdict on its inputs is exchanged
  before its payload on GPU, so that the pass that encodes the payload also writes or keeps
  the error feedback; after the payload elsewhere (no extra exchange).
* :func:`kept_form`: of two forms of the same state, the one a step should read (and keep
  when skipped): a derived form that fuses into its readers on GPU, the stored buffer
  elsewhere.
* :func:`apart_on_cpu`: inputs that XLA:CPU must not share between two computations, so that
  each output's computation fuses with the select that keeps it (GPU does this by itself).

The GPU forms were chosen on programs compiled for 8 H100s (``benchmarks/bytes_accessed.py
--platform h100``, ``benchmarks/results/bytes_accessed_h100.json``: 1-bit Adam's compressed
step 12.5 GB -> 10.9 GB per device); compiled for a TPU v5e (2x2, no TPU attached) the same
change moved more bytes, so TPU keeps the CPU forms.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxcomm.fusion import write_or_keep, written_once
  >>> new = lambda x, old: x * 2
  >>> keep = lambda x, old: old
  >>> f = jax.jit(lambda ok, x, old: write_or_keep(ok, new, keep, x, old))
  >>> f(jnp.array(False), jnp.ones(2), jnp.zeros(2)).tolist()
  [0.0, 0.0]
  >>> written_once(jnp.ones(2), jnp.zeros(1))[0].tolist()
  [1.0, 1.0]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomm._compat import varying_axes


def write_or_keep(finite: jax.Array, write: Callable, keep: Callable, *operands: Any) -> Any:
    """``write(*operands)`` where ``finite`` (a bool scalar), else ``keep(*operands)``: the
    values of ``lax.cond(finite, write, keep, *operands)``, compiled the cheaper way.

    XLA:CPU runs a conditional's taken branch into the (donated) output buffer, so keeping the
    old value costs nothing on the usual step. XLA:GPU copies a conditional's outputs into the
    program's outputs (two more passes over them), where a select fused into the write reads
    the kept value once: there both are computed and ``jnp.where`` picks.
    """

    def branchless(*ops):
        written, kept = write(*ops), keep(*ops)
        verdict_axes = varying_axes(finite)
        if any(not verdict_axes <= varying_axes(w) for w in jax.tree.leaves(written)):
            # A verdict varying where the values are not (a per-device guard over a replicated
            # mean): a select would type the result varying, a conditional keeps the values'
            # type, and both forms must agree.
            return branched(*ops)
        return jax.tree.map(lambda a, b: jnp.where(finite, a, b), written, kept)

    def branched(*ops):
        return lax.cond(finite, write, keep, *ops)

    return _on_gpu_else(*operands, gpu=branchless, other=branched)


def written_once(*values: Any) -> Any:
    """``values`` (a tuple), written to memory once on GPU (an optimization barrier), as they
    are elsewhere.

    For a buffer with several consumers that each read it once (a compressor's input plus its
    error feedback: the scale, the packed signs, the new residual): XLA:GPU would otherwise
    fuse its producer into every consumer and read all of the producer's inputs again each
    time. XLA:CPU's fusion already writes it once, and a barrier there would stop the
    producer from fusing into the buffer's first consumer.
    """

    def once(*v):
        return lax.optimization_barrier(v)

    return _on_gpu_else(*values, gpu=once, other=lambda *v: v)


def verdict_first(first: Callable, after: Callable, *operands: Any) -> Any:
    """``first(*operands)`` in a program lowered for a GPU, else ``after(*operands)``: two
    forms of a guarded compressed collective that give the same values (one corner aside: a
    mean that overflows fp32 from finite inputs; see the staged codecs' guard).

    ``first`` exchanges whether every device's input is finite (one bool all-reduce) before
    the compressed payload, so that one pass reads the input and the old residual and writes
    the codes and the new residual or the old one: on XLA:GPU the guard then costs one read of
    the old residual, where deciding after the payload took a pass of its own reading the
    input again (for ``Quantize(8, error_feedback=True)`` compiled for 8 H100s, one pass over
    the bucket more per step). ``after`` decides from the payloads received, with no extra
    exchange: on XLA:CPU the two forms move the same bytes.
    """
    return _on_gpu_else(*operands, gpu=first, other=after)


def kept_form(stored: Any, derive: Callable[[], Any]) -> Any:
    """State a step reads and keeps when it is skipped, given as the ``stored`` buffers and as
    ``derive()``, the same values computed from a smaller form (the 1-bit mean decoded from
    its packed signs): ``derive()`` on GPU, ``stored`` elsewhere.

    On GPU the derivation fuses into each reader (and into :func:`write_or_keep`'s select),
    which then reads the small form. On CPU the conditional's kept branch passes ``stored``
    through with no pass at all, and XLA:CPU decodes packed bits element by element,
    unvectorised: reading the stored buffer is faster there.
    """
    return _on_gpu_else(stored, gpu=lambda _: derive(), other=lambda s: s)


def apart_on_cpu(*values: Any) -> Any:
    """``values`` (a tuple), behind an optimization barrier on XLA:CPU (no bytes move: the
    barrier's outputs are its inputs' buffers), as they are elsewhere.

    XLA merges equal computations, and XLA:CPU writes a value read by two consumers once,
    then reads it in each. For a kept update (``where(ok, f(x), old)`` for two outputs of one
    ``f``, as an optimizer's new parameters and new state) that is a pass writing ``f(x)``
    and one more reading it for each select. Computing one output from the values behind
    the barrier keeps the two computations apart, and each fuses into its own select:
    one pass per output. XLA:GPU already fuses a producer into each of its consumers.
    """

    def apart(*v):
        return lax.optimization_barrier(v)

    return lax.platform_dependent(*values, cpu=apart, default=lambda *v: v)


def _on_gpu_else(*operands: Any, gpu: Callable, other: Callable) -> Any:
    """``gpu(*operands)`` in a program lowered for an NVIDIA or AMD GPU, else
    ``other(*operands)`` (decided at lowering; the tests call ``gpu`` on CPU through it)."""
    return lax.platform_dependent(*operands, cuda=gpu, rocm=gpu, default=other)
