"""Convergence at a fraction of the traffic: Adam vs 1-bit Adam vs 0/1 Adam vs compressed_mean.

Trains the demo's character-level LM (Python's bundled docs, offline) data-parallel on 8
simulated CPU devices with each optimizer (`jaxcomm.tools.demo`, same data order for all), then
checks issue 3's targets against the exact-Adam baseline measured in the same run:

* 1-bit Adam: held-out loss within 2% of Adam's, with >= 5x less total traffic (warm-up
  included);
* 0/1 Adam: held-out loss within 2% of Adam's, with >= 15x less total traffic.

Traffic is bytes sent per device, from the compiled HLO of the exact and the 1-bit mean of a
parameter-shaped tree, times the number of steps of each kind the optimizers actually took.

Usage::

    python benchmarks/convergence.py [--steps 1500] [--json OUT]
"""

from __future__ import annotations

import argparse
import os
import sys

TARGETS = {"onebit_adam": 5.0, "zero_one_adam": 15.0}
LOSS_TOLERANCE = 0.02


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default="convergence.png")
    args = parser.parse_args(argv)
    import jax

    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        jax.config.update("jax_num_cpu_devices", 8)
    from jaxcomm.tools import demo

    cfg = demo.DemoConfig(steps=args.steps)
    rows = {r["method"]: r for r in demo.run(cfg, plot_path=args.plot, json_path=args.json)}
    failed = 0
    print("\ntargets (held-out loss vs adam, total traffic vs adam):")
    for method, ratio in TARGETS.items():
        row = rows[method]
        ok = row["loss_vs_adam"] <= LOSS_TOLERANCE and row["traffic_ratio"] >= ratio
        failed += not ok
        print(
            f"  {method:>14}: loss {100 * row['loss_vs_adam']:+.2f}% "
            f"(<= +{100 * LOSS_TOLERANCE:.0f}%), "
            f"traffic {row['traffic_ratio']:.1f}x less (>= {ratio:.0f}x): "
            + ("PASS" if ok else "FAIL")
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
