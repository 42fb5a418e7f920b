"""jaxcomm.cli.bench: compressor registry, sizes, bus factors, rows vs the ring cost model."""

import dataclasses
import inspect

import numpy as np
import pytest

import jaxcomm as jc
from jaxcomm.cli import bench, bench_report, bench_specs
from tests.conftest import NUM_DEVICES

N = NUM_DEVICES


def test_registry_has_every_exported_compressor():
    registry = bench_specs.compressor_registry()
    exported = {
        name.lower()
        for name in jc.__all__
        if inspect.isclass(getattr(jc, name))
        and issubclass(getattr(jc, name), jc.Compressor)
        and not inspect.isabstract(getattr(jc, name))
    }
    assert {"nocompression", "onebit"} <= exported
    assert exported <= set(registry)
    assert registry["none"] is jc.NoCompression and registry["onebit"] is jc.OneBit


def test_make_compressor_specs(monkeypatch):
    assert bench_specs.make_compressor("none") == jc.NoCompression()
    assert bench_specs.make_compressor(" OneBit() ") == jc.OneBit()

    @dataclasses.dataclass(frozen=True)
    class Scaled(jc.NoCompression):
        factor: float = 1.0

    monkeypatch.setattr(bench_specs, "_USER_REGISTRY", {})
    bench_specs.register_compressor("scaled", Scaled)
    assert bench_specs.make_compressor("scaled(factor=2.5)") == Scaled(2.5)
    with pytest.raises(ValueError, match="unknown compressor 'nope'"):
        bench_specs.make_compressor("nope")
    with pytest.raises(ValueError, match="key=literal"):
        bench_specs.make_compressor("scaled(1 + x)")
    with pytest.raises(ValueError, match="cannot build"):
        bench_specs.make_compressor("onebit(bogus=1)")


def test_parse_size_and_bus_factor():
    assert bench_specs.parse_size("4096") == 4096
    assert bench_specs.parse_size("64K") == 64 * 1024
    assert bench_specs.parse_size("1.5M") == 3 * 2**19
    assert bench_specs.parse_size("1g") == 2**30
    for bad in ("", "12X", "-1K", "0"):
        with pytest.raises(ValueError):
            bench_specs.parse_size(bad)
    assert bench_specs.bus_factor("all_reduce", 8) == 2 * 7 / 8
    for op in ("reduce_scatter", "all_gather", "all_to_all"):
        assert bench_specs.bus_factor(op, 4) == 3 / 4
    with pytest.raises(ValueError):
        bench_specs.bus_factor("broadcast", 4)


def test_config_validation():
    with pytest.raises(ValueError, match="unknown op"):
        bench_specs.BenchConfig(ops=("all_reduce", "gossip")).validate()
    with pytest.raises(ValueError, match="repeats"):
        bench_specs.BenchConfig(repeats=0).validate()
    with pytest.raises(ValueError, match="unknown compressor"):
        bench_specs.BenchConfig(compressors=("zip",)).validate()
    with pytest.raises(ValueError, match="need --procs"):
        bench.run_bench(bench_specs.BenchConfig(), rate="1gbit")


def test_rows_follow_the_cost_model():
    """Every op, exact and 1-bit, on 8 devices: bytes and bandwidths from first principles."""
    size = 16 << 10
    config = bench_specs.BenchConfig(sizes=(size,), repeats=1, warmup=0)
    rows = {(r.op, r.compressor): r for r in bench.run_bench(config)}
    assert set(rows) == {(op, c) for op in bench_specs.OPS for c in ("none", "onebit")} - {
        ("all_to_all", "onebit")  # no compressed all-to-all: measured once, exactly
    }
    ring = {"all_reduce": 2 * (N - 1) / N, "reduce_scatter": (N - 1) / N}
    ring |= {"all_gather": (N - 1) / N, "all_to_all": (N - 1) / N}
    for (op, comp), r in rows.items():
        assert r.devices == N and r.size_bytes == size
        assert r.median_s > 0
        np.testing.assert_allclose(r.algbw, size / r.median_s)
        np.testing.assert_allclose(r.busbw, r.algbw * ring[op])
        np.testing.assert_allclose(r.wire_bw, r.wire_bytes / r.median_s)
        if comp == "none" or op == "all_gather":  # OneBit gathers exactly
            np.testing.assert_allclose(r.wire_bytes, ring[op] * size)
            assert r.rel_error < 1e-6, r
        assert not r.flags
    # 1-bit: the signs (1/32 of the bytes) plus n fp32 scales per stage.
    numel = size // 4
    signs = 2 * (N - 1) / N * numel / 8
    scales = 2 * (N - 1) / N * 4 * N
    np.testing.assert_allclose(rows["all_reduce", "onebit"].wire_bytes, signs + scales)
    assert rows["all_reduce", "none"].wire_bytes / rows["all_reduce", "onebit"].wire_bytes > 25
    # One 1-bit step on Gaussian data is coarse but far from useless (sign and scale kept).
    assert 0.3 < rows["all_reduce", "onebit"].rel_error < 1.0


def test_rows_text_and_plot(tmp_path):
    row = bench_specs.BenchRow(
        "all_reduce", "onebit", 8, 1 << 20, 0.002, 5e8, 8.75e8, 57400, 2.9e7, 0.8, ""
    )
    text = bench_report.format_rows([row, row._replace(compressor="none", size_bytes=4096)])
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["op", "compressor", "size"]
    assert lines[1].split()[:5] == ["all_reduce", "onebit", "1M", "2.000", "0.5"]
    pytest.importorskip("matplotlib")
    out = tmp_path / "bw.png"
    bench_report.plot_rows([row, row._replace(size_bytes=4096, algbw=1e8)], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_says_where_it_ran_and_labels_sizes_as_the_cli_writes_them(tmp_path):
    pytest.importorskip("matplotlib")
    row = bench_specs.BenchRow(
        "all_reduce", "none", 8, 1 << 16, 0.002, 5e8, 8.75e8, 57400, 2.9e7, 0, ""
    )
    rows = [row, row._replace(size_bytes=1 << 20), row._replace(op="all_gather")]
    drawn = bench_report.plot_rows(rows, str(tmp_path / "a.png"))
    ops = ("all_reduce", "all_gather")
    assert drawn["titles"] == [f"{op}\nin-process, no network" for op in ops]
    assert drawn["xticks"][0] == ["64K", "1M"]  # not 2^16, 2^20
    drawn = bench_report.plot_rows(rows, str(tmp_path / "b.png"), where="2 processes (gloo), 1gbit")
    assert drawn["titles"][0] == "all_reduce\n2 processes (gloo), 1gbit"
    assert [bench_report.size_label(s) for s in (512, 4096, 1 << 16, 3 << 19, 1 << 30)] == [
        "512", "4K", "64K", "1.5M", "1G"
    ]


def test_no_network_adds_a_compute_column():
    """--no-network: each row also timed on one device alone (no link), shown as a column."""
    config = bench_specs.BenchConfig(
        ops=("all_reduce", "reduce_scatter"),
        compressors=("onebit",),
        sizes=(16 << 10,),
        repeats=2,
        warmup=1,
        no_network=True,
    )
    rows = bench.run_bench(config)
    assert len(rows) == 2 and all(r.compute_s is not None and r.compute_s > 0 for r in rows)
    header = bench_report.format_rows(rows).splitlines()[0].split("  ")
    assert "compute (ms)" in [h.strip() for h in header]
    plain = bench_report.format_rows([r._replace(compute_s=None) for r in rows])
    assert "compute" not in plain.splitlines()[0]
