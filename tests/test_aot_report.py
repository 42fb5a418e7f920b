"""benchmarks/aot_report.py's two-level accounting, on CPU devices and on libtpu's HLO lines.

The report compiles for H100 and TPU topologies in venvs of their own (``jax[cuda12]``,
``jax[tpu]``); what it counts is checked here without them: the megascale transfers of a
multislice TPU program (lines as libtpu writes them) under the wire model, and a train step over
``("host", "local")`` on 2 x 4 CPU devices, whose "nodes" are the mesh's rows.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import aot_report  # noqa: E402

# Sends of libtpu's multislice programs (two v5e 2x2 slices), trimmed after their attributes.
_ATTRS = (
    "is_host_transfer=true, frontend_attributes="
    '{_xla_host_transfer_handler_name="xla_megascale_runtime",'
)
TUPLE_A2A = (
    "  %send.4 = (u8[2,4,128]{2,1,0:T(4,128)(4,1)}, u32[], token[]) send(%a, %after-all.4), "
    f'channel_id=10, {_ATTRS}_xla_host_transfer_rendezvous="all_to_all.47_0",'
    "_xla_megascale_target={{100000,200000},{100001,200001},{100002,200002},{100003,200003}},"
    '_xla_megascale_transfer_type="ALL_TO_ALL"}'
)
FLAT_A2A = (
    "  %send.16 = (u8[8,4,128]{2,1,0:T(4,128)(4,1)}, u32[], token[]) send(%b, %after-all.16), "
    f'channel_id=38, {_ATTRS}_xla_host_transfer_rendezvous="all_to_all.125_0",'
    "_xla_megascale_target={{100000,200000,100001,200001,200003,100003,200002,100002}},"
    '_xla_megascale_transfer_type="ALL_TO_ALL"}'
)
GATHER = (
    "  %send.5 = (u8[1,4,128]{2,1,0:T(4,128)(4,1)}, u32[], token[]) send(%c, %after-all.5), "
    f'channel_id=11, {_ATTRS}_xla_host_transfer_rendezvous="all_gather_invariant.69_0",'
    '_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_GATHER"}'
)
REDUCE = (
    "  %send.14 = (f32[1,1,128]{2,1,0:T(1,128)}, u32[], token[]) send(%d, %after-all.14), "
    f'channel_id=33, {_ATTRS}_xla_host_transfer_rendezvous="psum_invariant.7_0",'
    '_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:3}",'
    '_xla_megascale_transfer_type="ALL_REDUCE"}'
)


@pytest.mark.parametrize(
    "line, payload, group, wire",
    [
        (TUPLE_A2A, 1024, [2, 1], 512),  # the row for the other slice
        (FLAT_A2A, 4096, [8, 4], 2048),  # the 4 rows for the other slice's chips
        (GATHER, 512, [2, 1], 512),  # its shard, to the one other slice
        (REDUCE, 512, [2, 1], 512),  # 2 (G - 1) / G of it
    ],
)
def test_megascale_wire(line, payload, group, wire):
    kind, g, sent = aot_report._megascale_wire(line, payload)
    assert (g, sent) == (group, wire), kind


def test_dcn_transfers_of_a_program():
    body = "\n".join(
        [f"  %after-all.{i} = token[] after-all()" for i in (4, 5, 14, 16)]
        + [TUPLE_A2A, GATHER, REDUCE, FLAT_A2A]
    )
    text = "ENTRY %main () -> () {\n" + body + "\n}\n"
    sends = aot_report.dcn_transfers(text)
    assert [t["kind"] for t in sends] == ["ALL_TO_ALL", "ALL_GATHER", "ALL_REDUCE", "ALL_TO_ALL"]
    assert [t["bytes"] for t in sends] == [1024, 512, 512, 4096]
    assert sum(t["wire_bytes"] for t in sends) == 512 + 512 + 512 + 2048
    assert all(t["modelled"] for t in sends)


TINY = aot_report.ModelConfig(layers=1, width=64, heads=1, vocab=256, seq=32, batch_per_device=2)
BUCKET = 65536


@pytest.fixture(scope="module")
def two_nodes():
    """A ``("host", "local")`` mesh of 2 x 4 CPU devices; the report's ``node_of`` reads a
    device's row as its node (CPU devices all have process_index 0)."""
    devices = jax.devices("cpu")[:8]
    mesh = jax.sharding.Mesh(np.array(devices).reshape(2, 4), aot_report.TUPLE)
    node = {d.id: i // 4 for i, d in enumerate(devices)}
    patch = pytest.MonkeyPatch()
    patch.setattr(aot_report, "node_of", lambda d: node[d.id])
    yield mesh
    patch.undo()


def _levels(mesh, name: str, axis, phases=None):
    """The report's level bytes of ``name``'s first counted step; ``phases``: that step's phase
    values when already probed (the schedule, not the axis, decides them)."""
    method = aot_report.methods()[name]
    (label, count), *_ = method.counts.items()
    if phases is None:
        phases = aot_report.phases_by_count(method, 8, BUCKET, axis, 2)[count]
    step, state, batch = aot_report.abstract_step(mesh, method, TINY, BUCKET, axis)
    text = step.program(phases).lower(state, batch).compile().as_text()
    analysis = aot_report.analyse(text, list(mesh.devices.flat))
    levels = aot_report.level_bytes(
        text, analysis, mesh, TINY, method, label, two_level=axis != "dp"
    )
    return levels, phases


def test_onebit_adam_tuple_within_bound(two_nodes):
    lv, phases = _levels(two_nodes, "onebit_adam", aot_report.TUPLE)
    assert (lv["nodes"], lv["n_fast"], lv["bits"]) == (2, 4, 1)
    assert lv["bound_bytes"] == pytest.approx(1.3 * 2 * TINY.num_params() / 8 / 4)
    across = sum(v for k, v in lv["by_axes"].items() if "host" in k.split(","))
    assert lv["slow_bytes"] == pytest.approx(across)  # the library's split agrees
    assert 0 < lv["slow_bytes"] <= lv["bound_bytes"] + lv["slack_bytes"]
    assert lv["passes"] and lv["target"]
    assert lv["fast_bytes"] > 10 * lv["slow_bytes"]  # the exact fp32 share stays in the node

    flat_mesh = jax.sharding.Mesh(two_nodes.devices.reshape(-1), ("dp",))
    flat, _ = _levels(flat_mesh, "onebit_adam", "dp", phases)
    assert (flat["nodes"], flat["n_fast"]) == (2, 4)
    assert flat["slow_bytes"] > 2 * lv["slow_bytes"]  # one flat axis: all 1-bit bytes cross


def test_diloco_inner_step_sends_only_scalars_across(two_nodes):
    lv, _ = _levels(two_nodes, "diloco_inner", aot_report.TUPLE)
    assert lv["silent"] and lv["bound_bytes"] == 0
    assert lv["slow_bytes"] <= 16  # the loss the step returns (pmean over both axes)
    assert lv["fast_bytes"] > 0  # the exact gradient mean inside the node
    assert lv["passes"]


def test_bytes_accessed_from_the_cost_analysis_else_the_hlo_count():
    # XLA:GPU compiled without a GPU exposes no cost analysis: the column reads the HLO count.
    assert aot_report.accessed_of({"cost": {"bytes accessed": 10.0}, "hlo_bytes": 12.0}) == 10.0
    assert aot_report.accessed_of({"cost": None, "hlo_bytes": 12.0}) == 12.0
    assert aot_report.accessed_of({"cost": None}) is None
