"""Render the measured tables of README.md and docs/benchmarks.md from benchmarks/results/.

Every figure a user reads comes from a results file that records how it was measured (the
command, the jaxcomm and JAX versions, the machine, the date; see ``provenance()`` in
``_two_ranks.py``). This script reads those files and rewrites the text between the marker
comments ``<!-- BEGIN generated: NAME -->`` and ``<!-- END generated: NAME -->``; a field a
file does not record is shown as "not recorded", never filled in.
``tests/docs/test_docs_tables.py`` checks that the committed pages equal what this renders from
the committed files.

Usage::

    python benchmarks/render_tables.py           # rewrite the pages
    python benchmarks/render_tables.py --check   # exit 1 if a page differs from its results
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = (ROOT / "README.md", ROOT / "docs" / "benchmarks.md")
MISSING = "not recorded"
BLOCK = re.compile(
    r"(<!-- BEGIN generated: (?P<name>[\w-]+) .*?-->\n)(?P<body>.*?)"
    r"(<!-- END generated: (?P=name) -->)",
    re.S,
)

# The demo's optimizers: how the tables name them, and when to pick one (advice, not a number).
METHODS = {
    "adam": ("Adam, exact mean every step",
             "fast links (NVLink, ICI, InfiniBand): nothing to save"),
    "compressed_mean": ("`compressed_mean` (1-bit) + `optax.adam`",
                        "momentum SGD or sign methods; with Adam use int8 + error feedback"),
    "onebit_adam": ("`jc.onebit_adam`", "Adam over a slow data-parallel link (Ethernet)"),
    "zero_one_adam": ("`jc.zero_one_adam`", "as 1-bit Adam, with fewer bytes still"),
    "onebit_lamb": ("`jc.onebit_lamb` (lr 0.01)", "large-batch LAMB over a slow link"),
    "diloco_int4": ("`jc.diloco`, H = 50, int4 outer gradients",
                    "very slow links (across sites) and long runs: one sync per H steps"),
    "sharded_int8": ("`jc.sharded(adam)`, int8 both ways",
                     "the optimizer state does not fit on one device"),
}
# Rows of user_path.json that time a demo optimizer's train step (same optimizer, other model).
STEP_ROWS = {"adam": "exact_adam", "onebit_adam": "onebit_adam", "zero_one_adam": "zero_one_adam"}


def load_results(results: Path = RESULTS) -> dict[str, dict]:
    """Every results file, by its path relative to ``results`` (sorted)."""
    return {
        str(p.relative_to(results)): json.loads(p.read_text())
        for p in sorted(results.rglob("*.json"))
    }


def provenance(doc: dict) -> dict[str, str]:
    """The provenance fields of a results file (at its top level or under ``provenance``),
    ``MISSING`` where it does not record one."""
    doc = {**doc.get("provenance", {}), **doc}
    versions = doc.get("versions", {})
    machine = doc.get("machine", {})
    cores = machine.get("cores", machine.get("cpus"))
    cpu = machine.get("cpu")
    return {
        "command": f"`{doc['command']}`" if doc.get("command") else MISSING,
        "jaxcomm": doc.get("jaxcomm", versions.get("jaxcomm", MISSING)),
        "jax": doc.get("jax", versions.get("jax", MISSING)),
        "machine": ", ".join([cpu if cpu else f"CPU model {MISSING}",
                              f"{cores} cores" if cores else f"cores {MISSING}"]),
        "date": doc["date"][:10] if doc.get("date") else MISSING,
        "note": doc.get("note", ""),
    }


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"


def mb(x: float) -> str:
    return f"{x / 1e6:.1f} MB"


def ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms"


def find(results: dict[str, dict], test) -> tuple[str, dict] | tuple[None, None]:
    for name, doc in results.items():
        if test(name, doc):
            return name, doc
    return None, None


def is_demo(name, doc):
    return doc.get("benchmark") == "demo_quality"


def is_user_path(name, doc):
    return "readme_onebit" in doc.get("step_s", {})


def user_path(results: dict[str, dict]) -> tuple[str, dict] | tuple[None, None]:
    """The user's-path results to show: a run on a full-duplex link (each process its own
    link, as hosts have) before one on the shared loopback, the newest first."""
    runs = [(n, d) for n, d in results.items() if is_user_path(n, d)]
    if not runs:
        return None, None
    return max(runs, key=lambda r: (bool(r[1].get("link", {}).get("full_duplex")),
                                    r[1].get("date", "")))


def link_words(doc: dict) -> str:
    """How a two-process results file's link was shaped, in words."""
    link = doc.get("link") or {}
    rate = str(link.get("rate", doc.get("rate", MISSING)))
    match = re.fullmatch(r"(\d+)([gm])bit", rate)
    if match:
        rate = f"{match[1]} {match[2].upper()}bit/s"
    if link.get("full_duplex"):
        return f"{rate} each way, each process in its own network namespace (full duplex)"
    return f"{rate} on one shaped loopback shared by both processes and directions"


def is_torch_peer(name, doc):
    return "torch_fp32" in doc.get("step_s", {})


def is_aot(name, doc):
    return any("topology" in r for r in doc.get("rows", []))


def source(name: str | None) -> str:
    return f"`benchmarks/results/{name}`" if name else "no results file"


def choose(results: dict[str, dict]) -> str:
    """The README's table: quality and traffic on the demo task, step time at 1 Gbit/s."""
    demo_name, demo = find(results, is_demo)
    path_name, path = user_path(results)
    step = path["step_s"] if path else {}
    base = {r["method"]: r for r in demo["rows"]}.get("adam") if demo else None
    rows = []
    for method, (label, when) in METHODS.items():
        row = next((r for r in demo["rows"] if r["method"] == method), None) if demo else None
        if row and base and not row.get("diverged"):
            loss = ("baseline" if method == "adam"
                    else f"{100 * (row['eval_loss'] / base['eval_loss'] - 1):+.1f}%")
            traffic = ("1x" if method == "adam"
                       else f"{base['total_bytes'] / row['total_bytes']:.1f}x less")
        else:
            loss = traffic = "diverged" if row and row.get("diverged") else "not measured"
        key = STEP_ROWS.get(method)
        if key in step and "exact_adam" in step:
            t = step[key]
            time = ms(t) if method == "adam" else f"{ms(t)} ({step['exact_adam'] / t:.1f}x faster)"
        else:
            time = "not measured"
        rows.append([label, loss, traffic, time, when])
    out = table(["optimizer", "held-out loss vs Adam", "bytes sent vs Adam",
                 "train step at 1 Gbit/s", "pick it when"], rows)
    notes = []
    if demo:
        c = demo["config"]
        notes.append(f"Loss and bytes: `jaxcomm demo`'s byte-level transformer LM, {c['steps']} "
                     f"steps on {demo['devices']} simulated devices ({source(demo_name)}).")
    if path:
        notes.append(f"Step time: a 16.8M-parameter MLP, two processes joined by a link of "
                     f"{link_words(path)}, every other argument at its default "
                     f"({source(path_name)}).")
    return out + "\n" + " ".join(notes) + "\n"


def provenance_table(results: dict[str, dict]) -> str:
    rows = []
    for name, doc in results.items():
        p = provenance(doc)
        rows.append([f"`{name}`", p["command"], p["jaxcomm"], p["jax"], p["machine"], p["date"],
                     p["note"]])
    return table(["results file", "command", "jaxcomm", "JAX", "machine", "date", "note"], rows)


def demo_table(results: dict[str, dict]) -> str:
    name, doc = find(results, is_demo)
    if not doc:
        return "No results file of `benchmarks/demo_quality.py` yet.\n"
    base = next(r for r in doc["rows"] if r["method"] == "adam")
    rows = []
    for r in doc["rows"]:
        label = METHODS.get(r["method"], (r["method"],))[0]
        exact, local = r["steps"].get("exact", 0), r["steps"].get("local", 0)
        steps = f"{exact}/{sum(r['steps'].values()) - exact - local}/{local}"
        if r.get("diverged"):
            rows.append([label, "diverged", "", "", mb(r["total_bytes"]), "", steps])
            continue
        rows.append([label, f"{r['eval_loss']:.4f}",
                     "" if r is base else f"{100 * (r['eval_loss'] / base['eval_loss'] - 1):+.1f}%",
                     f"{100 * r['accuracy']:.1f}%", mb(r["total_bytes"]),
                     "1x" if r is base else f"{base['total_bytes'] / r['total_bytes']:.1f}x less",
                     steps])
    c = doc["config"]
    return (table(["optimizer", "held-out loss", "vs Adam", "accuracy", "bytes sent / device",
                   "traffic vs Adam", "steps: exact / compressed / silent"], rows)
            + f"\n{c['steps']} steps, {doc['devices']} devices x {c['batch_per_device']} "
            f"windows of "
            f"{c['context']} bytes, learning rate {c['learning_rate']} "
            f"(1-bit LAMB {c['lamb_learning_rate']}), {100 * c['warmup_fraction']:.0f}% exact "
            f"warm-up, seed {c['seed']}; bytes per device from the compiled HLO "
            f"({source(name)}).\n")


USER_PATH = {
    "readme_pmean": "README Use block with `lax.pmean` (fp32)",
    "readme_onebit": "README Use block, `jc.compressed_pmean(..., jc.OneBit())`",
    "local": "local Adam step, nothing sent (the floor)",
    "exact_adam": "`make_train_step`, exact mean + `optax.adam`",
    "exact_adam_unbounded": "the same, `max_in_flight=None` (no bound on queued steps)",
    "onebit_adam": "`make_train_step`, `jc.onebit_adam` after the freeze",
    "onebit_adam_unbounded": "the same, `max_in_flight=None`",
    "onebit_adam_single": "the same, `specialize_phases=False`",
    "onebit_adam_program": "the same, the compressed program called directly",
    "zero_one_adam": "`make_train_step`, `jc.zero_one_adam`, whole cycles",
}


def user_path_table(results: dict[str, dict]) -> str:
    name, doc = user_path(results)
    if not doc:
        return "No results file of `benchmarks/user_path.py` yet.\n"
    step = doc["step_s"]
    base = {"readme_pmean": "readme_pmean", "readme_onebit": "readme_pmean"}
    rows = []
    for key, label in USER_PATH.items():
        if key not in step:
            continue
        ref = base.get(key, "exact_adam" if key != "local" else None)
        ratio = "" if ref in (None, key) or ref not in step else f"{step[ref] / step[key]:.2f}x"
        rows.append([label, ms(step[key]), ratio])
    return (table(["what", "step (median, slower rank)", "faster than the exact one"], rows)
            + f"\nLink {link_words(doc)}; {doc.get('repeats', MISSING)} rounds of "
            f"{doc.get('steps_per_round', MISSING)} unread steps ({source(name)}).\n")


TORCH = [("fp32", "default fp32 all-reduce", "`lax.pmean` (fp32)"),
         ("fp16", "`fp16_compress_hook`", "`jc.Cast(jnp.float16)`"),
         ("powersgd", "`powerSGD_hook`, rank 4", "`jc.PowerSGD(rank=4)`")]


def torch_table(results: dict[str, dict]) -> str:
    name, doc = find(results, is_torch_peer)
    if not doc:
        return "No results file of `benchmarks/torch_peer.py` yet.\n"
    s = doc["step_s"]
    rows = [[f"{t} / {j}", ms(s[f"torch_{k}"]), ms(s[f"jax_{k}"]),
             f"{s[f'torch_{k}'] / s[f'jax_{k}']:.2f}x"] for k, t, j in TORCH
            if f"torch_{k}" in s and f"jax_{k}" in s]
    if "jax_onebit" in s:
        rows.append(["`jc.OneBit()` (no torch hook)", "", ms(s["jax_onebit"]), ""])
    return (table(["PyTorch DDP hook / jaxcomm", "PyTorch step", "jaxcomm step",
                   "PyTorch / jaxcomm"], rows)
            + f"\nPyTorch {doc.get('torch', MISSING)}; rate {doc.get('rate', MISSING)} "
            f"({source(name)}).\n")


def aot_table(results: dict[str, dict]) -> str:
    rows = []
    for name, doc in results.items():
        if not is_aot(name, doc):
            continue
        params = doc.get("model", {}).get("parameters")
        for r in doc["rows"]:
            a = r.get("analysis") or {}
            if not r.get("compiles"):
                rows.append([f"`{name}`", r["what"], r["topology"], r["flags"], "does not compile",
                             "", ""])
                continue
            rows.append([f"`{name}`", f"{r['what']} ({params / 1e6:.1f}M)" if params else r["what"],
                         r["topology"], r["flags"], f"{a['wire_bytes'] / 1e3:,.1f} KB",
                         f"{100 * a['overlap_fraction']:.0f}%",
                         f"{a.get('cross_slice_bytes', 0) / 1e3:,.1f} KB"])
    if not rows:
        return "No compiled TPU or GPU reports yet.\n"
    return (table(["results file", "step (parameters)", "topology", "flags",
                   "wire bytes / device", "bytes overlapping compute", "across slices"], rows)
            + "\nCompiled ahead of time for the topology with no TPU or GPU attached "
            "(`benchmarks/aot_report.py`); bytes from the compiled HLO.\n")


TIME_TO_LOSS_LABELS = {
    "exact_adam": "Adam, exact mean every step",
    "onebit_adam": "`jc.onebit_adam`",
    "zero_one_adam": "`jc.zero_one_adam`",
    "diloco_int4": "`jc.diloco`, int4 outer gradients",
    "streaming_diloco": "Streaming DiLoCo (`fragments`)",
    "sparseloco": "`jc.diloco` + `jc.SparseLoCo`",
    "demo": "`jc.demo`",
}


def is_time_to_loss(name, doc):
    return "target_loss" in doc and "rows" in doc and "rate" in doc


def time_to_loss_table(results: dict[str, dict]) -> str:
    """How much sooner each method reaches exact Adam's held-out loss, one column per run."""
    runs = sorted(
        ((name, doc) for name, doc in results.items() if is_time_to_loss(name, doc)),
        key=lambda nd: (nd[1].get("size") != "small", nd[1]["rate"] != "1gbit"),
    )
    if not runs:
        return "No results file of `benchmarks/time_to_loss.py` yet.\n"
    header = ["optimizer (times sooner than Adam)"] + [
        f"{doc.get('params', 0) / 1e3:.0f}k parameters, {doc['rate']}" for _, doc in runs
    ]
    rows = []
    for key, label in TIME_TO_LOSS_LABELS.items():
        cells = []
        for _, doc in runs:
            row = doc["rows"].get(key)
            speed = None if row is None else row.get("speedup_to_adam_loss")
            if key == "exact_adam" and row is not None:
                cells.append(f"{row['seconds_to_adam_loss']:.1f} s")
            else:
                cells.append("not run" if row is None else "not reached" if not speed else
                             f"{speed:.2f}x{_spread(row)}")
        rows.append([label, *cells])
    sources = ", ".join(source(name) for name, _ in runs)
    return (table(header, rows)
            + "\nWall-clock training time until the held-out loss exact Adam ends with, against "
            "Adam's own time; byte-level transformer LM, 2 processes on a shaped link, "
            f"{_how_many(runs)} ({sources}; protocol and settings: "
            "`benchmarks/results/time_to_loss.md`).\n")


def _spread(row: dict) -> str:
    """A repeated run's range of speedups, `` (low-high)``; nothing for one run."""
    if "speedup_min" not in row:
        return ""
    low = f"{row['speedup_min']:.2f}" if row["speedup_min"] else "not reached"
    return f" ({low}-{row['speedup_max']:.2f})"


def _how_many(runs) -> str:
    """How many runs each column is: one, or the median of several (the range in brackets)."""
    counts = [doc.get("repeats", 1) for _, doc in runs]
    if max(counts) == 1:
        return "one run each"
    columns = ", ".join(f"{doc.get('params', 0) / 1e3:.0f}k at {doc['rate']}"
                        for _, doc in runs if doc.get("repeats", 1) > 1)
    return (f"the median of {max(counts)} runs, the range in brackets, for {columns}; one run "
            "for the others")


#: One run per link and model: methods within this factor of the best are not told apart.
TIE = 0.9
RATES = {"1gbit": "1 Gbit/s", "100mbit": "100 Mbit/s", "10mbit": "10 Mbit/s"}


def pick_table(results: dict[str, dict]) -> str:
    """Which method to pick on each measured link: the one that reaches exact Adam's held-out
    loss soonest (with any within ``TIE`` of it), the rest ranked, and those that never beat
    exact Adam there."""
    runs = sorted(
        ((name, doc) for name, doc in results.items() if is_time_to_loss(name, doc)),
        key=lambda nd: (-_bits_per_s(nd[1]["rate"]), nd[1].get("params", 0)),
    )
    if not runs:
        return "No results file of `benchmarks/time_to_loss.py` yet.\n"

    def cell(key, speed):
        return f"{TIME_TO_LOSS_LABELS.get(key, key)} ({speed:.2f}x)"

    rows = []
    for _, doc in runs:
        speeds = {k: r.get("speedup_to_adam_loss") or 0.0 for k, r in doc["rows"].items()
                  if k != "exact_adam"}
        ranked = sorted(speeds, key=lambda k: -speeds[k])
        best = speeds[ranked[0]] if ranked else 0.0
        if best <= 1 / TIE:  # nothing clearly sooner than the exact mean
            pick, rest = [], [k for k in ranked if speeds[k] > 1]
            first = TIME_TO_LOSS_LABELS["exact_adam"]
        else:
            pick = [k for k in ranked if speeds[k] >= TIE * best]
            rest = [k for k in ranked if k not in pick and speeds[k] > 1]
            first = "; ".join(cell(k, speeds[k]) for k in pick)
        worse = [f"{TIME_TO_LOSS_LABELS.get(k, k)} "
                 f"({f'{speeds[k]:.2f}x' if speeds[k] else 'not reached'})"
                 for k in ranked if speeds[k] <= 1]
        rows.append([RATES.get(doc["rate"], doc["rate"]),
                     f"{doc.get('params', 0) / 1e3:.0f}k parameters", first,
                     "; ".join(cell(k, speeds[k]) for k in rest) or "none",
                     "; ".join(worse) or "none"])
    sources = ", ".join(source(name) for name, _ in runs)
    return (table(["link", "model", "pick (times sooner than exact Adam)", "then",
                   "no sooner than exact Adam"], rows)
            + f"\nTimes sooner: wall-clock training time until exact Adam's final held-out loss, "
            f"against Adam's own time (the table above: {_how_many(runs)}); methods within "
            f"{100 * (1 - TIE):.0f}% of the fastest share the pick ({sources}).\n")


def _bits_per_s(rate: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]] if m else 0.0


def is_diloco_background(name, doc):
    return name.startswith("diloco_background_") and "cycle_s" in doc


def diloco_background_table(results: dict[str, dict]) -> str:
    """A DiLoCo cycle of H steps with the outer sync in the background and in the step, over H
    inner steps alone, from every ``diloco_background_*.json``."""
    rows = []
    for name, doc in results.items():
        if not is_diloco_background(name, doc):
            continue
        ratios, wire = doc.get("ratios", {}), doc.get("background_wire") or {}
        model = "transformer" if doc.get("model", "").startswith("transformer") else "MLP"
        link = wire.get("link_over_floor")
        # Files without "link" ran on one shaped loopback: both processes and both directions
        # in one queue (every byte paid twice); duplex.sh gives each direction its own.
        duplex = (doc.get("link") or {}).get("full_duplex")
        rows.append([
            model, doc.get("outer_gradient", MISSING), doc.get("rate", MISSING),
            "full duplex" if duplex else "shared queue",
            str(doc.get("H", MISSING)), str(doc.get("fragments", MISSING)),
            "yes" if doc.get("pinned") else "no", str(doc.get("warmup_cycles", 2)),
            f"{ratios['background_over_floor']:.2f}x" if "background_over_floor" in ratios else "",
            f"{ratios['blocking_over_floor']:.2f}x" if "blocking_over_floor" in ratios else "",
            f"{link:.2f}x" if link is not None else "", f"`{name}`",
        ])
    if not rows:
        return "No results file of `benchmarks/diloco_background.py` yet.\n"
    header = ["model", "outer gradient", "rate", "link", "H", "F", "pinned", "warm-up cycles",
              "background", "blocking", "link time alone", "file"]
    return table(header, rows)


def is_bytes_accessed(name, doc):
    return name.startswith("bytes_accessed_") and doc.get("measure") is not None


def _model_name(model: dict) -> str:
    """A short name of a ``bytes_accessed.py`` model: ``MLP 8 x 4096`` or ``GPT 12 x 768``."""
    if model.get("kind") == "mlp":
        return f"MLP {model['layers']} x {model['width']}"
    if model.get("kind") == "gpt":
        return f"GPT {model['layers']} x {model['width']}"
    return str(model.get("kind", MISSING))


def _model_text(model: dict) -> str:
    if model.get("kind") == "mlp":
        return (f"{_model_name(model)}: an MLP of {model['layers']} layers of width "
                f"{model['width']} ({model['parameters']:,} {model['dtype']} parameters), "
                f"{model['batch_per_device']} rows per device")  # fmt: skip
    if model.get("kind") == "gpt":
        return (f"{_model_name(model)}: a GPT-style LM of {model['layers']} layers, width "
                f"{model['width']}, {model['heads']} heads, sequence {model['seq']}, "
                f"vocabulary {model['vocab']} ({model['parameters']:,} fp32 parameters, bf16 "
                f"matmuls), {model['batch_per_device']} sequences per device")  # fmt: skip
    return ", ".join(f"{k} {v}" for k, v in model.items()) if model else MISSING


def memory_table(results: dict[str, dict]) -> str:
    """Bytes through memory per step against the local Adam step, one column per results file
    of ``benchmarks/bytes_accessed.py`` and device count, rows in the files' order (not the
    ``--unguarded-residuals`` comparison, which is not the library's step)."""
    files = [
        (n, d)
        for n, d in results.items()
        if is_bytes_accessed(n, d) and not d.get("unguarded_residuals")
    ]
    if not files:
        return "No results file of `benchmarks/bytes_accessed.py`.\n"
    # The MLP first (the table's reference), then the other models.
    files.sort(key=lambda f: (f[1].get("model", {}).get("kind") != "mlp", f[0]))
    columns: list[tuple[str, str, int]] = []  # (file, label, devices)
    rows: dict[tuple[str, str], dict] = {}
    for name, doc in files:
        plat = doc.get("target", {}).get("platform", "cpu")
        label = "H100 (compiled)" if plat == "h100" else "CPU"
        label = f"{_model_name(doc.get('model', {}))}, {label}"
        for r in doc["rows"]:
            if r["method"] == "local":
                continue
            col = (name, label, r["devices"])
            if col not in columns:
                columns.append(col)
            row = rows.setdefault((r["method"], r["phase"]), {"target": r.get("target")})
            row[col] = r.get("ratio")
    header = ["method", "phase", "target"] + [f"{lab}, {n} devices" for _, lab, n in columns]

    def cell(ratio, target):
        if ratio is None:
            return "-"
        mark = "" if target is None or ratio <= target else " (over)"
        return f"{ratio:.2f}x{mark}"

    body = [
        [f"`{m}`", phase, f"{row['target']:.2f}x"]
        + [cell(row.get(col), row["target"]) for col in columns]
        for (m, phase), row in rows.items()
    ]
    models: dict[str, None] = {}
    for _, doc in files:
        models.setdefault(_model_text(doc.get("model", {})), None)
    sources = ", ".join(source(n) for n, _ in files)
    return table(header, body) + "\nModels: " + "; ".join(models) + f". Sources: {sources}.\n"


RENDERERS = {
    "diloco-background": diloco_background_table,
    "choose": choose,
    "pick": pick_table,
    "time-to-loss": time_to_loss_table,
    "provenance": provenance_table,
    "demo-quality": demo_table,
    "user-path": user_path_table,
    "torch-peer": torch_table,
    "aot": aot_table,
    "memory-traffic": memory_table,
}


def render(text: str, results: dict[str, dict]) -> str:
    """``text`` with every generated block re-rendered from ``results``."""

    def one(m: re.Match) -> str:
        if m["name"] not in RENDERERS:
            raise ValueError(f"unknown generated block {m['name']!r}: one of {sorted(RENDERERS)}")
        return m.group(1) + RENDERERS[m["name"]](results) + m.group(4)

    return BLOCK.sub(one, text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="only report pages that differ")
    args = p.parse_args()
    results = load_results()
    stale = []
    for page in PAGES:
        old = page.read_text()
        new = render(old, results)
        if new != old:
            stale.append(page.relative_to(ROOT))
            if not args.check:
                page.write_text(new)
    verb = ("differ from benchmarks/results (run benchmarks/render_tables.py)" if args.check
            else "rewritten")
    for page in stale:
        print(f"{page}: {verb}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
