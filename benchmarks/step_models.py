"""Models and optimizer calls shared by the train-step benchmarks (no side effects on import).

* :class:`ModelConfig` / :func:`make_loss`: a GPT-2 style decoder LM (pre-LayerNorm, fused qkv,
  tied embedding), bf16 matmuls on fp32 parameters, layers unrolled (each layer's gradients
  exist before the next layer's backward pass ends: what bucketed collectives can overlap).
* :func:`mlp`: an MLP of ``width x width`` layers with biases, fp32, regressing a target.
* :func:`methods`: the optimizers as the README writes them (default arguments, short
  schedules so that a few steps reach every phase), with the ratio of bytes accessed per step
  to a local ``optax.adam`` step each should stay within.
* :func:`local_adam_step`: the baseline, plain ``jax.jit`` of loss, gradient and
  ``optax.adam``, state donated.
* :func:`bytes_accessed`: XLA's own cost analysis of a compiled program.
* :func:`cpu_model`: the host CPU's model name, for the results files' provenance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any

# ---------------------------------------------------------------------------------------------
# A GPT-2 style decoder.


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 12
    width: int = 768
    heads: int = 12
    vocab: int = 50304
    seq: int = 1024
    batch_per_device: int = 4

    def param_shapes(self) -> dict:
        d, f = self.width, jax.ShapeDtypeStruct

        def s(*shape):
            return f(shape, jnp.float32)

        block = dict(
            ln1_g=s(d), ln1_b=s(d), qkv_w=s(d, 3 * d), qkv_b=s(3 * d), proj_w=s(d, d),
            proj_b=s(d), ln2_g=s(d), ln2_b=s(d), fc_w=s(d, 4 * d), fc_b=s(4 * d),
            out_w=s(4 * d, d), out_b=s(d),
        )  # fmt: skip
        blocks = {f"h{i:02d}": dict(block) for i in range(self.layers)}
        return dict(wte=s(self.vocab, d), wpe=s(self.seq, d), blocks=blocks, lnf_g=s(d), lnf_b=s(d))

    def init(self, key: jax.Array) -> dict:
        shapes = self.param_shapes()
        leaves, tree = jax.tree.flatten(shapes)
        keys = jax.random.split(key, len(leaves))
        values = [
            0.02 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)
        ]
        return jax.tree.unflatten(tree, values)

    def num_params(self) -> int:
        return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.param_shapes()))

    def batch(self, rows: int, seed: int = 0) -> np.ndarray:
        """Random tokens ``(rows, seq + 1)``: inputs and their next-token targets."""
        rng = np.random.default_rng(seed)
        return rng.integers(0, self.vocab, (rows, self.seq + 1)).astype(np.int32)


#: The GPU check's LM: GPT-2 small's shape with a 32768-token vocabulary, batch 8 per device.
GPT_SMALL = ModelConfig(layers=12, width=768, heads=12, vocab=32768, seq=1024, batch_per_device=8)
#: Its CPU-sized stand-in (the smoke runs and tests).
GPT_TINY = ModelConfig(layers=2, width=64, heads=2, vocab=256, seq=32, batch_per_device=2)


def _layer_norm(x, g, b):
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return ((x - mean) * jax.lax.rsqrt(var + 1e-5) * g + b).astype(jnp.bfloat16)


def make_loss(cfg: ModelConfig) -> Callable:
    def bf(w):
        return w.astype(jnp.bfloat16)

    def loss_fn(p, tokens):
        x, y = tokens[:, :-1], tokens[:, 1:]
        s, d, h = x.shape[1], cfg.width, cfg.heads
        act = (p["wte"][x] + p["wpe"][None, :s]).astype(jnp.bfloat16)
        causal = jnp.tril(jnp.ones((s, s), bool))
        for name in sorted(p["blocks"]):
            blk = p["blocks"][name]
            a = _layer_norm(act, blk["ln1_g"], blk["ln1_b"])
            qkv = (a @ bf(blk["qkv_w"]) + bf(blk["qkv_b"])).reshape(*a.shape[:2], 3, h, d // h)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
            att = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / (d // h) ** 0.5
            att = jax.nn.softmax(jnp.where(causal, att, -1e9), -1).astype(jnp.bfloat16)
            o = jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(a.shape)
            act = act + o @ bf(blk["proj_w"]) + bf(blk["proj_b"])
            a = _layer_norm(act, blk["ln2_g"], blk["ln2_b"])
            hidden = jax.nn.gelu(a @ bf(blk["fc_w"]) + bf(blk["fc_b"]))
            act = act + hidden @ bf(blk["out_w"]) + bf(blk["out_b"])
        act = _layer_norm(act, p["lnf_g"], p["lnf_b"])
        logits = (act @ bf(p["wte"]).T).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn


# ---------------------------------------------------------------------------------------------
# An fp32 MLP with biases.


def mlp(layers: int, width: int, seed: int = 0) -> tuple[dict, Callable]:
    """``(params, loss_fn)``: ``layers`` dense ``width x width`` layers with biases and GELU
    between them, fp32, mean squared error against a target; the batch is ``(x, y)``."""
    keys = jax.random.split(jax.random.key(seed), layers)
    params = {
        f"l{i:02d}": {"w": jax.random.normal(k, (width, width)) / width**0.5,
                      "b": jnp.zeros((width,))}
        for i, k in enumerate(keys)
    }  # fmt: skip

    def loss_fn(p, batch):
        h, y = batch
        for i, name in enumerate(sorted(p)):
            h = h @ p[name]["w"] + p[name]["b"]
            if i < len(p) - 1:
                h = jax.nn.gelu(h)
        return jnp.mean((h - y) ** 2)

    return params, loss_fn


def mlp_shapes(layers: int, width: int) -> dict:
    f32 = jnp.float32
    return {
        f"l{i:02d}": {"w": jax.ShapeDtypeStruct((width, width), f32),
                      "b": jax.ShapeDtypeStruct((width,), f32)}
        for i in range(layers)
    }  # fmt: skip


def mlp_batch(rows: int, width: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width), np.float32)
    return x, rng.standard_normal((rows, width), np.float32) * 0.1


# ---------------------------------------------------------------------------------------------
# The optimizers, as a user writes them.


@dataclass(frozen=True)
class Method:
    """One optimizer row: ``make()`` builds the transformation (``None``: the local optax
    step); ``phase_names`` names the phase values of its phase-specialised programs;
    ``targets`` is the ratio of bytes accessed to the local step each phase should stay within
    (``"*"``: every phase not named); ``warmup`` steps reach (and compile) the steady phases,
    whose timing is amortised over ``cycle`` steps."""

    name: str
    call: str
    make: Callable[[], optax.GradientTransformation] | None
    targets: dict[str, float]
    phase_names: dict[tuple[int, ...], str] = field(default_factory=dict)
    warmup: int = 2
    cycle: int = 1
    steady: tuple[str, ...] = ()  # the phases a long run spends its steps in ("" when unphased)

    def phase_label(self, values: tuple[int, ...]) -> str:
        return self.phase_names.get(tuple(values), "step" if not values else str(tuple(values)))

    def target(self, label: str) -> float:
        return self.targets.get(label, self.targets["*"])


#: 1-bit Adam's / LAMB's warm-up in the benchmarks: short, so a few steps reach the 1-bit
#: phase (these benchmarks time steps; with so short a warm-up 1-bit Adam may diverge).
FREEZE_STEP = 2
DILOCO_H = 16


def methods(
    lr: float = 1e-3, zero_one_total_steps: int = 40, skips: dict | None = None
) -> dict[str, Method]:
    """Every optimizer row, the local optax step first. ``skips``: extra keyword arguments of
    the optimizers with a skip cap (1-bit Adam/LAMB, 0/1 Adam, DiLoCo, DeMo), e.g.
    ``{"max_consecutive_skips": None}`` where the cap's host callback cannot compile (XLA:GPU
    without a GPU); they are written into each row's call."""
    import jaxcomm as jc

    kw = dict(skips or {})
    sfx = "".join(f", {k}={v!r}" for k, v in kw.items())

    def outer() -> optax.GradientTransformation:
        return optax.sgd(0.7, momentum=0.9, nesterov=True)

    ms = [
        Method("local", "optax.adam under plain jax.jit (donated)", None, {"*": 1.0}),
        Method(
            "exact", 'chain(compressed_mean("dp", NoCompression()), adam)',
            lambda: optax.chain(jc.compressed_mean("dp", jc.NoCompression()), optax.adam(lr)),
            {"*": 1.15},
        ),
        Method(
            "int8_ef", 'chain(compressed_mean("dp", Quantize(8, error_feedback=True)), adam)',
            lambda: optax.chain(
                jc.compressed_mean("dp", jc.Quantize(8, error_feedback=True)), optax.adam(lr)
            ),
            {"*": 1.5},
        ),
        Method(
            "int4_ef", 'chain(compressed_mean("dp", Quantize(4, error_feedback=True)), adam)',
            lambda: optax.chain(
                jc.compressed_mean("dp", jc.Quantize(4, error_feedback=True)), optax.adam(lr)
            ),
            {"*": 1.5},
        ),
        Method(
            "onebit_adam", f'onebit_adam(lr, freeze_step={FREEZE_STEP}, axis_name="dp"{sfx})',
            lambda: jc.onebit_adam(lr, freeze_step=FREEZE_STEP, axis_name="dp", **kw),
            # The warm-up is exact Adam over an exact mean.
            {"warm-up": 1.15, "*": 1.5},
            {(0,): "warm-up", (1,): "first 1-bit", (2,): "1-bit"},
            warmup=FREEZE_STEP + 3, steady=("1-bit",),
        ),
        Method(
            "zero_one_adam",
            f'zero_one_adam(lr, axis_name="dp", total_steps={zero_one_total_steps}{sfx})',
            lambda: jc.zero_one_adam(
                lr, axis_name="dp", total_steps=zero_one_total_steps, **kw
            ),
            {"*": 1.5},
            {(0,): "variance exact", (1,): "variance 1-bit", (2,): "local", (3,): "sync 1-bit",
             (4,): "first sync"},
            # total_steps=40: variance frozen after step 6, then sync and local steps alternate.
            warmup=10, cycle=2, steady=("local", "sync 1-bit"),
        ),
        Method(
            "diloco", f'diloco(adam, sgd(0.7, nesterov), {DILOCO_H}, "dp", Quantize(4, EF){sfx})',
            lambda: jc.diloco(
                optax.adam(lr), outer(), DILOCO_H, "dp",
                compressor=jc.Quantize(4, error_feedback=True), **kw,
            ),  # fmt: skip
            {"inner": 1.05, "sync": 1.5, "*": 1.5},
            # (sync, skip-cap phase); without the cap (max_consecutive_skips=None) the sync only
            {(0, 0): "inner", (1, 1): "sync", (0,): "inner", (1,): "sync"},
            warmup=DILOCO_H, cycle=DILOCO_H, steady=("inner", "sync"),
        ),
        Method("demo", f'demo(lr, axis_name="dp"{sfx})', lambda: jc.demo(lr, axis_name="dp", **kw),
               {"*": 2.0}),
        Method(
            "onebit_lamb", f'onebit_lamb(lr, freeze_step={FREEZE_STEP}, axis_name="dp"{sfx})',
            lambda: jc.onebit_lamb(lr, freeze_step=FREEZE_STEP, axis_name="dp", **kw),
            {"*": 1.5},
            {(1,): "warm-up", (0,): "1-bit"},
            warmup=FREEZE_STEP + 2, steady=("1-bit",),
        ),
    ]  # fmt: skip
    return {m.name: m for m in ms}


# ---------------------------------------------------------------------------------------------
# The baseline step and the cost analysis.


def local_adam_step(loss_fn: Callable, lr: float = 1e-3):
    """``(step, opt)``: ``step(params, opt_state, batch) -> (params, opt_state, loss)``, a plain
    ``jax.jit`` of loss, gradient and ``optax.adam``, with params and state donated."""
    opt = optax.adam(lr)

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1)), opt


def bytes_accessed(compiled) -> float | None:
    """``compiled.cost_analysis()["bytes accessed"]`` (per device for an SPMD program), or
    ``None`` where the backend gives no cost analysis."""
    try:
        cost = compiled.cost_analysis()
    except Exception:  # noqa: BLE001 - optional: some backends have none
        return None
    if isinstance(cost, list | tuple):  # older JAX: one dict per module
        cost = cost[0] if cost else None
    if not cost or "bytes accessed" not in cost:
        return None
    return float(cost["bytes accessed"])


def cpu_model() -> str | None:
    """The host CPU's model name (``/proc/cpuinfo``), ``None`` where it cannot be read."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None
