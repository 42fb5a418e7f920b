"""The README's demo table, written from a ``jaxcomm demo --json`` document (so it is never
typed): ``python -m jaxcomm.cli.demo_readme runs/demo.json``."""

from __future__ import annotations

from typing import Any

from jaxcomm.cli.demo_report import human_bytes, loss_text

#: README labels of the demo's methods (others are shown by name).
LABELS = {
    "adam": "Adam, exact `pmean`",
    "compressed_mean": "`compressed_mean` (1-bit, EF) + Adam",
    "onebit_adam": "1-bit Adam (`onebit_adam`)",
    "zero_one_adam": "0/1 Adam (`zero_one_adam`)",
    "onebit_lamb": "1-bit LAMB (`onebit_lamb`)",
    "diloco_int4": "DiLoCo H=50, int4 + EF outer gradients (`diloco`)",
    "sharded_int8": "`jc.sharded` Adam, int8 grads + int8 weights",
}


def markdown_table(doc: dict[str, Any]) -> str:
    """The README's demo table from a ``jaxcomm demo --json`` document (so it is never typed)."""
    lines = [
        "| optimizer | held-out loss | vs Adam | accuracy | total bytes / device "
        "| traffic vs Adam | comm @ 1 Gbit/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        label = LABELS.get(r["method"], f"`{r['method']}`")
        if r.get("diverged"):
            rel, traffic = f"diverged at step {r['diverged']['step']}", "-"
        elif r.get("baseline"):
            rel, traffic = "", "1x"
        else:
            rel = "" if r.get("loss_vs_adam") is None else f"{100 * r['loss_vs_adam']:+.1f}%"
            tr = r.get("traffic_ratio")
            traffic = "-" if tr is None else f"{tr:.1f}x less"
        acc = "-" if r.get("accuracy") is None else f"{100 * r['accuracy']:.1f}%"
        lines.append(
            f"| {label} | {loss_text(r['eval_loss'])} | {rel} | {acc} "
            f"| {human_bytes(r['total_bytes'])} | {traffic} | {r['comm_s_1gbit']:.1f} s |"
        )
    return "\n".join(lines)


if __name__ == "__main__":  # python -m jaxcomm.cli.demo_readme runs/demo.json
    import json
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m jaxcomm.cli.demo_readme DEMO_JSON  (from jaxcomm demo --json)")
    with open(sys.argv[1]) as f:
        print(markdown_table(json.load(f)))
