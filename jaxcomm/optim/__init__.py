"""Optax transformations that communicate through jaxcomm's compressed collectives.

One module per optimizer family (the public names are re-exported by :mod:`jaxcomm`):

* :mod:`~jaxcomm.optim.compressed_mean`: the (compressed) mean of the gradients, with error
  feedback; chain it before any optax optimizer:
  ``optax.chain(jc.compressed_mean("dp"), optax.adam(1e-3))``.
* :mod:`~jaxcomm.optim.onebit_adam`: DeepSpeed's 1-bit Adam (exact warm-up, then 1-bit
  momentum all-reduce), as ``scale_by_onebit_adam`` (the direction) and ``onebit_adam``.
* :mod:`~jaxcomm.optim.zero_one_adam`: DeepSpeed's 0/1 Adam (adaptive variance freezing and
  local steps), as ``scale_by_zero_one_adam`` (the fp32 parameter change, the learning rate
  inside) and ``zero_one_adam``.
* :mod:`~jaxcomm.optim.onebit_lamb`: DeepSpeed's 1-bit LAMB (exact LAMB warm-up, then 1-bit
  momentum with frozen, corrected trust ratios), as ``scale_by_onebit_lamb`` (the direction)
  and ``onebit_lamb``.
* :mod:`~jaxcomm.optim.demo`: DeMo (decoupled momentum: the top DCT coefficients of
  each device's momentum chunks all-gathered, a sign update), as ``scale_by_demo`` (the
  direction) and ``demo``.
* :mod:`~jaxcomm.optim.sharded`: ZeRO 1-2 around any optax transformation (compressed
  reduce-scatter and all-gather).
* :mod:`~jaxcomm.optim.diloco`: DiLoCo and Streaming DiLoCo, a package (the transformation,
  its state, its steps, the background sync).
* :mod:`~jaxcomm.optim.schedule`: the schedule's phases (``phase``, ``phase_cond``,
  ``phase_switch``), which a phase-specialised train step fixes per program.
* ``_skip`` (skipping a non-finite step), ``_moments`` (EMA, damped denominators) and
  ``_common`` (validation, tree helpers): the pieces the optimizers share.

Each transformation's ``update`` runs where the data-parallel axis is bound (inside
``jax.shard_map`` or ``jax.pmap``, e.g. via ``jc.make_train_step``) and takes **this device's
local gradients**: the transformation does the cross-device communication itself.

State layout. Leaves of a state are either **replicated** (identical on every device: step
counts, Adam moments computed from reduced values, hyperparameters) or **per-device** (the
error feedback of the 1-bit collectives, 0/1 Adam's local momentum). Per-device leaves live only
inside the NamedTuple types marked with :func:`jaxcomm.comm.state.per_device`
(``jc.ReduceState``, ``jc.ScatterState``, ``jc.LocalState``, ``jc.ShardedState``), so
:func:`jaxcomm.state_partition_specs` can tell them apart by walking the tree.

``init`` needs the size of the axis to lay out the error feedback. It is taken from the
``axis_size`` argument; if that is ``None``, from ``lax.axis_size(axis_name)`` when ``init`` is
called where the axis is bound (in ``shard_map``/``pmap``, or under ``jax.vmap(...,
axis_name=...)`` as :func:`jaxcomm.init_opt_state` does), else from ``jax.device_count()``.

Dtypes. Moments and error feedback are fp32 whatever the parameter dtype; updates are returned
in each parameter's dtype (bf16 parameters get bf16 updates). Learning rates accept optax
schedules (evaluated at the step count, starting at 0) and ``optax.inject_hyperparams`` works;
pass ``static_args=("bucket_bytes", "axis_size")`` to it when you set those to integers, and
``hyperparam_dtype=jnp.float32`` with bf16 parameters (optax otherwise stores the
hyperparameters in the parameters' dtype, where ``b2 = 0.999`` rounds to 1.0).
"""
