"""Long run: 10,000 steps of error-feedback compression on a drifting gradient stream.

Each of ``n`` simulated devices draws ``g_{t,r} = mu_t + sigma * noise_{t,r}`` where the mean
``mu_t`` drifts (a slow rotation between two random directions plus a linear trend), and
``compressed_pmean`` reduces it with error feedback (1-bit, and int8 with both residuals). The
whole run is one ``lax.scan`` inside ``shard_map``. Reported over time:

* ``|e_w| / |g|``: the largest per-device worker residual norm relative to that device's
  gradient norm; ``|e_s| / |mean|``: the server residuals (concatenated) relative to the exact
  mean's norm. Bounded error feedback keeps these flat; a leak makes them grow.
* running-average error: ``|sum_t out_t - sum_t mean_t| / |sum_t mean_t|`` (``mean_t`` the exact
  ``pmean``): by the error-feedback identity it is the pending residual over ``t`` steps, so it
  must shrink like ``1/t``.

    python benchmarks/long_run.py [--steps 10000] [--dim 4096] [--devices 8]
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def run(compressor, *, steps: int, dim: int, n: int, sigma: float = 1.0, seed: int = 0):
    """Returns per-step arrays ``worker_ratio``, ``server_ratio``, ``avg_error`` (NumPy)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    import jaxcomm as jc

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:n]), ("dp",), axis_types=(AxisType.Auto,))
    local = {"g": jnp.zeros((dim,), jnp.float32)}
    state = jc.init_state(compressor, local, axis_size=n)
    gstate = jc.stack_per_device(state, n)
    key = jax.random.PRNGKey(seed)
    a, b, trend = jax.random.normal(key, (3, dim))

    def body(state):
        r = lax.axis_index("dp")

        def step(carry, t):
            state, cum_out, cum_in = carry
            phase = 2 * jnp.pi * t / 2500.0
            mu = jnp.cos(phase) * a + jnp.sin(phase) * b + (t / steps) * trend
            noise = jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, t), r), (dim,))
            g = mu + sigma * noise
            exact = lax.pmean(g, "dp")
            out, state = jc.compressed_pmean({"g": g}, state, axis_name="dp",
                                             compressor=compressor)
            cum_out, cum_in = cum_out + out["g"], cum_in + exact
            bucket = state.buckets[0]
            w = jnp.linalg.norm(bucket.worker_error) / jnp.linalg.norm(g)
            s_sq = lax.psum(jnp.sum(jnp.square(bucket.server_error)), "dp")
            metrics = (
                lax.pmax(w, "dp"),
                jnp.sqrt(s_sq) / jnp.linalg.norm(exact),
                jnp.linalg.norm(cum_out - cum_in) / jnp.linalg.norm(cum_in),
            )
            return (state, cum_out, cum_in), metrics

        zero = jnp.zeros((dim,), jnp.float32)
        (state, _, _), metrics = lax.scan(step, (state, zero, zero), jnp.arange(steps))
        return state, metrics

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("dp"),
                               out_specs=(P("dp"), (P(), P(), P())), check_vma=False))
    final, metrics = fn(gstate)
    return final, tuple(np.asarray(m) for m in metrics)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--devices", type=int, default=8)
    args = p.parse_args(argv)
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp  # noqa: F401  (after XLA_FLAGS)
    import numpy as np

    import jaxcomm as jc

    marks = sorted({m for m in (10, 100, 1000, 10_000, args.steps) if m <= args.steps})
    ok = True
    for name, comp in (("1-bit (OneBit)", jc.OneBit()),
                       ("int8 + EF", jc.Quantize(bits=8, error_feedback=True))):
        start = time.perf_counter()
        final, (w, s, avg) = run(comp, steps=args.steps, dim=args.dim, n=args.devices)
        secs = time.perf_counter() - start
        print(f"\n{name}: {args.steps} steps, {args.devices} devices, dim {args.dim}, {secs:.1f} s")
        print(f"  {'step':>6}  {'|e_w|/|g| max':>14}  {'|e_s|/|mean|':>13}  {'avg error':>10}")
        for m in marks:
            print(f"  {m:>6}  {w[m - 1]:>14.4f}  {s[m - 1]:>13.4f}  {avg[m - 1]:>10.2e}")
        half = args.steps // 2
        growth = w[half:].max() / max(w[:half].max(), 1e-30)
        print(f"  worker ratio: max first half {w[:half].max():.4f}, second half "
              f"{w[half:].max():.4f} (x{growth:.2f}); server max {s.max():.4f}; "
              f"non-finite steps {int(np.asarray(final.nonfinite).max())}")
        ok &= bool(np.isfinite(w).all() and growth < 1.5 and avg[-1] < avg[min(99, len(avg) - 1)])
    print("\nbounded:", "yes" if ok else "NO")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
