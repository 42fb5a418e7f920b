"""Quality and traffic of each optimizer on the demo's task, recorded with its provenance.

Runs ``jaxcomm demo`` (a byte-level transformer LM on Python standard-library source, data
parallel on simulated CPU devices; see ``jaxcomm demo --help``) and writes its table rows
(held-out loss, accuracy, bytes per device from the compiled HLO, training seconds) with the
command, versions, machine, date and the git commit to ``--json``. The README's "which one
for which link" table and the docs' benchmark page are rendered from that file by
``benchmarks/render_tables.py``.

Usage::

    python benchmarks/demo_quality.py [--steps 768] [--methods adam,...] \
        --json benchmarks/results/demo_quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = "adam,compressed_mean,onebit_adam,zero_one_adam,onebit_lamb,diloco_int4,sharded_int8"


def git_commit() -> str:
    """The commit of the code that ran (``unknown`` outside a git checkout; ``+dirty`` when the
    library's files differ from it)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "jaxcomm"],
                               check=True, capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("JAXCOMM_COMMIT", "unknown")
    return head + ("+dirty" if dirty else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=768)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--methods", default=METHODS)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True, help="where to write the results")
    args = p.parse_args()
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", str(args.devices))

    import jax
    import optax
    from _two_ranks import provenance

    from jaxcomm.cli.demo_run import DemoConfig, check_methods, run

    cfg = DemoConfig(steps=args.steps, devices=args.devices, seed=args.seed,
                     methods=check_methods(m.strip() for m in args.methods.split(",")),
                     eval_every=max(1, min(50, args.steps // 4)))
    assert jax.device_count() == args.devices, jax.device_count()
    with tempfile.TemporaryDirectory() as tmp:
        run(cfg, plot_path=None, json_path=os.path.join(tmp, "demo.json"))
        doc = json.loads(Path(tmp, "demo.json").read_text())
    doc.pop("runs", None)  # per-step losses: the rows carry the results
    out = {**provenance(optax=optax.__version__), "commit": git_commit(),
           "benchmark": "demo_quality", "config": asdict(cfg), **doc}
    Path(args.json).write_text(json.dumps(out, indent=1, allow_nan=False) + "\n")
    print(f"json: {args.json}")


if __name__ == "__main__":
    main()
