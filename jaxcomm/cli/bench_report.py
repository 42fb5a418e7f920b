"""What ``jaxcomm bench`` prints and writes: rows from the measurements, the table, the plot and
the JSON document."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from jaxcomm.cli.bench_specs import OPS, BenchConfig, BenchRow, bus_factor


def rows_from_results(results: Sequence[dict]) -> list[BenchRow]:
    rows = []
    for r in results:
        t = statistics.median(r["times"])
        algbw = r["size_bytes"] / t
        rows.append(
            BenchRow(
                op=r["op"],
                compressor=r["compressor"],
                devices=r["devices"],
                size_bytes=r["size_bytes"],
                median_s=t,
                algbw=algbw,
                busbw=algbw * bus_factor(r["op"], r["devices"]),
                wire_bytes=r["wire_bytes"],
                wire_bw=r["wire_bytes"] / t,
                rel_error=r["rel_error"],
                flags=r["flags"],
                compute_s=(
                    statistics.median(r["compute_times"]) if r.get("compute_times") else None
                ),
            )
        )
    return rows


def human_bytes(b: float) -> str:
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if b >= scale:
            return f"{b / scale:.4g}{unit}"
    return f"{b:.0f}"


def _gbps(bw: float) -> str:
    return f"{bw / 1e9:.3g}"


_COLUMNS = (
    "op",
    "compressor",
    "size",
    "time (ms)",
    "compute (ms)",
    "algbw GB/s",
    "busbw GB/s",
    "wire/dev",
    "wire GB/s",
    "error",
    "flags",
)


def _cells(r: BenchRow) -> tuple[str, ...]:
    return (
        r.op,
        r.compressor,
        human_bytes(r.size_bytes),
        f"{r.median_s * 1e3:.3f}",
        "-" if r.compute_s is None else f"{r.compute_s * 1e3:.3f}",
        _gbps(r.algbw),
        _gbps(r.busbw),
        human_bytes(r.wire_bytes),
        _gbps(r.wire_bw),
        f"{r.rel_error:.2g}",
        r.flags or "",
    )


_COMPUTE = _COLUMNS.index("compute (ms)")


def _shown(rows: Sequence[BenchRow], columns=_COLUMNS) -> list[int]:
    """Column indices to show: ``compute`` only when measured (``--no-network``)."""
    measured = any(r.compute_s is not None for r in rows)
    return [i for i in range(len(columns)) if measured or i != _COMPUTE]


def format_rows(rows: Sequence[BenchRow]) -> str:
    """Plain-text table of ``rows``."""
    keep = _shown(rows)
    cells = [[row[i] for i in keep] for row in [_COLUMNS] + [_cells(r) for r in rows]]
    left = {0, 1, len(keep) - 1}  # op, compressor, flags
    widths = [max(len(c[i]) for c in cells) for i in range(len(keep))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i in left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in cells
    )


def print_rows(rows: Sequence[BenchRow], title: str, *, plain: bool = False) -> None:
    """A rich table on a terminal-capable stdout (plain text without ``rich`` or with plain)."""
    try:
        if plain:
            raise ImportError
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(format_rows(rows))
        return
    from rich import box

    show_flags = any(r.flags for r in rows)
    keep = [i for i in _shown(rows) if show_flags or i != len(_COLUMNS) - 1]
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD)
    for i in keep:
        flags = i == len(_COLUMNS) - 1
        table.add_column(
            _COLUMNS[i], justify="left" if i < 2 or flags else "right", no_wrap=not flags
        )
    for r in rows:
        cells = _cells(r)
        table.add_row(*(cells[i] for i in keep), style="red" if r.flags else None)
    console = Console()
    if not console.is_terminal:  # pipes and logs: do not squeeze the table into 80 columns
        console = Console(width=160)
    console.print(table)


def size_label(nbytes: float) -> str:
    """Tick label of a message size: ``64K``, ``1M``, ``16M`` (binary units, as ``--sizes``)."""
    for unit, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g}{unit}"
    return f"{nbytes:g}"


def _minor_gbps_label(y: float, _pos=None) -> str:
    """Label the 2x and 5x minor ticks of a log axis (a decade often holds every point)."""
    if y <= 0:
        return ""
    lead = y / 10 ** math.floor(math.log10(y))
    return f"{y:g}" if round(lead, 6) in (2.0, 5.0) else ""


def plot_title(op: str, where: str | None) -> str:
    """A panel's title: the op and where it ran (``in-process, no network`` by default)."""
    return f"{op}\n{where or 'in-process, no network'}"


def plot_rows(rows: Sequence[BenchRow], path: str, where: str | None = None) -> dict[str, list]:
    """Effective bandwidth (algbw) against size, one line per compressor, one panel per op.

    ``where`` says how the ranks were connected (e.g. ``2 processes (gloo), 1gbit``); without
    it the titles say the run was in one process, with no network in between. Returns what
    the figure shows: ``{"titles": [...], "xticks": [[...], ...]}``, one entry per panel.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError(
            "jaxcomm bench --plot needs matplotlib: pip install 'jaxcomm[cli]' "
            "(or pip install matplotlib)"
        ) from e
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ops = [op for op in OPS if any(r.op == op for r in rows)]
    sizes = sorted({r.size_bytes for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(max(6.0, 4.8 * len(ops)), 4.0), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        for comp in dict.fromkeys(r.compressor for r in rows if r.op == op):
            pts = sorted(
                (r.size_bytes, r.algbw) for r in rows if r.op == op and r.compressor == comp
            )
            ax.plot([p[0] for p in pts], [p[1] / 1e9 for p in pts], marker="o", label=comp)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        # Ticks at the measured sizes, labelled as --sizes writes them (64K, 1M), and plain
        # GB/s numbers instead of 6e-1.
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: size_label(x)))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_gbps_label))
        ax.set_title(plot_title(op, where), fontsize="medium")
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("effective bandwidth algbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    drawn = {
        "titles": [ax.get_title() for ax in axes[0]],
        "xticks": [[t.get_text() for t in ax.get_xticklabels()] for ax in axes[0]],
    }
    plt.close(fig)
    return drawn


def rows_to_json(rows: Sequence[BenchRow], config: BenchConfig, **meta: Any) -> dict:
    """JSON-ready dict of a run."""
    return {"config": asdict(config), **meta, "rows": [r._asdict() for r in rows]}
