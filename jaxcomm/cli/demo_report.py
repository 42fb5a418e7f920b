"""What ``jaxcomm demo`` reports: divergence in words, two narrow tables, JSON, the plot.

The demo's result has to be readable wherever it runs: a terminal of 80 columns, a CI log, or
under ``jaxcomm launch`` (which prefixes every line with ``[rank 0] ``). So the tables are plain
ASCII text no wider than :data:`MAX_WIDTH` columns, one for quality and traffic, one for the
steps and the link times; ``--json`` gives the same numbers to machines.

A run *diverged* when it ended non-finite or no better than it started (training or held-out
loss); it is dated to the step where that final excursion began. Its traffic is not a saving
(the run did not train), so its traffic column is blank, the JSON has ``"traffic_ratio":
null``, and a sentence below the tables says which method diverged, at which step, and the
likely cause. The plot cuts a diverged run's curves at that step and fits the y axis to the
runs that trained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from jaxcomm.cli.demo_methods import DILOCO_INT4, EXACT, LOCAL, ONEBIT, RATES_GBIT, SHARDED_INT8

#: Widest line of the tables: 100 columns minus ``jaxcomm launch``'s ``[rank 0] `` prefix.
MAX_WIDTH = 90

#: Methods whose compressed stage reuses a variance (or trust ratio) frozen at the end of the
#: exact warm-up: the usual cause of a blow-up right after the switch.
_FROZEN_VARIANCE = ("onebit_adam", "zero_one_adam", "onebit_lamb")


@dataclass(frozen=True)
class Divergence:
    """Where and why a run stopped training: ``step`` is 1-based."""

    method: str
    step: int
    what: str
    cause: str

    def sentence(self) -> str:
        return f"{self.method} diverged at step {self.step} ({self.what}): {self.cause}"


def _finite(x: float) -> bool:
    return x is not None and math.isfinite(x)


def find_divergence(result, warmup_steps: int | None) -> Divergence | None:
    """Where ``result`` (a ``demo.RunResult``) diverged, or ``None`` if it trained.

    A run diverged when it ended non-finite or no better than it started: its last training loss
    is non-finite or at least its first one, or so is its final held-out loss. The step is where
    the final excursion began: the first step from which every training loss stayed non-finite
    or at or above the first loss (a run that had a non-finite step, skipped it and recovered
    did not diverge; :func:`nonfinite_steps` counts those).
    """
    losses = list(result.losses)
    if not losses:
        return None
    first = losses[0]

    def bad(x) -> bool:
        return not _finite(x) or x >= first

    step = None
    if len(losses) > 1 and bad(losses[-1]):
        step = len(losses)
        while step > 2 and bad(losses[step - 2]):
            step -= 1
        nonfinite = next((i + 1 for i in range(step - 1, len(losses)) if not _finite(losses[i])),
                         None)
        what = f"training loss {losses[step - 1]:.4g}, up from {first:.4g} at step 1"
        if nonfinite == step:
            what = f"training loss {losses[step - 1]}"
        elif nonfinite is not None:
            what += f"; non-finite from step {nonfinite}"
    elif bad(result.final_eval_loss):
        evals = list(zip(result.eval_steps, result.eval_losses, strict=True))
        step = next((s for s, v in evals if not _finite(v)), None) or len(losses)
        what = (
            f"final held-out loss {result.final_eval_loss:.4g}, no better than the first "
            f"training loss {first:.4g}"
        )
    if step is None:
        return None
    return Divergence(result.method, step, what, _likely_cause(result.method, step, warmup_steps))


def nonfinite_steps(result) -> list[int]:
    """1-based steps whose training loss was NaN or infinite."""
    return [i + 1 for i, x in enumerate(result.losses) if not _finite(x)]


def _likely_cause(method: str, step: int, warmup_steps: int | None) -> str:
    if warmup_steps is None:
        return "the learning rate or the warm-up length is likely wrong for this run"
    if method.startswith("diloco"):  # no warm-up: local steps, then an outer step per sync
        return (
            "the learning rate is likely too high for the local steps, or the outer step too "
            "large for what they drifted; try a smaller --lr"
        )
    if method in ("adam", "sharded_int8") or step <= warmup_steps:
        phase = "" if method in ("adam", "sharded_int8") else " (during the exact warm-up)"
        return (
            f"the learning rate is likely too high for this model{phase}; try a smaller --lr "
            "(--lamb-lr for onebit_lamb)"
        )
    after = step - warmup_steps
    if method in _FROZEN_VARIANCE:
        return (
            f"{after} steps after the switch to 1-bit communication at step {warmup_steps}: the "
            f"warm-up was likely too short for Adam's variance to settle before {method} froze "
            "it (a near-zero variance entry turns compressed momentum into a huge step); use more "
            "--steps or a larger --warmup-fraction"
        )
    if method == "compressed_mean":
        return (
            f"{after} steps after the switch to 1-bit gradients at step {warmup_steps}: Adam's "
            "variance is computed from compressed gradients; use a larger --warmup-fraction or "
            "a smaller --lr"
        )
    return f"{after} steps after the switch to compressed communication at step {warmup_steps}"


def human_bytes(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(nbytes) < 1000 or unit == "TB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{nbytes:.0f} B"
        nbytes /= 1000
    return str(nbytes)


def loss_text(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "nan" if x is None or math.isnan(x) else str(x)
    return f"{x:.4f}" if abs(x) < 1e4 else f"{x:.3g}"


def _seconds(s: float) -> str:
    return f"{s:.3g} s"


def annotate(rows: list[dict[str, Any]], results: Sequence, warmup_steps: int | None) -> None:
    """Adds ``diverged`` (a dict or ``None``) to every row and blanks diverged runs' savings.

    The baseline for the ``*_vs_adam`` fields is the ``adam`` row when it trained; a diverged
    run gets ``traffic_ratio = None`` (no saving is claimed for a run that did not train).
    """
    by_method = {r.method: r for r in results}
    for row in rows:
        div = find_divergence(by_method[row["method"]], warmup_steps)
        row["diverged"] = None if div is None else dict(step=div.step, what=div.what,
                                                         cause=div.cause)
        row["nonfinite_steps"] = nonfinite_steps(by_method[row["method"]])
    base = next((r for r in rows if r["method"] == "adam" and r["diverged"] is None), None)
    for row in rows:
        row["baseline"] = row is base
        if base is None or row["diverged"] is not None:
            row["traffic_ratio"] = None
            row["loss_vs_adam"] = None
        else:
            row["traffic_ratio"] = base["total_bytes"] / max(row["total_bytes"], 1.0)
            row["loss_vs_adam"] = row["eval_loss"] / base["eval_loss"] - 1.0


def summarize(
    results: Sequence, bytes_per_kind: dict[str, float], warmup_steps: int | None = None
) -> list[dict[str, Any]]:
    """Rows of the final table: losses, accuracy, traffic and its ratio to the baseline.

    A run that diverged gets ``diverged`` (step, what, likely cause) and no ratios
    (:func:`annotate`); ``warmup_steps`` dates the cause.
    """
    rows = []
    for r in results:
        total = sum(bytes_per_kind[k] for k in r.kinds + r.final_kinds)
        row = dict(
            method=r.method,
            eval_loss=r.final_eval_loss,
            train_loss=float(np.mean(r.losses[-max(1, len(r.losses) // 10) :])),
            accuracy=r.final_accuracy,
            bytes_per_step=total / len(r.kinds),  # the final average is spread over the run
            total_bytes=total,
            steps={k: r.kinds.count(k) for k in (EXACT, ONEBIT, LOCAL, DILOCO_INT4, SHARDED_INT8)},
            seconds=r.seconds,
        )
        for rate in RATES_GBIT:
            row[f"comm_s_{rate}gbit"] = total * 8 / (rate * 1e9)
        rows.append(row)
    annotate(rows, results, warmup_steps)
    return rows


def divergences(rows: Sequence[dict[str, Any]]) -> list[Divergence]:
    return [
        Divergence(r["method"], **r["diverged"]) for r in rows if r.get("diverged") is not None
    ]


def _table(header: Sequence[str], body: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Plain columns separated by two spaces: the first ``left`` left-aligned, the rest right."""
    cells = [list(header), *[list(r) for r in body]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]

    def line(row):
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return [line(cells[0]), rule, *(line(r) for r in cells[1:])]


def format_report(
    rows: Sequence[dict[str, Any]], bytes_per_kind: dict[str, float], *, devices: int,
    steps: int, warmup_steps: int, exact: str = "exact", onebit: str = "1-bit",
    local: str = "local",
) -> str:
    """The demo's result as plain text, every line at most :data:`MAX_WIDTH` columns."""
    out = [
        f"jaxcomm demo: byte-level transformer LM, {devices} devices, {steps} steps "
        f"(exact warm-up: {warmup_steps})",
        "",
    ]
    quality = []
    for r in rows:
        div = r.get("diverged")
        if div is not None:
            rel, traffic = "diverged", "-"
        elif r.get("baseline"):
            rel, traffic = "baseline", "baseline"
        else:
            rel = "-" if r.get("loss_vs_adam") is None else f"{100 * r['loss_vs_adam']:+.2f}%"
            tr = r.get("traffic_ratio")
            traffic = "-" if tr is None else f"{tr:.1f}x less"
        quality.append((
            r["method"],
            loss_text(r["eval_loss"]),
            rel,
            f"{100 * r['accuracy']:.1f}%" if _finite(r["accuracy"]) else "-",
            human_bytes(r["total_bytes"]),
            traffic,
        ))
    out += _table(
        ("method", "held-out loss", "loss vs Adam", "accuracy", "sent/device", "traffic vs Adam"),
        quality,
    )
    out.append("")
    link = []
    for r in rows:
        s = r["steps"]
        extra = sum(v for k, v in s.items() if k not in (exact, onebit, local))
        kinds = f"{s.get(exact, 0)}/{s.get(onebit, 0)}/{s.get(local, 0)}"
        if extra:
            kinds += f" +{extra} other"
        link.append((
            r["method"],
            kinds,
            human_bytes(r["bytes_per_step"]),
            _seconds(r["comm_s_1gbit"]),
            _seconds(r["comm_s_10gbit"]),
            _seconds(r["comm_s_100gbit"]),
            f"{r['seconds']:.0f} s",
        ))
    out += _table(
        ("method", "exact/1-bit/local", "per step", "@1 Gbit/s", "@10 Gbit/s", "@100 Gbit/s",
         "train"),
        link,
    )
    out += [
        "",
        f"Bytes per device per step, from the compiled HLO: exact mean "
        f"{human_bytes(bytes_per_kind[exact])}, 1-bit mean {human_bytes(bytes_per_kind[onebit])} "
        f"({bytes_per_kind[exact] / bytes_per_kind[onebit]:.1f}x less)"
        + "".join(
            f", {kind} {human_bytes(b)} ({bytes_per_kind[exact] / b:.1f}x less)"
            for kind, b in bytes_per_kind.items()
            if b and kind not in (exact, onebit, local) and any(r["steps"].get(kind) for r in rows)
        )
        + ".",
        "Link columns: total bytes per device / link rate (communication time only).",
    ]
    for d in divergences(rows):
        out.append("")
        out.append(f"WARNING: {d.sentence()}. No traffic saving is reported for it.")
    for r in rows:
        bad = r.get("nonfinite_steps") or []
        if bad and r.get("diverged") is None:
            out.append("")
            out.append(
                f"NOTE: {r['method']} had a non-finite training loss at {len(bad)} step"
                f"{'s' if len(bad) > 1 else ''} (first: step {bad[0]}) and recovered."
            )
    return "\n".join(_wrap(line) for line in out)


def _wrap(line: str) -> str:
    """Prose lines wrapped at MAX_WIDTH (table lines are narrower by construction)."""
    if len(line) <= MAX_WIDTH:
        return line
    import textwrap

    return "\n".join(
        textwrap.wrap(line, MAX_WIDTH, subsequent_indent="  ", break_on_hyphens=False)
    )


def print_report(text: str, file: TextIO | None = None) -> None:
    print(text, file=file, flush=True)


def json_safe(obj: Any) -> Any:
    """``obj`` with NaN/Inf floats replaced by ``None`` (strict JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj


def plot(results: Sequence, bytes_per_kind: dict[str, float], path: str, *,
         warmup_steps: int | None) -> tuple[list[str], tuple[float, float] | None]:
    """Held-out loss against step and against cumulative bytes, both linear; (notes, y limits).

    The training loss (20-step mean) is drawn faintly behind the held-out loss in the step
    panel; a dashed line marks the end of the exact warm-up. A diverged run's curves stop at
    the step before it diverged and the y axis is fitted to the runs that trained, so one
    blow-up does not flatten every other curve; the notes (also in the figure) say so.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(12, 4.8))
    notes, finite_vals = [], []
    for i, r in enumerate(results):
        color = f"C{i}"
        div = find_divergence(r, warmup_steps)
        stop = len(r.losses) if div is None else max(0, div.step - 1)
        label = r.method
        if div is not None:
            label += f" (diverged at step {div.step}, cut)"
            notes.append(f"{r.method} diverged at step {div.step}: its curves stop there")
        losses = np.asarray(r.losses[:stop], dtype=float)
        cumulative = np.cumsum([bytes_per_kind[k] for k in r.kinds]) / 1e6
        window = max(1, min(20, len(losses)))
        if len(losses):
            smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
            steps = np.arange(len(smooth)) + window
            by_step.plot(steps, smooth, color=color, alpha=0.3, lw=1)
        ev = [(s, v) for s, v in zip(r.eval_steps, r.eval_losses, strict=True)
              if s <= stop and _finite(v)]
        if ev:
            es, ev_loss = np.array([e[0] for e in ev]), np.array([e[1] for e in ev])
            by_step.plot(es, ev_loss, color=color, marker=".", label=label)
            by_bytes.plot(cumulative[es - 1], ev_loss, color=color, marker=".", label=label)
            if div is None:
                finite_vals += list(ev_loss) + list(smooth[np.isfinite(smooth)])
    if warmup_steps:
        by_step.axvline(warmup_steps, color="grey", ls="--", lw=1)
        by_step.text(warmup_steps, 1.0, " warm-up ends", transform=by_step.get_xaxis_transform(),
                     va="top", fontsize="small", color="grey")
    ylim = None
    if finite_vals:
        lo, hi = min(finite_vals), max(finite_vals)
        pad = 0.05 * (hi - lo or 1.0)
        ylim = (lo - pad, hi + pad)
        for ax in (by_step, by_bytes):
            ax.set_ylim(*ylim)
    by_step.set(xlabel="step", ylabel="loss",
                title="held-out loss (dots) and training loss (faint, 20-step mean)")
    by_bytes.set(xlabel="cumulative MB sent per device", ylabel="held-out loss",
                 title="held-out loss per byte on the wire")
    by_step.set_xlim(left=0)
    by_bytes.set_xlim(left=0)
    for ax in (by_step, by_bytes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    if notes:
        fig.text(0.01, 0.01, "; ".join(notes), fontsize="small", color="red")
    fig.tight_layout(rect=(0, 0.04 if notes else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return notes, ylim
