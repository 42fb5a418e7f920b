"""The methods ``jaxcomm demo`` compares: its configuration, each optimizer and the bytes of
each kind of step.

Each optimizer's step is one of these kinds: an *exact* step (fp32 mean of a parameter-shaped
tree), a *1-bit* step (``OneBit`` mean of such a tree), a *local* step (no communication), an
*int4 sync* (DiLoCo's ``Quantize(bits=4, error_feedback=True)`` mean of the parameter-shaped
outer gradient) or ``sharded_int8``'s step (an int8 reduce-scatter of the gradients and an int8
all-gather of the parameters). The bytes per device of each kind are read from the compiled HLO
of its collectives on the mesh (:mod:`jaxcomm.inspect`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

EXACT, ONEBIT, LOCAL = "exact", "1-bit", "local"
SHARDED_INT8 = "int8 scatter+gather"
DILOCO_INT4 = "int4 sync"
RATES_GBIT = (1, 10, 100)


#: Every method ``--methods`` accepts (add a new one here and in :func:`optimizer_for`).
METHODS = (
    "adam",
    "compressed_mean",
    "onebit_adam",
    "zero_one_adam",
    "onebit_lamb",
    "diloco_int4",
    "sharded_int8",
)


@dataclass(frozen=True)
class DemoConfig:
    """Sizes and schedules of the demo (defaults: 768 steps of 8 devices x 8 windows of 32
    bytes, one bucket; about half a minute per optimizer on 2 cores)."""

    steps: int = 768
    devices: int = 8
    batch_per_device: int = 8
    context: int = 32
    #: the transformer (:class:`jaxcomm.cli.models.ByteTransformer`)
    width: int = 64
    heads: int = 4
    layers: int = 2
    learning_rate: float = 1e-3
    #: LAMB scales each layer's step by its trust ratio ||p|| / ||update||, so its learning rate
    #: is on another scale (1e-2 here reaches Adam's loss; 1e-3 is far slower).
    lamb_learning_rate: float = 1e-2
    warmup_fraction: float = 0.15
    #: None: one bucket (one 1-bit scale) for the whole model; 1: one per parameter (DeepSpeed).
    bucket_bytes: int | None = None
    #: 0/1 Adam: variance updates per doubling of their interval; frozen-stage steps per doubling
    #: of the sync interval; the largest sync interval (None: the optimizer's defaults;
    #: ``local_step_scaler`` then follows the run length, ``total_steps``).
    var_update_scaler: int | None = None
    local_step_scaler: int | None = None
    local_step_clipper: int | None = None
    #: DiLoCo: steps between two syncs of the outer parameters (H)
    diloco_sync_every: int = 50
    eval_every: int = 50
    #: held-out windows (each predicts ``context`` bytes)
    held_out: int = 512
    seed: int = 0
    methods: tuple[str, ...] = tuple(m for m in METHODS if m != "sharded_int8")

    @property
    def warmup_steps(self) -> int:
        return max(1, int(round(self.warmup_fraction * self.steps)))


@dataclass
class RunResult:
    """One optimizer's run."""

    method: str
    losses: list[float] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    #: communication after the last step (0/1 Adam: the final parameter average)
    final_kinds: list[str] = field(default_factory=list)
    eval_steps: list[int] = field(default_factory=list)
    eval_losses: list[float] = field(default_factory=list)
    final_eval_loss: float = math.nan
    final_accuracy: float = math.nan
    seconds: float = 0.0


def make_model(cfg: DemoConfig):
    """The byte-level transformer LM of ``cfg`` (parameters: ``make_model(cfg).init(cfg.seed)``)."""
    from jaxcomm.cli.models import ByteTransformer

    return ByteTransformer(
        context=cfg.context, width=cfg.width, heads=cfg.heads, layers=cfg.layers
    )


def check_methods(methods) -> tuple[str, ...]:
    """``methods`` as a tuple, or a ``ValueError`` naming the unknown ones and the valid ones."""
    methods = tuple(methods)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(
            f"unknown method{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"valid methods: {', '.join(METHODS)}"
        )
    if not methods:
        raise ValueError(f"no method given; valid methods: {', '.join(METHODS)}")
    return methods


def optimizer_for(method: str, cfg: DemoConfig, axis: str):
    """``(transformation, kind_of_step(opt_state) -> EXACT | ONEBIT | LOCAL)`` for a method."""
    import optax

    import jaxcomm as jc

    lr, warm, bb = cfg.learning_rate, cfg.warmup_steps, cfg.bucket_bytes
    if method == "adam":
        tx = optax.chain(
            jc.compressed_mean(axis, compressor=jc.NoCompression(), bucket_bytes=bb),
            optax.adam(lr),
        )
        return tx, lambda s: EXACT
    if method == "compressed_mean":
        tx = optax.chain(
            jc.compressed_mean(axis, bucket_bytes=bb, warmup_steps=warm), optax.adam(lr)
        )
        return tx, lambda s: EXACT if int(s[0].count) < warm else ONEBIT
    if method == "onebit_adam":
        tx = jc.onebit_adam(lr, freeze_step=warm, axis_name=axis, bucket_bytes=bb)
        return tx, lambda s: EXACT if int(s.count) < warm else ONEBIT
    if method == "zero_one_adam":
        # jaxcomm's schedule for a run of cfg.steps (the variance freezes with the warm-up).
        scalers = dict(
            var_update_scaler=cfg.var_update_scaler,
            local_step_scaler=cfg.local_step_scaler,
            local_step_clipper=cfg.local_step_clipper,
        )
        tx = jc.zero_one_adam(
            lr,
            var_freeze_step=warm,
            total_steps=cfg.steps,
            axis_name=axis,
            bucket_bytes=bb,
            **{k: v for k, v in scalers.items() if v is not None},
        )

        def kind(s) -> str:
            t = int(s.count) + 1
            if t <= warm:
                return EXACT if t % int(s.var_interval) == 0 else ONEBIT
            return ONEBIT if t % int(s.local_interval) == 0 else LOCAL

        return tx, kind
    if method == "onebit_lamb":
        tx = jc.onebit_lamb(
            cfg.lamb_learning_rate, freeze_step=warm, axis_name=axis, bucket_bytes=bb
        )
        return tx, lambda s: EXACT if int(s.count) < warm else ONEBIT
    if method == "diloco_int4":
        H = cfg.diloco_sync_every
        tx = jc.diloco(
            optax.adam(lr),
            optax.sgd(0.7, momentum=0.9, nesterov=True),
            H,
            axis,
            compressor=jc.Quantize(bits=4, error_feedback=True),
            bucket_bytes=bb,
        )
        return tx, lambda s: DILOCO_INT4 if (int(s.count) + 1) % H == 0 else LOCAL
    if method == "sharded_int8":
        return _sharded_int8(optax.adam(lr), axis, bb), lambda s: SHARDED_INT8
    check_methods([method])  # an unknown name: a ValueError listing the valid ones
    raise ValueError(
        f"jaxcomm demo: METHODS lists {method!r} but optimizer_for has no branch for it"
    )


def _sharded_int8(inner, axis: str, bucket_bytes: int | None):
    import jaxcomm as jc

    int8 = jc.Quantize(bits=8)
    return jc.sharded(
        inner, axis, compressor=int8, gather_compressor=int8, bucket_bytes=bucket_bytes
    )


def _sharded_int8_bytes(mesh, axis: str, params, bucket_bytes: int | None) -> float:
    """Bytes per device of one ``sharded_int8`` update of a parameter-shaped tree (HLO)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    from jaxcomm.inspect import wire_bytes

    tx = _sharded_int8(optax.identity(), axis, bucket_bytes)
    tree = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)
    n = mesh.shape[axis]
    grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct((n, *p.shape), p.dtype), tree)

    def body(g, p):
        g = jax.tree.map(lambda x: x[0], g)
        return tx.update(g, tx.init(p), p)[0]

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P()), out_specs=P()))
    return wire_bytes(fn.lower(grads, tree).compile().as_text())


def wire_bytes_per_kind(
    mesh, axis: str, params, bucket_bytes: int | None, methods: tuple[str, ...] = METHODS
) -> dict[str, float]:
    """Bytes per device of an exact and a 1-bit mean of a parameter-shaped tree, and (if
    ``methods`` use them) of an int4 (error feedback) mean and of a ``sharded_int8`` step
    (HLO)."""
    import jaxcomm as jc
    from jaxcomm.inspect import mean_wire_bytes

    out = {LOCAL: 0.0}
    kinds = [(EXACT, jc.NoCompression()), (ONEBIT, jc.OneBit())]
    if "diloco_int4" in methods:  # DiLoCo's outer gradients
        kinds.append((DILOCO_INT4, jc.Quantize(bits=4, error_feedback=True)))
    for kind, comp in kinds:
        out[kind] = mean_wire_bytes(mesh, axis, params, comp, bucket_bytes)
    if "sharded_int8" in methods:
        out[SHARDED_INT8] = _sharded_int8_bytes(mesh, axis, params, bucket_bytes)
    return out
